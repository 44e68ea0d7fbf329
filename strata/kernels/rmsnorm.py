"""RMSNorm, plain and gated, as torch references (float32 inside, the input's dtype out).

A norm weight arrives already in multiply form: families that store zero-centred weights (1 + w)
are folded at load, so one op serves every family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D] float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm each head vector of x, scale by weight, multiply by silu(gate). x, gate: [..., D]; weight: [D]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight * F.silu(gate.float())).to(x.dtype)
