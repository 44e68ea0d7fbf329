"""Rotary position embedding (the rotate-half convention), full or partial: a torch reference and its Triton kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.pdl import pdl, wait_for_prior


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [R] int64 -> cos, sin: [R, rotary_dim] in dtype, multiplied by `scale` (YaRN's attention factor,
    `strata.model.rope_scaling`) before the rounding."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [R, H, D]; cos, sin: [R, rotary_dim] with rotary_dim <= D: the leading rotary_dim dims turn."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


# ---- Triton: one program per (row, block of heads); cos and sin computed in float32 from the row's position,
# the rotation in float32, one rounding to x's dtype. Nothing depends on R.

MAX_HEAD_BLOCK = 16


@triton.jit
def _rope_kernel(
    p_x, p_pos, p_inv_freq, p_out,
    stride_xr, stride_xh, stride_pos,
    H, D, HALF, scale,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    i_r, i_hb = tl.program_id(0), tl.program_id(1)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    o_j = tl.arange(0, BLOCK_HALF)
    m_h, m_j = o_h < H, o_j < HALF
    b_pos = tl.load(p_pos + i_r * stride_pos).to(tl.float32)
    b_freq = b_pos * tl.load(p_inv_freq + o_j, mask=m_j, other=0.0)  # [BLOCK_HALF]
    b_cos, b_sin = (tl.cos(b_freq) * scale)[None, :], (tl.sin(b_freq) * scale)[None, :]
    m = m_h[:, None] & m_j[None, :]
    p_lo = p_x + i_r * stride_xr + o_h[:, None] * stride_xh + o_j[None, :]  # [BLOCK_H, BLOCK_HALF]
    b_lo = tl.load(p_lo, mask=m, other=0.0).to(tl.float32)
    b_hi = tl.load(p_lo + HALF, mask=m, other=0.0).to(tl.float32)
    p_o = p_out + (i_r * H + o_h[:, None]) * D + o_j[None, :]
    tl.store(p_o, (b_lo * b_cos - b_hi * b_sin).to(p_out.dtype.element_ty), mask=m)
    tl.store(p_o + HALF, (b_hi * b_cos + b_lo * b_sin).to(p_out.dtype.element_ty), mask=m)
    if HAS_PASS:
        o_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        m_p = m_h[:, None] & (o_p < D)[None, :]
        b_pass = tl.load(p_x + i_r * stride_xr + o_h[:, None] * stride_xh + o_p[None, :], mask=m_p, other=0.0)
        tl.store(p_out + (i_r * H + o_h[:, None]) * D + o_p[None, :], b_pass.to(p_out.dtype.element_ty), mask=m_p)


def apply_rope_triton(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int, out: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """`apply_rope(x, *rope_cos_sin(positions, inv_freq, x.dtype, scale))` in one Triton pass, cos/sin made in-kernel.

    x: [R, H, D] (any row and head strides); positions: [R] int32/int64 (any stride); inv_freq: [rotary_dim / 2]
    float32. Writes a new contiguous [R, H, D], or `out` (contiguous, x's shape and dtype; may be x itself)."""
    r, h, d = x.shape
    half = rotary_dim // 2
    assert rotary_dim % 2 == 0 and rotary_dim <= d and inv_freq.shape == (half,) and inv_freq.dtype == torch.float32
    assert positions.shape == (r,) and not positions.is_floating_point()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((r, h, d), dtype=x.dtype, device=x.device)  # [R, H, D]
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    block_h = min(triton.next_power_of_2(h), MAX_HEAD_BLOCK)
    if r:
        _rope_kernel[(r, triton.cdiv(h, block_h))](
            x, positions, inv_freq.contiguous(), out,
            x.stride(0), x.stride(1), positions.stride(0),
            h, d, half, float(scale),
            BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_PASS=triton.next_power_of_2(max(d - rotary_dim, 1)), HAS_PASS=rotary_dim < d, **pdl(x)
        )
    return out
