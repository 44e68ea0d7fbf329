"""Can one launch stream a 1-row decode layer's weights at the plain-read rate? (issue 5's 1-stream goal)

Times, on one GPU, as CUDA-graph replays (best of five):
- a plain read of 50 MB and of 113 MB (a Qwen3-30B-A3B layer's products at 1 row): the anchor;
- one 1-row product over the same bytes, its weights read through tensor descriptors in [BN, BK] tiles, one
  program a panel or persistent programs (1 or 2 an SM), with and without `tl.range(..., flatten=True)` and
  `warp_specialize=True` (producer warps for the loads, where this Triton specializes: it prints whether it does);
- a whole layer's products (qkv, o, router, 8 experts' gate_up and down: 113 MB) as ONE persistent launch, the
  products walked in turn, with and without warp specialization, with and without a grid barrier between products
  (an atomic count and a spin, as a real layer kernel would need: the barrier variants run last, since a grid
  barrier hangs if the programs cannot all be resident).
The figures (and what they say about a persistent decode layer) are in docs/PERFORMANCE.md (current) and docs/perf-log.md, twelfth session.

    python bench/persistent_layer.py      (about a minute on an H200)
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _stream(p_w, p_out, PER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = i.to(tl.int64) * PER
    for k in range(0, PER, BLOCK):
        acc += tl.load(p_w + base + k + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(p_out + i, tl.sum(acc))


@triton.jit
def _gemv(w_desc, p_x, p_y, N, K, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr, FLAT: tl.constexpr):
    """Programs walk the [BN, K] row panels i, i + programs, ...: y[0, panel] = x[0] . w[panel]^T (16-row dot)."""
    o_m = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    for t in tl.range(tl.program_id(0), tl.cdiv(N, BN), tl.num_programs(0), flatten=FLAT, warp_specialize=WS):
        acc = tl.zeros([16, BN], dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BK)):
            b_w = w_desc.load([t * BN, kk * BK])  # [BN, BK]
            b_x = tl.load(p_x + o_m[:, None] * K + (kk * BK + o_k)[None, :], mask=(o_m < 1)[:, None], other=0.0)
            acc = tl.dot(b_x, b_w.T, acc)
        tl.store(p_y + o_m[:, None] * N + (t * BN + tl.arange(0, BN))[None, :], acc, mask=(o_m < 1)[:, None])


@triton.jit
def _barrier(p_bar, target):
    tl.debug_barrier()
    tl.atomic_add(p_bar, 1, sem="release", scope="gpu")
    c = tl.atomic_add(p_bar, 0, sem="acquire", scope="gpu")
    while c < target:
        c = tl.atomic_add(p_bar, 0, sem="acquire", scope="gpu")


@triton.jit
def _layer(d_qkv, d_o, d_r, d_gu, d_dn, p_x, p_y, p_bar, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr,
           BARRIERS: tl.constexpr):
    """A 30B layer's products at 1 row (qkv, o, router, 8 experts' gate_up and down: 113 MB) in one persistent
    launch, each product's panels walked in turn (`_gemv`'s loop, flattened), optionally with a grid barrier
    between products."""
    n_p = tl.num_programs(0)
    _gemv(d_qkv, p_x, p_y, 5120, 2048, BN, BK, WS, True)
    if BARRIERS:
        _barrier(p_bar, n_p * 1)
    _gemv(d_o, p_x, p_y, 2048, 4096, BN, BK, WS, True)
    if BARRIERS:
        _barrier(p_bar, n_p * 2)
    _gemv(d_r, p_x, p_y, 128, 2048, BN, BK, WS, True)
    if BARRIERS:
        _barrier(p_bar, n_p * 3)
    _gemv(d_gu, p_x, p_y, 12288, 2048, BN, BK, WS, True)
    if BARRIERS:
        _barrier(p_bar, n_p * 4)
    _gemv(d_dn, p_x, p_y, 16384, 768, BN, BK, WS, True)


def timeit(f, args, launches=24, before=None):
    """Best of five replays of a graph of `launches` calls, per call in us; `before()` runs ahead of each replay,
    outside the timing (barrier counters set back to zero)."""
    for a in args:
        if before:
            before()
        f(a, 0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            f(args[i % len(args)], i)
    if before:
        before()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    best = 1e9
    for _ in range(5):
        if before:
            before()
        torch.cuda.synchronize()
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1000 / launches)
    return best


def main():
    dev, bf = "cuda", torch.bfloat16
    # whether this triton warp-specializes for sm_90 at all
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"w_desc": "tensordesc<bf16[32, 128]>", "p_x": "*bf16", "p_y": "*fp32", "N": "i32", "K": "i32",
           "BN": "constexpr", "BK": "constexpr", "WS": "constexpr", "FLAT": "constexpr"}
    try:
        c = triton.compile(ASTSource(_gemv, sig, constexprs={(5,): 32, (6,): 128, (7,): True, (8,): True}),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4))
        print("triton", triton.__version__, "ttg.warp_specialize in the sm_90 IR:", "warp_specialize" in c.asm["ttgir"])
    except Exception as ex:  # noqa: BLE001 - say why and go on timing
        print("triton", triton.__version__, "sm_90 compile of the ws loop failed:", type(ex).__name__, str(ex)[:200])

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(16, 2048, device=dev, dtype=bf)
    out = torch.empty(1 << 16, device=dev, dtype=torch.float32)
    for rows, label in [(12288, "gate_up-sized 50 MB"), (27648, "a layer's 113 MB")]:
        ws = [torch.randn(rows, 2048, device=dev, dtype=bf) for _ in range(3)]
        nbytes = rows * 2048 * 2
        per = rows * 2048 // (sms * 4) // 2048 * 2048
        us = timeit(lambda w, i: _stream[(sms * 4,)](w, out, PER=per, BLOCK=2048, num_warps=4, num_stages=3), ws)
        print(f"{label}: plain read {us:7.2f} us {sms * 4 * per * 2 / us / 1e6:5.2f} TB/s", flush=True)
        y = torch.empty(16, rows, device=dev, dtype=torch.float32)
        for BN, BK, st in [(32, 128, 4), (32, 128, 6), (64, 128, 4), (32, 256, 4)]:
            ds = [TensorDescriptor.from_tensor(w, [BN, BK]) for w in ws]
            for grid_label, grid in [("a program a panel", rows // BN), ("1/SM", sms), ("2/SM", 2 * sms)]:
                for ws_on in (False, True):
                    for flat in (False, True):
                        if grid == rows // BN and (ws_on or flat):
                            continue
                        name = f"  BN{BN} BK{BK} st{st} {grid_label:17} ws {ws_on!s:5} flat {flat!s:5}"
                        try:
                            us = timeit(lambda d, i: _gemv[(grid,)](d, x, y, rows, 2048, BN=BN, BK=BK, WS=ws_on,
                                                                     FLAT=flat, num_warps=4, num_stages=st), ds)
                            print(f"{name}: {us:7.2f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)
                        except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                            print(f"{name}: failed {type(ex).__name__} {str(ex)[:160]}", flush=True)
        del ws
        torch.cuda.empty_cache()
    # a whole layer's products in one launch, with and without warp specialization and barriers
    shapes = [(5120, 2048), (2048, 4096), (128, 2048), (12288, 2048), (16384, 768)]
    copies = 2
    layers = [[torch.randn(n, k, device=dev, dtype=bf) for n, k in shapes] for _ in range(copies)]
    xl = torch.randn(16, 4096, device=dev, dtype=bf)
    yl = torch.empty(16 * 16384, device=dev, dtype=torch.float32)
    bar = torch.zeros(64 * 4, dtype=torch.int32, device=dev)
    nbytes = sum(n * k * 2 for n, k in shapes)
    BN, BK, st = 32, 128, 4
    descs = [[TensorDescriptor.from_tensor(w, [BN, BK]) for w in ws] for ws in layers]
    for barriers in (False, True):  # barrier variants last: a grid barrier hangs if the programs cannot all be resident
        for per_sm in ((1, 2, 3) if not barriers else (1, 2)):
            for ws_on in (False, True):
                def f(d, i, grid=sms * per_sm, ws_on=ws_on, barriers=barriers):
                    _layer[(grid,)](*d, xl, yl, bar[(i % 64) * 4:], BN=BN, BK=BK, WS=ws_on, BARRIERS=barriers,
                                    num_warps=4, num_stages=st)  # a counter of its own for each launch in the graph
                try:
                    us = timeit(f, descs, launches=16, before=bar.zero_)
                    print(f"layer 113 MB {per_sm}/SM ws {ws_on!s:5} barriers {barriers!s:5}: {us:7.2f} us "
                          f"{nbytes / us / 1e6:5.2f} TB/s", flush=True)
                except Exception as ex:  # noqa: BLE001 - one failing variant must not hide the others
                    print(f"layer {per_sm}/SM ws {ws_on} barriers {barriers}: failed {type(ex).__name__} "
                          f"{str(ex)[:160]}", flush=True)


if __name__ == "__main__":
    main()
