"""Mixture-of-experts MLP as a torch reference: router top-k, routed SwiGLU experts, optional gated shared expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


from strata.kernels.invariant import plain

Rows = Callable[..., torch.Tensor]  # how per-row work is run: `plain` or `in_row_blocks` (row-invariant)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool):
    """x: [R, H]; router: [E, H] -> (weights [R, k] in x's dtype, expert ids [R, k] int64)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x: [R, H]; gate_up: [2I, H] (gate rows then up rows); down: [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   rows: Rows = plain) -> torch.Tensor:
    """Each row's top-k experts, weighted and summed. gate_up: [E, 2I, H]; down: [E, H, I]. Returns [R, H]."""
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    row_of = order // ids.shape[1]  # the row of each (row, choice) pair, grouped by expert
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        r = row_of[start : start + n]
        start += n
        y = rows(swiglu, x[r], gate_up[expert], down[expert]) * weights.reshape(-1)[sel, None]
        out.index_add_(0, r, y)
    return out


def moe(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk: bool,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_gate: torch.Tensor | None = None,
    rows: Rows = plain,
) -> torch.Tensor:
    """The MoE block over rows x [R, H]: routed experts plus the (optionally sigmoid-gated) shared expert."""
    weights, ids = rows(route, x, router, top_k, norm_topk)
    out = routed_experts(x, weights, ids, gate_up, down, rows)
    if shared is not None:
        s = rows(swiglu, x, *shared)
        if shared_gate is not None:
            s = torch.sigmoid(rows(F.linear, x, shared_gate)) * s
        out = out + s
    return out
