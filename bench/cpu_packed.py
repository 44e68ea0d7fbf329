"""Products over packed weights on the CPU (`strata/kernels/cpu_packed.c`) against the float32 ways, on this host.

One token of SmolLM2-135M (the embedded default, GGUF q4_1 projections and a q8_0 head tied to the embedding):
30 layers of qkv [960, 576], o [576, 576], gate_up [3072, 576] and down [576, 1536] (the engine's fused matrices),
each layer its own copy of the weights (a token's bytes exceed the last-level cache, as in the engine), and the
head [49152, 576]. At each R (rows of x a step: decode windows, small prompt windows), ms a token for
  packed   `cpu_packed.linear` over the records (q4_1, the head q8_0): about 96 MB a token
  onednn   oneDNN's float32 products over the dequantized weights in its blocked layout (`strata.kernels.onednn`,
           the CPU engine's way before this kernel): about 540 MB a token
  linear   F.linear over the plain float32 weights
with the ratio onednn / packed and the packed bytes' GB/s beside the host's read rate (a float32 sum over 1 GiB).
The packed kernel runs 8 lanes wide (AVX2) and, where the CPU has AVX-512, 16 (`cpu_packed.use_wide`); the ratio
and GB/s are the faster one's.

    python bench/cpu_packed.py                     # R = 1, 2, 4, 8, 32; torch's threads
    python bench/cpu_packed.py --rows 1,64 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpu_experts import best  # noqa: E402 (the fastest of a few timed runs)
from strata.kernels import cpu_packed, onednn  # noqa: E402
from strata.quant import gguf_blocks  # noqa: E402
from strata.quant.packed import PackedWeight, dequantize  # noqa: E402

T = gguf.GGMLQuantizationType
LAYERS = 30
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def read_gbps() -> float:
    """GB/s of a float32 sum over 1 GiB (beyond any cache)."""
    buf = torch.ones(256 * 2**20)
    return buf.nbytes / best(buf.sum) / 1e9


def weights() -> list[PackedWeight]:
    """A token's packed matrices in the order they run: each layer's copies of one random q4_1 set, then the head."""
    torch.manual_seed(0)
    made = {name: gguf_blocks.from_gguf(gguf_blocks.quantize(torch.randn(shape) * 0.05, T.Q4_1), T.Q4_1, shape)
            for name, shape in LAYER.items()}
    out = [PackedWeight("q4_1", w.shape, data=w.data.clone()) for _ in range(LAYERS) for w in made.values()]
    head = gguf_blocks.from_gguf(gguf_blocks.quantize(torch.randn(HEAD) * 0.05, T.Q8_0), T.Q8_0, HEAD)
    return out + [head]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,32", help="rows of x a product")
    p.add_argument("--threads", type=int, help="torch's (and so the kernel's OpenMP) threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_packed.available():
        print("the packed kernel is not available here (no AVX2/FMA/F16C, or no gcc): nothing to compare")
        return
    packed = weights()
    plain = [dequantize(w) for w in packed]
    blocked = [onednn.block(w) for w in plain] if onednn.available(torch.float32) else None
    nbytes = sum(w.nbytes() for w in packed)
    roof = read_gbps()
    print(f"{torch.get_num_threads()} threads; a token reads {nbytes / 1e6:.0f} MB packed, "
          f"{sum(w.numel() * 4 for w in plain) / 1e6:.0f} MB as float32; host read rate {roof:.1f} GB/s")
    widths = sorted({cpu_packed.use_wide(False), cpu_packed.use_wide(True)})  # 8 lanes, and 16 with AVX-512
    print(f"{'R':>3} " + " ".join(f"{f'packed{lanes} ms':>11}" for lanes in widths)
          + f" {'onednn ms':>10} {'linear ms':>10} {'onednn/packed':>14} {'packed GB/s':>12} {'of read rate':>13}")
    for r in (int(v) for v in args.rows.split(",")):
        xs = {k: torch.randn(r, k) for k in {w.shape[1] for w in packed}}
        t_packed = []
        for lanes in widths:
            cpu_packed.use_wide(lanes == 16)
            t_packed.append(best(lambda: [cpu_packed.linear(xs[w.shape[1]], w) for w in packed]))
        t_onednn = best(lambda: [onednn.linear(xs[w.shape[1]], w) for w in blocked]) if blocked else float("nan")
        t_linear = best(lambda: [F.linear(xs[w.shape[1]], w) for w in plain])
        fastest = min(t_packed)
        gbps = nbytes / fastest / 1e9
        print(f"{r:>3} " + " ".join(f"{t * 1e3:>11.2f}" for t in t_packed)
              + f" {t_onednn * 1e3:>10.2f} {t_linear * 1e3:>10.2f} {t_onednn / fastest:>14.2f} {gbps:>12.1f}"
              f" {gbps / roof:>12.0%}")

if __name__ == "__main__":
    main()
