"""Packed weights read inside the kernels: a tile of a `PackedWeight` dequantized in registers.

`packed_tile` gives the float32 values of rows o_n, columns k0 .. k0 + BLOCK_K of a packed weight, exactly what
`strata.quant.packed.dequantize` gives there; a kernel rounds them to its activations' dtype and multiplies as it
does a plain weight's tile, so a packed weight's products are bitwise those of the weight dequantized at load
(the same tiles, the same order). Only the packed bytes cross the memory bus: a decode window, bound by reading
its weights, reads 2x (8-bit), 3.5x (4-bit K-quants) fewer bytes than bfloat16.

`dequantize_triton` writes a whole packed weight out in its activations' dtype, for prompt windows' products on
torch's GEMMs (a prompt window's arithmetic, not its weight reads, bounds it; the write is a small part of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels import onednn
from strata.quant.packed import PackedWeight, iq3s_grid


@triton.jit
def _load3(p_r, m_n, start, stride, limit, G: tl.constexpr, C: tl.constexpr):
    """[BN, G, C] from each row's record p_r ([BN, 1] pointers): element start + g * stride + c (< limit, else 0)."""
    o = start + tl.arange(0, G)[:, None] * stride + tl.arange(0, C)[None, :]  # [G, C]
    return tl.load(p_r[:, :, None] + o[None, :, :], mask=m_n[:, None, None] & (o < limit)[None, :, :], other=0)


