"""How decode windows' projections split their K dimension, against the bytes they must read.

A decode projection at 1 to 64 rows is bound by reading its weight. `linear_triton` splits K into a number of
chunks fixed by the weight's shape (a row's sums must not depend on the row count); this times every projection
of a real shape under several split rules and tile widths, and prints each one's achieved bandwidth against the
measured copy bandwidth. Each timed call reads its weight from memory, as a decode window does (a window reads
each layer's weights once): one CUDA graph with programmatic dependent launch calls the projection on enough
distinct copies of the weight to pass the L2 cache (the same weight called again would be served by L2, which
favoured other tiles: seventh session).

    python bench/linear_tiles.py --shape qwen3-30b-a3b --rows 1,8,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import copy_bandwidth, gpu_seconds  # noqa: E402
from shapes import shape  # noqa: E402

import strata.kernels.linear as lin  # noqa: E402


def projections(name: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each decode projection of the shape."""
    spec = shape(name)
    a, h = spec.attention, spec.hidden_size
    q = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    out = {"attention qkv": (q + 2 * a.num_kv_heads * a.head_dim, h), "attention o": (h, a.num_heads * a.head_dim),
           "router": (spec.moe.num_experts, h)}
    if spec.gdn is not None:
        g = spec.gdn
        conv = 2 * g.num_k_heads * g.k_head_dim + g.num_v_heads * g.v_head_dim
        out["gdn in_proj"] = (conv + g.num_v_heads * g.v_head_dim + 2 * g.num_v_heads, h)
        out["gdn out"] = (h, g.num_v_heads * g.v_head_dim)
    if spec.moe.shared_dim:
        out["shared gate_up"] = (2 * spec.moe.shared_dim, h)
        out["shared down"] = (h, spec.moe.shared_dim)
    out["lm_head"] = (spec.vocab_size, h)
    return out


def rule_waves(sms: int, floor: float = 0.9):
    """The fewest chunks whose programs fill the SMs' waves to `floor` (else the best filling)."""

    def split_k(n: int, k: int, block_n: int, block_k: int) -> int:
        tiles = triton.cdiv(n, block_n)
        best, best_fill, split = 1, 0.0, 1
        while k % (split * block_k) == 0 and k // split >= max(lin.MIN_CHUNK, block_k) and split <= 64:
            progs = tiles * split
            fill = progs / (triton.cdiv(progs, sms) * sms)
            if fill >= floor:
                return split
            if fill > best_fill + 1e-9:
                best, best_fill = split, fill
            split *= 2
        return best

    return split_k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--rows", default="1,8,64")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth(dev)
    print(f"{args.shape} projections, bf16, {torch.cuda.get_device_name()} ({sms} SMs); copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    shipped_rule, shipped_cfg = lin.split_k, dict(lin.CONFIGS)
    variants = {
        "shipped": (shipped_rule, shipped_cfg[dt]),
        "sixth session (64 wide)": (rule_256, (64, 128, 4)),
        "shipped rule, 64 wide": (shipped_rule, (64, 128, 4)),
        "waves 0.9": (rule_waves(sms, 0.9), shipped_cfg[dt]),
        "waves 0.9, k256 s3": (rule_waves(sms, 0.9), (32, 256, 3)),
    }
    print(f"{'projection':>15} {'N x K':>13} {'rows':>4} {'variant':>24} {'split':>5} {'us':>7} {'TB/s':>6} "
          f"{'of copy':>7}")
    try:
        for label, (n, k) in projections(args.shape).items():
            copies = max(2, triton.cdiv(3 * L2_BYTES, n * k * 2))  # together three times the L2 cache
            ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
            w = ws[0]
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k, device=dev, dtype=dt)
                ref = None
                for name, (rule, cfg) in variants.items():
                    lin.split_k, lin.CONFIGS[dt] = rule, cfg
                    out = lin.linear_triton(x, w)
                    ref = out if ref is None else ref
                    err = (out.float() - ref.float()).abs().max().item()
                    # chunks left for the reader, as decode windows leave them (linear_split)
                    sec = gpu_seconds(lambda: [lin.linear_split(x, c) for c in ws], reps=5, graph=True) / copies
                    tb = n * k * 2 / sec / 1e12
                    split = rule(n, k, cfg[0], cfg[1])
                    print(f"{label:>15} {f'{n} x {k}':>13} {rows:4d} {name:>24} {split:5d} {sec * 1e6:7.2f} {tb:6.2f} "
                          f"{tb * 1e12 / bw:7.0%}" + (f"  max diff {err:.2e}" if err > 0.05 else ""))
    finally:
        lin.split_k, lin.CONFIGS[dt] = shipped_rule, shipped_cfg[dt]


def rule_256(n: int, k: int, block_n: int, block_k: int) -> int:
    """The sixth session's rule: chunks doubled while the programs stay within 256 and chunks keep 256 columns."""
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split * 2 <= 256 and k // (split * 2) >= max(lin.MIN_CHUNK, block_k) \
            and k % (split * 2 * block_k) == 0:
        split *= 2
    return split


L2_BYTES = 50 << 20  # an H100 / H200's L2 cache

if __name__ == "__main__":
    main()
