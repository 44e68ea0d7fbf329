"""RMSNorm, plain and gated, as torch references (float32 inside, the input's dtype out).

A norm weight arrives already in multiply form: families that store zero-centred weights (1 + w)
are folded at load, so one op serves every family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