@triton.jit
def _word(p_r, b, m):
    """int32 [BN, G]: the 32-bit word of each row's record (p_r: [BN, 1], 16-byte aligned) holding byte b ([G]).
    Scales are read as words, not as the bytes or halves they are: the compiler prefetches a loop's loads a few
    iterations ahead only when each thread's load is 4 bytes or more (a narrower one would wait every step)."""
    return tl.load(p_r.to(tl.pointer_type(tl.int32)) + (b // 4)[None, :], mask=m, other=0)


@triton.jit
def _field(p_r, b, m, SIZE: tl.constexpr):
    """int32 [BN, G]: the unsigned SIZE-byte fields (1 or 2, inside one word) at byte offsets b of each record."""
    return (_word(p_r, b, m) >> ((b % 4) * 8)[None, :]) & ((1 << (8 * SIZE)) - 1)


@triton.jit
def _exact_float(c, OFFSET: tl.constexpr):
    """float32 of the int32 c + OFFSET (0 <= c + OFFSET < 2**23) minus OFFSET, exactly: c + OFFSET placed in the
    mantissa of 2**23 and 2**23 + OFFSET taken off. An integer-to-float conversion runs at an eighth of the rate
    of an add on a Hopper multiprocessor (16 a clock against 128); this is an or and a subtraction."""
    return ((c + OFFSET) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _half(f):
    """float16 bits (int32) -> float32."""
    return f.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def packed_tile(p_w, o_n, m_n, k0, K, s_row, p_grid, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BN, BLOCK_K]: w[o_n, k0 + j] of a packed weight whose row records (`strata.quant.packed`) start at
    p_w (uint8), s_row bytes apart (o_n: int64 row indices [BN], masked by m_n; columns past K read as 0). K: the
    weight's columns (the record's parts are placed by it); k0: a multiple of BLOCK_K, a power of two. FMT:
    `strata.quant.packed.KERNEL_FORMAT`. p_grid: IQ3_S's grid as 512 int32 words of 4 bytes (`grid_words`), read by
    iq3_s tiles only.

    The tile is built as [BN, G, TG]: G runs of TG columns, each inside one scale group, so a run's scale is one
    value broadcast over its columns, codes split from their bytes by register shuffles (interleave) and high
    bits from one word per run by shifts; one reshape gives [BN, BLOCK_K]. The products are those of
    `strata.quant.packed.dequantize` (exact in float32, so the same bits)."""
    p_r = p_w + o_n[:, None] * s_row  # [BN, 1] each row's record
    if FMT == 6:  # iq3_s: codes [K/4] | signs [K/8] | high [K/32] | scales [K/64] | d f16 [K/256]
        tl.static_assert(BLOCK_K >= 32, "iq3_s tiles are runs of 32 columns")
        G: tl.constexpr = BLOCK_K // 32
        o_run = k0 + tl.arange(0, G) * 32
        m = m_n[:, None] & (o_run < K)[None, :]
        o_i = tl.arange(0, 8)[None, None, :]  # a grid index's place in its run
        o_j = tl.arange(0, 32)[None, None, :]  # a column's place in its run
        b_hi = _field(p_r, K // 4 + K // 8 + o_run // 32, m, 1)  # a run's 8 ninth bits: one byte
        index = _load3(p_r, m_n, k0 // 4, 8, K // 4, G, 8).to(tl.int32) | (((b_hi[:, :, None] >> o_i) & 1) << 8)
        b_g = tl.load(p_grid + index)  # [BN, G, 8]: each index's 4 grid values, one byte each
        values = tl.interleave(tl.interleave(b_g & 255, (b_g >> 16) & 255),
                               tl.interleave((b_g >> 8) & 255, (b_g >> 24) & 255))  # [BN, G, 32]
        b_sign = (_word(p_r, K // 4 + o_run // 8, m)[:, :, None] >> o_j) & 1  # a run's 32 signs: one word
        nib = (_field(p_r, K // 4 + K // 8 + K // 32 + o_run // 64, m, 1) >> ((o_run // 32) % 2 * 4)[None, :]) & 15
        d = _half(_field(p_r, K // 4 + K // 8 + K // 32 + K // 64 + (o_run // 256) * 2, m, 2))
        db = d * _exact_float(1 + 2 * nib, 0)
        w = db[:, :, None] * (_exact_float(values, 0) * _exact_float(1 - 2 * b_sign, 1))
    elif FMT == 1 or FMT == 2:  # q8_0: codes i8 [K] | scales f16 [K/32]; fp8: codes e4m3 [K] | scales f32 [K/128]
        GS: tl.constexpr = 32 if FMT == 1 else 128
        TG: tl.constexpr = GS if GS < BLOCK_K else BLOCK_K
        G: tl.constexpr = BLOCK_K // TG
        o_run = k0 + tl.arange(0, G) * TG  # each run's first column
        m = m_n[:, None] & (o_run < K)[None, :]  # [BN, G]
        b_q = _load3(p_r, m_n, k0, TG, K, G, TG)
        if FMT == 1:
            s = _half(_field(p_r, K + (o_run // GS) * 2, m, 2))
            w = s[:, :, None] * _exact_float(b_q.to(tl.int8, bitcast=True).to(tl.int32), 128)
        else:
            s = _word(p_r, K + (o_run // GS) * 4, m).to(tl.float32, bitcast=True)
            w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, :, None]
    else:
        GS: tl.constexpr = 16 if FMT == 5 else 32
        TG: tl.constexpr = GS if GS < BLOCK_K else BLOCK_K
        G: tl.constexpr = BLOCK_K // TG
        o_run = k0 + tl.arange(0, G) * TG
        m = m_n[:, None] & (o_run < K)[None, :]
        o_j = tl.arange(0, TG)[None, None, :]  # a column's place in its run
        b_b = _load3(p_r, m_n, k0 // 2, TG // 2, K // 2, G, TG // 2)  # the low four bits, two columns a byte
        b_c = tl.interleave(b_b & 15, b_b >> 4).to(tl.int32)  # [BN, G, TG]
        o_sup = o_run // 256  # each run's super-block
        if FMT == 5:  # q6_k: codes [K/2] | top bits [K/4] | d f16 [K/256] | scales i8 [K/16]
            b_hi = _word(p_r, K // 2 + o_run // 4, m)  # a run's 16 columns' top two bits: one word
            b_c = b_c | (((b_hi[:, :, None] >> (o_j * 2)) & 3) << 4)
            d = _half(_field(p_r, K // 2 + K // 4 + o_sup * 2, m, 2))
            sc = _field(p_r, K // 2 + K // 4 + K // 128 + o_run // 16, m, 1).to(tl.int8).to(tl.float32)
            w = (d * sc)[:, :, None] * _exact_float(b_c - 32, 32)
        else:  # q4_k, q5_k: codes [K/2] | (d, dmin) f16 [K/256, 2] | (scale, min) u8 [K/32, 2] | fifth bits [K/8]
            if FMT == 4:
                b_hi = _word(p_r, K // 2 + K // 64 + K // 16 + o_run // 8, m)  # a run's 32 fifth bits: one word
                b_c = b_c | (((b_hi[:, :, None] >> o_j) & 1) << 4)
            d = _half(_field(p_r, K // 2 + o_sup * 4, m, 2))
            dmin = _half(_field(p_r, K // 2 + o_sup * 4 + 2, m, 2))
            o_g = K // 2 + K // 64 + (o_run // 32) * 2
            sc = _field(p_r, o_g, m, 1).to(tl.float32)
            mn = _field(p_r, o_g + 1, m, 1).to(tl.float32)
            w = (d * sc)[:, :, None] * _exact_float(b_c, 0) - (dmin * mn)[:, :, None]
    return tl.reshape(w, [w.shape[0], BLOCK_K])  # masked columns and rows: 0 (their codes and scales load as 0)


@triton.jit
def _dequantize_kernel(p_w, p_out, p_grid, N, K, s_row, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_n = o_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = packed_tile(p_w, o_n, m_n, k0, K, s_row, p_grid, FMT, BLOCK_K)
    o_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(p_out + o_n[:, None] * K + o_k[None, :], w.to(p_out.dtype.element_ty), mask=m_n[:, None] & (o_k < K)[None, :])


def grid_words(w: PackedWeight | torch.Tensor) -> torch.Tensor:
    """What the kernels take as p_grid for `w`: IQ3_S's grid as int32 words (byte c of word i: value c of point i)
    on w's device for an iq3_s weight; any tensor of w's otherwise (not read). A view of the table
    `PackedWeight.to` put on the device: nothing is copied here, so it may run while a CUDA graph is captured."""
    data = w.data if isinstance(w, PackedWeight) else w
    if not isinstance(w, PackedWeight) or w.fmt != "iq3_s":
        return data
    return iq3s_grid(data.device).view(torch.int32).reshape(-1)


def project(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a weight that may be packed (written out in x's dtype first: the prompt windows' products) or
    in oneDNN's blocked layout (a CPU stage's, `strata.kernels.onednn`)."""
    if onednn.is_blocked(weight):
        return onednn.linear(x, weight, bias)
    if isinstance(weight, PackedWeight):
        weight = dequantize_triton(weight, x.dtype)
    return F.linear(x, weight, bias)


def plain_weight(w: torch.Tensor | PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A weight as a tensor: a packed one written out in `dtype` (default: its activations' dtype)."""
    return dequantize_triton(w, dtype) if isinstance(w, PackedWeight) else w


def dequantize_triton(w: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The packed weight [..., N, K] written out in `dtype` (default: its activations' dtype), on its device."""
    data = w.data.contiguous()
    k = w.shape[-1]
    rows = 1
    for d in w.shape[:-1]:
        rows *= d
    out = torch.empty(*w.shape, dtype=dtype or w.dtype, device=w.device)
    if rows and k:
        block_n, block_k = 16, 256
        _dequantize_kernel[(triton.cdiv(rows, block_n), triton.cdiv(k, block_k))](
            data, out, grid_words(w), rows, k, data.shape[-1], FMT=w.kernel_format, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4)
    return out
