"""Attention's per-row input work in one launch, for decode windows: the q and k RMSNorms, the rotary
embedding of q and k, and the append of each row's k and v to its own cell of the state pool.

Decode windows are latency-bound at small row counts: every launch costs a few microseconds whatever its size,
so the six small launches this replaces (two norms, two rotaries, two cell writes) add up. The arithmetic is
the one of `rms_norm_triton` followed by `apply_rope_triton` (same reductions, same roundings to the model's
dtype in between): under the interpreter the results are bitwise the separate kernels', and compiled for a GPU
they may differ by one rounding where the compiler fuses a multiply-add differently (1 element in 46,000 on an
H200, bench/kernels_check.py). `qk_prep_reference` is that sequence, for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.deferred import load_rows, source
from strata.kernels.pdl import pdl, wait_for_prior

from strata.kernels.rmsnorm import norm_warps, rms_norm_triton
from strata.kernels.rope import apply_rope_triton


def qk_prep_reference(q, k, v, q_norm, k_norm, eps, positions, inv_freq, rotary_dim, k_pool, v_pool, seq_ids,
                      scale: float = 1.0):
    """The separate kernels: norms (when q_norm is given), rotary, then each row's k and v written into
    k_pool / v_pool [S, cells, Hkv, D] at (seq_ids[r], positions[r]). Returns the rotated q [R, H, D]."""
    if q_norm is not None:
        q, k = rms_norm_triton(q, q_norm, eps), rms_norm_triton(k, k_norm, eps)
    q = apply_rope_triton(q, positions, inv_freq, rotary_dim, scale=scale)
    k = apply_rope_triton(k, positions, inv_freq, rotary_dim, scale=scale)
    seq, pos = seq_ids.long(), positions.long()
    k_pool[seq, pos] = k
    v_pool[seq, pos] = v
    return q


@triton.jit
def _qk_prep_kernel(
    p_q, p_k, p_v, p_qn, p_kn, p_pos, p_seq, p_inv_freq, p_q_out, p_k_pool, p_v_pool,
    s_qr, s_qh, s_kr, s_kh, s_vr, s_vh, s_ps, s_pc, s_ph,
    H, HKV, D, HALF, eps, s_chunk, scale,
    SPLIT: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, head): heads 0..H-1 are q's (written to q_out), H..H+HKV-1 are k's (written,
    with the row's v head, to the row's cell of the pool)."""
    wait_for_prior(PDL)
    TY = p_q_out.dtype.element_ty  # the model's dtype: q, k and v (or their split chunks' sums) round to it
    i_r, i_j = tl.program_id(0), tl.program_id(1)
    is_q = i_j < H
    i_h = tl.where(is_q, i_j, i_j - H)
    if is_q:
        p_x = p_q + i_r * s_qr + i_h * s_qh
        p_w = p_qn
        p_o = p_q_out + (i_r * H + i_h).to(tl.int64) * D
    else:
        p_x = p_k + i_r * s_kr + i_h * s_kh
        p_w = p_kn
        i_seq = tl.load(p_seq + i_r).to(tl.int64)
        i_cell = tl.load(p_pos + i_r).to(tl.int64)
        p_o = p_k_pool + i_seq * s_ps + i_cell * s_pc + i_h * s_ph
    b_rstd = 1.0
    if QK_NORM:  # rms_norm_triton's reduction over the whole head vector
        o_d = tl.arange(0, BLOCK_D)
        b_all = load_rows(p_x + o_d, o_d < D, s_chunk, SPLIT, TY).to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_all * b_all, axis=0) / D + eps)
    o_j = tl.arange(0, BLOCK_HALF)
    m_j = o_j < HALF
    b_lo = load_rows(p_x + o_j, m_j, s_chunk, SPLIT, TY)
    b_hi = load_rows(p_x + HALF + o_j, m_j, s_chunk, SPLIT, TY)
    if QK_NORM:  # normalised and rounded to the model's dtype, as the norm kernel stores it
        b_lo = (b_lo.to(tl.float32) * b_rstd * tl.load(p_w + o_j, mask=m_j, other=0.0)).to(b_lo.dtype)
        b_hi = (b_hi.to(tl.float32) * b_rstd * tl.load(p_w + HALF + o_j, mask=m_j, other=0.0)).to(b_hi.dtype)
    b_pos = tl.load(p_pos + i_r).to(tl.float32)
    b_freq = b_pos * tl.load(p_inv_freq + o_j, mask=m_j, other=0.0)
    b_cos, b_sin = tl.cos(b_freq) * scale, tl.sin(b_freq) * scale
    b_lo, b_hi = b_lo.to(tl.float32), b_hi.to(tl.float32)
    ty = p_o.dtype.element_ty
    tl.store(p_o + o_j, (b_lo * b_cos - b_hi * b_sin).to(ty), mask=m_j)
    tl.store(p_o + HALF + o_j, (b_hi * b_cos + b_lo * b_sin).to(ty), mask=m_j)
    if HAS_PASS:  # the dimensions past the rotary ones: normalised (when asked) and copied
        o_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        m_p = o_p < D
        b_pass = load_rows(p_x + o_p, m_p, s_chunk, SPLIT, TY)
        if QK_NORM:
            b_pass = (b_pass.to(tl.float32) * b_rstd * tl.load(p_w + o_p, mask=m_p, other=0.0)).to(b_pass.dtype)
        tl.store(p_o + o_p, b_pass.to(ty), mask=m_p)
    if not is_q:  # the row's v head goes to the same cell
        o_d2 = tl.arange(0, BLOCK_D)
        m_d = o_d2 < D
        b_v = load_rows(p_v + i_r * s_vr + i_h * s_vh + o_d2, m_d, s_chunk, SPLIT, TY)
        i_seq2 = tl.load(p_seq + i_r).to(tl.int64)
        i_cell2 = tl.load(p_pos + i_r).to(tl.int64)
        tl.store(p_v_pool + i_seq2 * s_ps + i_cell2 * s_pc + i_h * s_ph + o_d2, b_v.to(ty), mask=m_d)


