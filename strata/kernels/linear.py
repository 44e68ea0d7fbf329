"""A row-invariant linear layer for decode windows: out = x @ weight.T (+ bias).

Row m of the result is bitwise the same whatever the other rows are and however many there are: the
tiles are fixed constants (never derived from M), each program owns one [BLOCK_M, BLOCK_N] output tile
and runs its K loop in one fixed order, and no arithmetic crosses rows. BLOCK_M is the tensor-core minimum,
16: a decode window of up to 16 rows reads the weight exactly once, which is what the step costs (it is
bound by reading W). A narrow weight (few BLOCK_N tiles) would keep most of the GPU idle, so K is split
into `split_k(N, K)` chunks, a number fixed by the weight's shape alone: each program sums one chunk, and a
second kernel adds the chunks' float32 partial sums in chunk order — or the kernel that reads the result adds
them as it loads it (`linear_split`, `deferred.SplitSum`). `linear_reference` is the torch op it mirrors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels.deferred import SplitSum, finish, sum_chunks
from strata.kernels.packed import SCALED_AFTER, grid_words, packed_mm, packed_tile, scaled_after
from strata.kernels.pdl import pdl, wait_for_prior
from strata.quant.packed import PackedWeight

BLOCK_M = 16
# dtype -> (BLOCK_N, BLOCK_K, num_stages); one configuration per dtype, whatever M is. The 16-bit ones: 32 columns
# x 128-deep steps (seventh session, bench/linear_tiles.py on an H200 with the weights read from memory, not from
# L2: 1 row 17 % faster for the 30B shape's o projection and 4-20 % for the other decode projections than 64
# columns; at 64 rows 0.7-3.1 us slower per projection, under 1 % of a 64-row step).
CONFIGS = {
    torch.float32: (64, 64, 3),
    torch.float16: (32, 128, 4),
    torch.bfloat16: (32, 128, 4),
}
NUM_WARPS = 4
TARGET_PROGRAMS = 512  # at most about four per SM of a large GPU
FILL_PROGRAMS = 128  # a weight with fewer programs than this is split down to MIN_CHUNK columns a chunk
MIN_CHUNK = 256  # the fewest K columns one program of a split sums
LONG_CHUNK = 1024  # else a split stops where chunks would get shorter than this: a program streams 8 steps or more


def split_k(n: int, k: int, block_n: int, block_k: int) -> int:
    """How many chunks K is split into for an [n, k] weight: a power of two, a function of the shape only (so a
    row's sums never depend on how many rows share the call), 1 for weights wide enough on their own.

    A program's first weight loads wait a full trip to memory, then its pipeline streams; on an H200 a program
    of 8 steps or more streamed best (the 30B shape's o projection: 256 programs of 8 steps 6.4 us, 512 of 4
    steps 7.9 us). So K is split while the programs stay under TARGET_PROGRAMS and each keeps LONG_CHUNK columns,
    or, for a weight too narrow to occupy the GPU (a router), down to MIN_CHUNK."""
    tiles = triton.cdiv(n, block_n)
    split = 1
    while True:
        more = split * 2
        chunk = k // more
        if tiles * more > TARGET_PROGRAMS or chunk < max(MIN_CHUNK, block_k) or k % (more * block_k):
            return split
        if tiles * split >= FILL_PROGRAMS and chunk < LONG_CHUNK:
            return split
        split = more


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K]; bias: [N] or None -> [M, N]."""
    return F.linear(x, weight, bias)


@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    p_x, p_w, p_b, p_out, p_grid,
    M, N, K, K_CHUNK,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    FMT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile over the K columns [i_s * K_CHUNK, (i_s + 1) * K_CHUNK). PARTIAL: store
    the float32 sums at p_out + i_s * M * N (for `_sum_chunks_kernel`), else the finished tile. FMT > 0: the weight
    is packed (p_w: its row records, stride_wn bytes apart; `strata.kernels.packed`): the K-quants' products by
    `packed_mm` (integer codes, each scale group's scale after its sum), the other formats' tiles dequantized and
    rounded to x's dtype, then multiplied as a plain weight's tile is."""
    wait_for_prior(PDL)
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    i_s = tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_m = o_m < M
    m_n = o_n < N
    k0 = i_s * K_CHUNK
    p_xk = p_x + o_m.to(tl.int64)[:, None] * stride_xm + (k0 + o_k)[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    p_wk = p_w + o_n.to(tl.int64)[None, :] * stride_wn + (k0 + o_k)[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    # tl.full and // rather than tl.zeros / tl.cdiv (jit helpers that break the interpreter when triton
    # was imported before TRITON_INTERPRET was set)
    k_end = tl.minimum(K - k0, K_CHUNK)
    if scaled_after(FMT, BLOCK_M, SCALED_AFTER):
        b_acc = packed_mm(p_x + o_m.to(tl.int64) * stride_xm, m_m, p_w + o_n.to(tl.int64) * stride_wn, m_n, k0,
                          k0 + k_end, K, FMT, BLOCK_M, BLOCK_N)
    else:
        b_acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for i_k in range(0, (k_end + BLOCK_K - 1) // BLOCK_K):
            m_k = o_k < k_end - i_k * BLOCK_K
            b_x = tl.load(p_xk, mask=m_m[:, None] & m_k[None, :], other=0.0)
            if FMT == 0:
                b_w = tl.load(p_wk, mask=m_k[:, None] & m_n[None, :], other=0.0)
            else:
                b_w = tl.trans(packed_tile(p_w, o_n.to(tl.int64), m_n, k0 + i_k * BLOCK_K, K, stride_wn, p_grid, FMT,
                                           BLOCK_K))
                b_w = tl.where(m_k[:, None], b_w, 0.0).to(p_x.dtype.element_ty)
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision=INPUT_PRECISION)
            p_xk += BLOCK_K * stride_xk
            p_wk += BLOCK_K * stride_wk
    m_o = m_m[:, None] & m_n[None, :]
    if PARTIAL:
        p_p = p_out + i_s.to(tl.int64) * M * N + o_m.to(tl.int64)[:, None] * N + o_n[None, :]
        tl.store(p_p, b_acc, mask=m_o)
    else:
        if HAS_BIAS:
            b_acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        p_o = p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :]
        tl.store(p_o, b_acc.to(p_out.dtype.element_ty), mask=m_o)


@triton.jit(do_not_specialize=["M"])
def _sum_chunks_kernel(p_part, p_b, p_out, s_chunk, s_pm, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = sum over chunks s = 0, 1, ... of part[s, m, n] (+ bias), in that order."""
    wait_for_prior(PDL)
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    b_acc = sum_chunks(p_part + i_m.to(tl.int64) * s_pm + o_n, m_n, s_chunk, SPLIT)
    if HAS_BIAS:
        b_acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(p_out + i_m.to(tl.int64) * stride_om + o_n, b_acc.to(p_out.dtype.element_ty), mask=m_n)


def sum_chunks_triton(value: SplitSum, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A SplitSum of [M, N] finished: its chunks added in order (+ bias), rounded to its dtype."""
    parts = value.parts.reshape(value.splits, -1, value.shape[-1])  # [S, M, N], a copy only if not a view
    if parts.stride(2) != 1:
        parts = parts.contiguous()
    s, m, n = parts.shape
    out = torch.empty(m, n, dtype=value.dtype, device=parts.device)  # [M, N]
    if m and n:
        _sum_chunks_kernel[(m, triton.cdiv(n, 1024))](
            parts, bias if bias is not None else parts, out, parts.stride(0), parts.stride(1), n, out.stride(0),
            SPLIT=s, HAS_BIAS=bias is not None, BLOCK=1024, **pdl(parts))
    return out.reshape(value.shape)


def linear_split(x: torch.Tensor, weight: torch.Tensor | PackedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor | SplitSum:
    """`linear_triton`, except that a weight split over K chunks returns its chunks unsummed (a `SplitSum`, for a
    reader that adds them as it loads them; `deferred.finish` adds them on their own). With a bias, or a weight
    wide enough not to split, the result is the finished tensor. A `PackedWeight` is read packed: the same tiles
    and split, so the result is bitwise that of the weight dequantized to x's dtype."""
    m, k = x.shape
    n, k_w = weight.shape
    assert k == k_w, f"x has K={k}, weight has K={k_w}"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"
    block_n, block_k, num_stages = CONFIGS[x.dtype]
    split = split_k(n, k, block_n, block_k) if m and n else 1
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # [S, M, N] the chunks' sums
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, BLOCK_M), split)
    packed = isinstance(weight, PackedWeight)
    w = weight.data.contiguous() if packed else weight
    if packed and x.stride(1) != 1:  # `packed_mm` reads rows of x as runs of columns
        x = x.contiguous()
    linear_kernel[grid](
        x, w, bias if bias is not None else x, out, grid_words(weight),
        m, n, k, k // split if split > 1 else k,
        x.stride(0), x.stride(1), w.stride(0), 1 if packed else w.stride(1), out.stride(-2),
        FMT=weight.kernel_format if packed else 0,
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=NUM_WARPS, num_stages=num_stages, **pdl(x)
    )
    if split == 1:
        return out
    value = SplitSum(out, x.dtype)
    return sum_chunks_triton(value, bias) if bias is not None else value


def linear_triton(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (x's dtype, any strides, or packed); bias: [N] or None -> [M, N] in x's dtype.

    float32 inputs multiply in full float32 (as F.linear does by default), the 16-bit ones on tensor
    cores; all accumulate in float32."""
    return finish(linear_split(x, weight, bias))
