"""The CPU expert pool's products against a kernel of our own, on this host's CPU (issue 29's first goal).

One window's experts at the Qwen3-30B-A3B shape (hidden 2048, expert width 768, bf16): E distinct experts, each
with R rows, computed (a) as the pool computes them today, two oneDNN products an expert on weights in oneDNN's
blocked layout (`strata.kernels.onednn`), and (b) by the pool's own kernel, `strata/experts/experts_bf16.c`, built on
the host by `strata.experts.native` (AVX512_BF16 dot products; every expert of the window in one OpenMP region).
Printed beside the host's read bandwidth (bench/experts.py's streaming read of 1 GiB, the roofline the issue
measures against; the experts' bytes must exceed the last-level cache, or they are read from it: 64 experts are
600 MB): microseconds an expert, GB/s of weights, the share of the roofline, the error against float64, and
whether a row's output is bitwise the same alone as beside the others (row invariance). The same experts
quantized to q8_0 are read by the kernel as their records too (the pool's way for q8_0 experts; GB/s of their
records, error against their dequantized weights).

    python bench/cpu_experts.py                 # 64 experts, 1 and 8 rows, torch's threads
    python bench/cpu_experts.py --rows 1,2,4,8 --threads 15
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experts import host_read_gbps  # noqa: E402  (bench/experts.py's anchor: 1 GiB, beyond any cache)
from strata.experts import native  # noqa: E402
from strata.kernels import onednn  # noqa: E402
from strata.kernels.elementwise import silu_mul  # noqa: E402
from strata.quant.online import quantize_weight  # noqa: E402
from strata.quant.packed import dequantize  # noqa: E402

H, I = 2048, 768


def best(f, repeats: int = 9) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64, help="distinct experts a window (64: 600 MB, more than a "
                   "last-level cache)")
    p.add_argument("--rows", default="1,8", help="rows per expert (at most 8 a pass of the kernel; more loop)")
    p.add_argument("--threads", type=int, help="torch's (and so the kernel's OpenMP) threads")
    args = p.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    roof = max(host_read_gbps(threads).values())
    lib = native.load()
    if lib is None:
        print("the pool's kernel is not available here (no AVX512_BF16 or no gcc): oneDNN's way alone")
    torch.manual_seed(0)
    n = args.experts
    gate_up = [torch.randn(2 * I, H, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    down = [torch.randn(H, I, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    blocked = [(onednn.block(g), onednn.block(d)) for g, d in zip(gate_up, down)] if onednn.available(torch.bfloat16) else None
    nbytes = n * 3 * I * H * 2
    print(f"{n} experts of {3 * I * H * 2 / 1e6:.1f} MB (bf16), {torch.get_num_threads()} threads; host read {roof:.1f} GB/s")

    def pool_way(x, counts):
        ys, s = [], 0
        for e, c in enumerate(counts):
            v = x[s:s + c]
            s += c
            if blocked:
                ys.append(onednn.linear(silu_mul(onednn.linear(v, blocked[e][0])), blocked[e][1]))
            else:
                ys.append(F.linear(silu_mul(F.linear(v, gate_up[e])), down[e]))
        return torch.cat(ys).float()

    def kernel_way(x, counts):
        return native.experts_bf16(x, counts, gate_up, down, threads)

    # the same experts quantized to q8_0, read by the kernel as their records (the pool's way for q8_0 experts)
    q8 = [(quantize_weight(g, "q8_0", torch.bfloat16), quantize_weight(d, "q8_0", torch.bfloat16))
          for g, d in zip(gate_up, down)]
    q8_records = ([g.data.contiguous() for g, _ in q8], [d.data.contiguous() for _, d in q8])
    q8_bytes = sum(g.data.numel() + d.data.numel() for g, d in q8)

    def q8_way(x, counts):
        return native.experts_bf16(x, counts, *q8_records, threads)

    def reference(x, counts, weights):
        ys, s = [], 0
        for e, c in enumerate(counts):
            v = x[s:s + c].double()
            s += c
            h = v @ weights[e][0].double().T
            ys.append((F.silu(h[:, :I]) * h[:, I:]) @ weights[e][1].double().T)
        return torch.cat(ys)

    plain = list(zip(gate_up, down))
    q8_plain = [(dequantize(g), dequantize(d)) for g, d in q8]
    ways = [("oneDNN" if blocked else "F.linear", pool_way, plain, nbytes)]
    if lib:
        ways += [("kernel", kernel_way, plain, nbytes), ("q8_0", q8_way, q8_plain, q8_bytes)]
        if native.use_amx(True):  # AMX tiles where the CPU has them (a 16-row tile: rows beside rows cost no reads)
            native.use_amx(False)
            for prefetch in (256, 0):
                def amx_way(x, counts, prefetch=prefetch):
                    native.use_amx(True, prefetch)
                    try:
                        return native.experts_bf16(x, counts, gate_up, down, threads)
                    finally:
                        native.use_amx(False)
                ways.append((f"amx-pf{prefetch}", amx_way, plain, nbytes))
        else:
            print("no AMX here (or Linux refused its tile state): the AVX-512 kernel alone")
    print(f"{'rows':>4} {'way':>9} {'us/expert':>9} {'GB/s':>6} {'of roof':>7} {'rel err':>8} {'row alone == in block':>21}")
    for r in (int(v) for v in args.rows.split(",")):
        counts = [r] * n
        x = torch.randn(r * n, H, dtype=torch.bfloat16)
        for name, way, weights, size in ways:
            ref = reference(x, counts, weights)
            y = way(x, counts)
            err = float((y.double() - ref).abs().max() / ref.abs().max())
            alone = way(x[:1], [1] + [0] * (n - 1)) if name != ways[0][0] else way(x[:1], [1])
            same = torch.equal(alone[0], y[0])
            t = best(lambda: way(x, counts))
            gbps = size / t / 1e9
            print(f"{r:>4} {name:>9} {t / n * 1e6:>9.0f} {gbps:>6.1f} {gbps / roof:>7.0%} {err:>8.1e} {str(same):>21}",
                  flush=True)


if __name__ == "__main__":
    main()