def qk_prep_triton(q, k, v, q_norm, k_norm, eps, positions, inv_freq, rotary_dim, k_pool, v_pool, seq_ids,
                   scale: float = 1.0):
    """`qk_prep_reference` in one launch. q: [R, H, D], k, v: [R, Hkv, D] (any row and head strides, unit last
    stride; or all three views of one `SplitSum`, whose chunks are added as they are loaded); q_norm, k_norm: [D]
    float32 or None (no norm); positions, seq_ids: [R] int32/int64; inv_freq: [rotary_dim / 2] float32; k_pool,
    v_pool: [S, cells, Hkv, D] contiguous; scale: cos and sin multiplied by it (YaRN). Returns q rotated, [R, H, D]."""
    r, h, d = q.shape
    hkv = k.shape[1]
    half = rotary_dim // 2
    assert rotary_dim % 2 == 0 and rotary_dim <= d and inv_freq.shape == (half,)
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape == v_pool.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "the head dimension must be contiguous"
    assert (q_norm is None) == (k_norm is None)
    q_out = torch.empty((r, h, d), dtype=q.dtype, device=q.device)  # [R, H, D]
    (p_q, s_chunk, split), (p_k, _, split_k), (p_v, _, split_v) = source(q), source(k), source(v)
    assert split == split_k == split_v, "q, k and v: all tensors or all views of one SplitSum"
    if r:
        _qk_prep_kernel[(r, h + hkv)](
            p_q, p_k, p_v, q_norm if q_norm is not None else inv_freq, k_norm if k_norm is not None else inv_freq,
            positions, seq_ids, inv_freq.contiguous(), q_out, k_pool, v_pool,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            h, hkv, d, half, eps, s_chunk, float(scale),
            SPLIT=split, QK_NORM=q_norm is not None, BLOCK_D=triton.next_power_of_2(d),
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_PASS=triton.next_power_of_2(max(d - rotary_dim, 1)), HAS_PASS=rotary_dim < d,
            num_warps=norm_warps(triton.next_power_of_2(d)),  # the norm kernel's: its sum order
            **pdl(p_q),
        )
    return q_out
