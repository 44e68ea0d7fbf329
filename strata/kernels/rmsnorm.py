"""RMSNorm, plain, residual-fused and gated: torch references and their Triton kernels (float32 inside, the
input's dtype out).

A norm weight arrives already in multiply form: families that store zero-centred weights (1 + w)
are folded at load, so one op serves every family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels.pdl import pdl, wait_for_prior

from strata.kernels.invariant import plain


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D] float32 -> x / rms(x) * weight, in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_normalize(x, weight, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, rows=plain) -> torch.Tensor:
    """Norm each head vector of x, scale by weight, multiply by silu(gate). x, gate: [R, ..., D]; weight: [D].

    `rows` runs the per-row reduction (pass `in_row_blocks` for row-invariant decode windows)."""
    return (rows(rms_normalize, x, weight, eps) * F.silu(gate.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused ahead of a norm: -> (rms_norm(residual + x), residual + x)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


# ---- Triton: one program per row vector (a row of [R, D], a head of [R, H, D]), the whole vector in one
# block, float32 inside. Nothing depends on R, so a row rounds the same whatever its neighbours.

MAX_D = 16384


@triton.jit
def _rms_norm_kernel(
    p_x, p_res, p_gate, p_w, p_out, p_res_out,
    stride_xr, stride_xh, stride_rr, stride_rh, stride_gr, stride_gh,
    D, eps,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    i_r, i_h, H = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    o_d = tl.arange(0, BLOCK)
    m_d = o_d < D
    b_x = tl.load(p_x + i_r * stride_xr + i_h * stride_xh + o_d, mask=m_d, other=0.0)
    if ADD_RESIDUAL:
        b_res = tl.load(p_res + i_r * stride_rr + i_h * stride_rh + o_d, mask=m_d, other=0.0)
        b_x = (b_res.to(tl.float32) + b_x.to(tl.float32)).to(b_x.dtype)  # rounds as torch's residual + x
        tl.store(p_res_out + (i_r * H + i_h) * D + o_d, b_x, mask=m_d)
    b_x = b_x.to(tl.float32)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_y = b_x * b_rstd * b_w
    if GATED:
        b_g = tl.load(p_gate + i_r * stride_gr + i_h * stride_gh + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
    tl.store(p_out + (i_r * H + i_h) * D + o_d, b_y.to(p_out.dtype.element_ty), mask=m_d)


def _row_vectors(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """t: [R, D] or [R, H, D] -> (t with a unit last stride, row stride, head stride)."""
    assert t.dim() in (2, 3), f"expected [R, D] or [R, H, D], got {tuple(t.shape)}"
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1) if t.dim() == 3 else 0


def _launch_rms_norm(x, weight, eps, residual=None, gate=None):
    d = x.shape[-1]
    assert d <= MAX_D and weight.shape == (d,) and weight.dtype == torch.float32, "weight: [D] float32"
    heads = x.shape[1] if x.dim() == 3 else 1
    x, sxr, sxh = _row_vectors(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [R, (H,) D]
    res_out, srr, srh, sgr, sgh = None, 0, 0, 0, 0
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual, srr, srh = _row_vectors(residual)
        res_out = torch.empty_like(out)  # [R, (H,) D]
    if gate is not None:
        assert gate.shape == x.shape
        gate, sgr, sgh = _row_vectors(gate)
    block = triton.next_power_of_2(d)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0], heads)](
            x, residual, gate, weight.contiguous(), out, res_out,
            sxr, sxh, srr, srh, sgr, sgh, d, eps,
            BLOCK=block, ADD_RESIDUAL=residual is not None, GATED=gate is not None,
            num_warps=min(16, max(1, block // 512)), **pdl(x)
        )
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` as one Triton program per row vector. x: [R, D] or [R, H, D]; weight: [D] float32."""
    return _launch_rms_norm(x, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` in one pass: x, residual: [R, D] or [R, H, D], same dtype -> (normed, new residual)."""
    return _launch_rms_norm(x, weight, eps, residual=residual)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, rows=plain
) -> torch.Tensor:
    """`gated_rms_norm` in Triton. x, gate: [R, Hv, Dv] (or [R, D]); weight: [Dv] float32. `rows` is accepted
    for a drop-in swap and ignored: the kernel is row-invariant by construction."""
    return _launch_rms_norm(x, weight, eps, gate=gate)[0]
