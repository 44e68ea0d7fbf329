"""Causal attention of a sequence's rows over that sequence's K/V cells (GQA), as a torch reference."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k_cells: torch.Tensor, v_cells: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of one sequence attend to its cells up to their own position.

    q: [T, H, D] rows at `positions` [T]; k_cells, v_cells: [L, Hkv, D] cells 0..L-1 of the sequence
    (L > every position). Each query head h reads K/V head h // (H / Hkv). Returns [T, H, D].
    """
    t, h, d = q.shape
    n_cells, hkv, _ = k_cells.shape
    group = h // hkv
    qg = q.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, t * group, d)  # [Hkv, T*G, D]
    scores = torch.matmul(qg.float(), k_cells.permute(1, 2, 0).float()) * scale  # [Hkv, T*G, L]
    cells = torch.arange(n_cells, device=q.device)
    visible = cells[None, :] <= positions[:, None]  # [T, L]
    mask = visible.repeat_interleave(group, dim=0)  # [T*G, L]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_cells.dtype)
    out = torch.matmul(probs, v_cells.permute(1, 0, 2))  # [Hkv, T*G, D]
    return out.reshape(hkv, t, group, d).permute(1, 0, 2, 3).reshape(t, h, d)
