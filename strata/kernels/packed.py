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
import triton
import triton.language as tl

from strata.quant.packed import PackedWeight


@triton.jit
def packed_tile(p_w, o_n, m_n, k0, K, s_row, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BN, BLOCK_K]: w[o_n, k0 + j] of a packed weight whose row records (`strata.quant.packed`) start at
    p_w (uint8), s_row bytes apart (o_n: int64 row indices [BN], masked by m_n; columns past K read as 0). K: the
    weight's columns (the record's parts are placed by it). FMT: `strata.quant.packed.KERNEL_FORMAT`."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m = m_n[:, None] & (o_k < K)[None, :]  # [BN, BK]
    p_r = p_w + o_n[:, None] * s_row  # [BN, 1] each row's record
    if FMT == 1:  # q8_0: codes [K] | scales f16 [K/32]
        b_q = tl.load(p_r + o_k[None, :], mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        p_s = (p_r + K).to(tl.pointer_type(tl.float16))
        w = tl.load(p_s + (o_k // 32)[None, :], mask=m, other=0.0).to(tl.float32) * b_q
    elif FMT == 2:  # fp8: codes [K] | scales f32 [K/128]
        b_q = tl.load(p_r + o_k[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        p_s = (p_r + K).to(tl.pointer_type(tl.float32))
        w = b_q * tl.load(p_s + (o_k // 128)[None, :], mask=m, other=0.0)
    else:
        # the low four bits: a byte holds two columns; each byte is loaded once and split
        o_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b_b = tl.load(p_r + o_b[None, :], mask=m_n[:, None] & (o_b < K // 2)[None, :], other=0)
        b_c = tl.interleave(b_b & 15, b_b >> 4).to(tl.int32)  # [BN, BK]
        if FMT == 5:  # q6_k: codes [K/2] | d f16 [K/256] | scales i8 [K/16] | top bits [K/4]
            p_d = (p_r + K // 2).to(tl.pointer_type(tl.float16))
            p_s = p_r + K // 2 + K // 128
            p_h = p_s + K // 16
            b_hi = tl.load(p_h + (o_k // 4)[None, :], mask=m, other=0).to(tl.int32)
            b_c = b_c | (((b_hi >> ((o_k % 4) * 2)[None, :]) & 3) << 4)
            b_sc = tl.load(p_s + (o_k // 16)[None, :], mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            b_d = tl.load(p_d + (o_k // 256)[None, :], mask=m, other=0.0).to(tl.float32)
            w = (b_d * b_sc) * (b_c - 32).to(tl.float32)
        else:  # q4_k, q5_k: codes [K/2] | (d, dmin) f16 [K/256, 2] | (scale, min) u8 [K/32, 2] | fifth bits [K/8]
            p_d = (p_r + K // 2).to(tl.pointer_type(tl.float16))
            p_s = p_r + K // 2 + K // 64
            if FMT == 4:
                b_hi = tl.load(p_s + K // 16 + (o_k // 8)[None, :], mask=m, other=0).to(tl.int32)
                b_c = b_c | (((b_hi >> (o_k % 8)[None, :]) & 1) << 4)
            o_g = (o_k // 32)[None, :] * 2
            b_sc = tl.load(p_s + o_g, mask=m, other=0).to(tl.float32)
            b_mn = tl.load(p_s + o_g + 1, mask=m, other=0).to(tl.float32)
            o_u = (o_k // 256)[None, :] * 2
            b_d = tl.load(p_d + o_u, mask=m, other=0.0).to(tl.float32)
            b_dmin = tl.load(p_d + o_u + 1, mask=m, other=0.0).to(tl.float32)
            w = (b_d * b_sc) * b_c.to(tl.float32) - b_dmin * b_mn
    return w


@triton.jit
def _dequantize_kernel(p_w, p_out, N, K, s_row, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_n = o_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = packed_tile(p_w, o_n, m_n, k0, K, s_row, FMT, BLOCK_K)
    o_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(p_out + o_n[:, None] * K + o_k[None, :], w.to(p_out.dtype.element_ty), mask=m_n[:, None] & (o_k < K)[None, :])


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
