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

from strata.quant.packed import PackedWeight


@triton.jit
def _per_group(p_g, m_n, k0, K, GROUP: tl.constexpr, STEP: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BN, BLOCK_K] (or [BN, 1] where a group spans the tile): each column's group value, for groups of
    GROUP columns whose values lie STEP elements apart from p_g ([BN, 1] pointers, one per row). One load per
    group, not per column: a tile's pointers stay [BN, groups], which keeps the decode kernels in registers."""
    if BLOCK_K > GROUP:  # k0 is a multiple of BLOCK_K, so groups start at the tile's start
        o_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        v = tl.load(p_g + o_g[None, :] * STEP, mask=m_n[:, None] & (o_g * GROUP < K)[None, :], other=0)
        v = v.to(tl.float32)  # [BN, G]
        return tl.reshape(tl.broadcast_to(v[:, :, None], [v.shape[0], BLOCK_K // GROUP, GROUP]),
                          [v.shape[0], BLOCK_K])
    else:  # the whole tile lies in one group
        return tl.load(p_g + (k0 // GROUP) * STEP, mask=m_n[:, None] & (k0 < K), other=0).to(tl.float32)


@triton.jit
def _spread_bits(b, WIDTH: tl.constexpr):
    """uint8 [BN, C] -> int32 [BN, C * 8 / WIDTH]: each byte's fields of WIDTH bits, lowest first."""
    PER: tl.constexpr = 8 // WIDTH
    shifts = tl.arange(0, PER) * WIDTH
    f = (b.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << WIDTH) - 1)
    return tl.reshape(f, [b.shape[0], b.shape[1] * PER])


@triton.jit
def packed_tile(p_w, o_n, m_n, k0, K, s_row, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BN, BLOCK_K]: w[o_n, k0 + j] of a packed weight whose row records (`strata.quant.packed`) start at
    p_w (uint8), s_row bytes apart (o_n: int64 row indices [BN], masked by m_n; columns past K read as 0). K: the
    weight's columns (the record's parts are placed by it); k0: a multiple of BLOCK_K, a power of two. FMT:
    `strata.quant.packed.KERNEL_FORMAT`. The scales are loaded once per group and spread over its columns; the
    products are those of `strata.quant.packed.dequantize` (exact in float32, so the same bits)."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m = m_n[:, None] & (o_k < K)[None, :]  # [BN, BK]
    p_r = p_w + o_n[:, None] * s_row  # [BN, 1] each row's record
    if FMT == 1:  # q8_0: codes [K] | scales f16 [K/32]
        b_q = tl.load(p_r + o_k[None, :], mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _per_group((p_r + K).to(tl.pointer_type(tl.float16)), m_n, k0, K, 32, 1, BLOCK_K) * b_q
    elif FMT == 2:  # fp8: codes [K] | scales f32 [K/128]
        b_q = tl.load(p_r + o_k[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = b_q * _per_group((p_r + K).to(tl.pointer_type(tl.float32)), m_n, k0, K, 128, 1, BLOCK_K)
    else:
        # the low four bits: a byte holds two columns; each byte is loaded once and split
        o_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b_b = tl.load(p_r + o_b[None, :], mask=m_n[:, None] & (o_b < K // 2)[None, :], other=0)
        b_c = tl.interleave(b_b & 15, b_b >> 4).to(tl.int32)  # [BN, BK]
        if FMT == 5:  # q6_k: codes [K/2] | d f16 [K/256] | scales i8 [K/16] | top bits [K/4]
            p_d = (p_r + K // 2).to(tl.pointer_type(tl.float16))
            p_s = (p_r + K // 2 + K // 128).to(tl.pointer_type(tl.int8))
            o_h = k0 // 4 + tl.arange(0, BLOCK_K // 4)
            b_hi = tl.load(p_r + K // 2 + K // 128 + K // 16 + o_h[None, :],
                           mask=m_n[:, None] & (o_h < K // 4)[None, :], other=0)
            b_c = b_c | (_spread_bits(b_hi, 2) << 4)
            b_scale = _per_group(p_d, m_n, k0, K, 256, 1, BLOCK_K) * _per_group(p_s, m_n, k0, K, 16, 1, BLOCK_K)
            w = b_scale * (b_c - 32).to(tl.float32)
        else:  # q4_k, q5_k: codes [K/2] | (d, dmin) f16 [K/256, 2] | (scale, min) u8 [K/32, 2] | fifth bits [K/8]
            p_d = (p_r + K // 2).to(tl.pointer_type(tl.float16))
            p_s = p_r + K // 2 + K // 64
            if FMT == 4:
                o_h = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                b_hi = tl.load(p_s + K // 16 + o_h[None, :], mask=m_n[:, None] & (o_h < K // 8)[None, :], other=0)
                b_c = b_c | (_spread_bits(b_hi, 1) << 4)
            b_scale = _per_group(p_d, m_n, k0, K, 256, 2, BLOCK_K) * _per_group(p_s, m_n, k0, K, 32, 2, BLOCK_K)
            b_low = _per_group(p_d + 1, m_n, k0, K, 256, 2, BLOCK_K) * _per_group(p_s + 1, m_n, k0, K, 32, 2, BLOCK_K)
            w = b_scale * b_c.to(tl.float32) - b_low
    return w  # masked columns and rows: 0 (their codes and scales load as 0)


@triton.jit
def _dequantize_kernel(p_w, p_out, N, K, s_row, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_n = o_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = packed_tile(p_w, o_n, m_n, k0, K, s_row, FMT, BLOCK_K)
    o_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(p_out + o_n[:, None] * K + o_k[None, :], w.to(p_out.dtype.element_ty), mask=m_n[:, None] & (o_k < K)[None, :])


def project(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a weight that may be packed (written out in x's dtype first): the prompt windows' products."""
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
            data, out, rows, k, data.shape[-1], FMT=w.kernel_format, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
