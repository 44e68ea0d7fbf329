"""Rotary position embedding (the rotate-half convention), full or partial, as a torch reference."""

from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [R] int64 -> cos, sin: [R, rotary_dim] in dtype."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [R, H, D]; cos, sin: [R, rotary_dim] with rotary_dim <= D: the leading rotary_dim dims turn."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
