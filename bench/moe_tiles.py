"""Tile choices of the routed experts' grouped GEMMs for decode and prompt windows, against their floors.

At 1 to 64 rows a decode window's experts are bound by reading the routed experts' weights: this times
`fused_experts_triton` with several `ExpertTiles` at a real shape (replayed from a CUDA graph over three copies of
the experts, so the weights come from memory, not L2) and prints each one's achieved bandwidth against the
measured copy bandwidth (the floor is the distinct experts' bytes at that rate). The chosen
DECODE_TILES must be one configuration for every row count (a row's bits depend on the tiles). With `--prompt`
it times PROMPT_TILES' candidates on a prompt's rows (eagerly, as prompt windows run), where the floor is the
larger of the weights' bytes at the copy rate and the products' FLOPs at the measured bf16 matmul rate.

    python bench/moe_tiles.py --shape qwen3-30b-a3b --rows 1,8,64
    python bench/moe_tiles.py --shape qwen3-next-80b-a3b --rows 4096 --prompt
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import copy_bandwidth, gpu_seconds, kernel_seconds, matmul_rate  # noqa: E402
from shapes import shape  # noqa: E402

from strata.kernels.moe import DECODE_TILES, PROMPT_TILES, ExpertTiles, fused_experts_triton, route_triton  # noqa: E402

CANDIDATES = [
    DECODE_TILES,  # the one in use: gate_up and down in one launch (handoff)
    replace(DECODE_TILES, handoff=False),  # the same tiles in two launches (seventh session: 8 rows 125.1 vs 119.2 us)
    ExpertTiles(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3),  # the first choice
    ExpertTiles(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=3),
    ExpertTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    ExpertTiles(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=5),
    ExpertTiles(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3),
    ExpertTiles(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4),
    ExpertTiles(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=4),
    ExpertTiles(block_m=16, block_n=16, block_k=256, num_warps=4, num_stages=3),
    ExpertTiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),  # the choice before (down 32 wide)
    ExpertTiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4, down_n=64, down_k=256),
    ExpertTiles(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=4, down_n=64, down_k=128),
    ExpertTiles(block_m=16, block_n=32, block_k=128, num_warps=2, num_stages=4),
    # weight tiles by tensor descriptors: within 1 % at 1 / 8 / 64 rows (sixth session)
    replace(DECODE_TILES, tma=True, handoff=False),
    # tiles walked by 2 programs / SM: 1 row -1 %, 8 rows +7 %, 64 +4 % (sixth session)
    replace(DECODE_TILES, persistent=2, handoff=False),
]
PROMPT_CANDIDATES = [  # (the fifth session's other candidates, 2-3x slower, are in docs/perf-log.md)
    PROMPT_TILES,  # the one in use: weight tiles by tensor descriptors, gate_up 4 stages, down walked, pairs bf16
    replace(PROMPT_TILES, tma=False, num_stages=3, down_stages=None, down_persistent=2),  # pointer loads
    replace(PROMPT_TILES, tma=False, num_stages=3, down_stages=None, down_persistent=0),  # one program per tile
    replace(PROMPT_TILES, tma=False, num_stages=3, down_stages=None, down_persistent=0, round_pairs=False),  # f32
    replace(PROMPT_TILES, persistent=1),  # the gate_up products walked too
    replace(PROMPT_TILES, down_persistent=2),
]


def _label(t: ExpertTiles) -> str:
    down = f" down {t.down_n}x{t.down_k or t.block_k}" if t.down_n else ""
    down_walk = t.persistent if t.down_persistent is None else t.down_persistent
    walk = f" persistent {t.persistent}/{down_walk}" if t.persistent or down_walk else ""
    pairs = " bf16 pairs" if t.round_pairs else ""
    tma = " tma" if t.tma else ""
    down_stages = f" down stages {t.down_stages}" if t.down_stages else ""
    handoff = " one launch" if t.handoff else ""
    return (f"{t.block_m}, {t.block_n}, {t.block_k}, {t.num_warps}, {t.num_stages}{down}{down_stages}{walk}{pairs}{tma}"
            f"{handoff}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--prompt", action="store_true", help="PROMPT_TILES' candidates, timed eagerly")
    args = p.parse_args()
    spec = shape(args.shape)
    m, h = spec.moe, spec.hidden_size
    dev, dt = "cuda", torch.bfloat16
    # decode windows read each layer's experts from memory: the timed graph cycles through copies (together more
    # than the L2 cache), as a step cycles through its layers
    copies = 1 if args.prompt else 3
    experts = [(torch.randn(m.num_experts, 2 * m.expert_dim, h, device=dev, dtype=dt) / h**0.5,
                torch.randn(m.num_experts, h, m.expert_dim, device=dev, dtype=dt) / m.expert_dim**0.5)
               for _ in range(copies)]
    gate_up, down = experts[0]
    bw, flops = copy_bandwidth(dev), matmul_rate(dev)
    per_expert = 3 * m.expert_dim * h * 2
    print(f"{args.shape} experts ({m.num_experts} x [{2 * m.expert_dim}, {h}] + [{h}, {m.expert_dim}]), bf16, "
          f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"{'rows':>4} {'tiles (m, n, k, warps, stages)':>64} {'us':>8} {'floor us':>9} {'TB/s':>6} {'of copy':>8} "
          f"{'of floor':>9} {'gate_up us':>10} {'down us':>8} {'others us':>9}")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, h, device=dev, dtype=dt)
        weights, ids = route_triton(torch.randn(rows, m.num_experts, device=dev), m.top_k, True)
        distinct = ids.unique().numel()
        floor = max(distinct * per_expert / bw, rows * m.top_k * 3 * 2 * m.expert_dim * h / flops)
        for t in PROMPT_CANDIDATES if args.prompt else CANDIDATES:
            try:
                sec = gpu_seconds(lambda: [fused_experts_triton(x, weights, ids, g, d, t) for g, d in experts],
                                  reps=20, graph=not args.prompt) / copies
            except Exception as e:  # noqa: BLE001 - a configuration the GPU cannot run is reported, not fatal
                print(f"{rows:4d} {_label(t):>64} failed: "
                      f"{type(e).__name__}")
                continue
            tb = distinct * per_expert / sec / 1e12
            parts = kernel_seconds(lambda: fused_experts_triton(x, weights, ids, gate_up, down, t))
            gu, dn = parts.pop("_gate_up_kernel", 0.0), parts.pop("_down_kernel", 0.0)
            gu += parts.pop("_experts_kernel", 0.0)  # one launch for both: counted under gate_up
            print(f"{rows:4d} {_label(t):>64} "
                  f"{sec * 1e6:8.1f} {floor * 1e6:9.1f} {tb:6.2f} {tb * 1e12 / bw:8.0%} {floor / sec:9.0%} "
                  f"{gu * 1e6:10.1f} {dn * 1e6:8.1f} {sum(parts.values()) * 1e6:9.1f}")


if __name__ == "__main__":
    main()
