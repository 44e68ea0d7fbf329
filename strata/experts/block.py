"""The MoE block of a layer whose experts are split between the stage's device and the CPU pool.

The router runs on the device over all E experts. Each (row, expert) pair then goes one of two ways, decided
on the device without a host round trip: `expert_slot` maps a global id to its resident slot, or to M (the
resident count) for an expert in host RAM. The device kernels take the slots and skip the pairs with slot M
(they are never computed, so no weight-0 trick, no wasted tiles, no NaN from them); the pool computes exactly
those pairs on the CPU. Order of work on a GPU: route, queue the rows' copy to the host, queue the resident
experts and the shared expert, then the host waits for its copy alone, computes, uploads, and the device adds.
"""

from __future__ import annotations

import torch

from strata.experts.pool import ExpertPool
from strata.kernels.invariant import in_blocks_of, in_row_blocks, plain
from strata.kernels.linear import linear_triton
from strata.kernels.packed import project
from strata.kernels.moe import (add_shared_expert, decode_tiles, fused_experts_triton, route, prompt_tiles,
                                route_triton, routed_experts, swiglu)
from strata.model.spec import MoESpec

Tensors = dict[str, torch.Tensor]
KERNELS = ("torch", "prompt", "decode")
# A GPU stage's pool computes a prompt window's pairs of an expert in blocks of this many rows (zero-padded), so a
# prompt's rows give the same bits read alone or beside other prompts (bench/experts.py prints what it costs)
PROMPT_POOL_ROWS = in_blocks_of(64)  # torch references / Triton with prompt tiles / Triton decode tiles


def pooled_moe(x: torch.Tensor, w: Tensors, m: MoESpec, pool: ExpertPool, rows=plain, kernels: str = "torch") -> torch.Tensor:
    """x [R, H] -> the MoE block's output [R, H]. `rows`: how the torch path runs per-row work (`in_row_blocks`
    in decode windows); kernels "prompt" / "decode": the Triton router and grouped GEMMs with prompt or decode
    tiles (the "decode" products through the row-invariant `linear_triton`)."""
    steps = pooled_moe_steps(x, w, m, rows, kernels)
    _, rows_x, weights, ids = next(steps)
    job = pool.start(rows_x, weights, ids)  # the rows go to the host while the device works on its share
    _, cpu_rows = steps.send(None)
    try:
        steps.send(job.finish(cpu_rows))
    except StopIteration as done:
        return done.value
    raise RuntimeError("pooled_moe_steps did not end after the pool's share")


def pooled_moe_steps(x: torch.Tensor, w: Tensors, m: MoESpec, rows=plain, kernels: str = "torch"):
    """`pooled_moe` as a generator, for callers that move the rows to the pool themselves (a decode window replayed
    from CUDA graphs, `strata.runtime.fast_decode.GraphedPooledDecode`). It yields ("start", x, weights, ids) once
    the rows are routed (send None back: the device's share is queued next), then ("finish", cpu_rows) (send the
    pool's share on the rows' device, computed with `cpu_rows`), and returns the block's output."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: expected one of {KERNELS}")
    shared = (w["shared_gate_up"], w["shared_down"]) if m.shared_dim else None
    if kernels == "torch":
        weights, ids = rows(route, x, w["router"], m.top_k, m.norm_topk)
        run_linear = lambda *a: rows(project, *a)  # noqa: E731
        run_swiglu = lambda *a: rows(swiglu, *a)  # noqa: E731
        cpu_rows = rows
    else:
        linear = linear_triton if kernels == "decode" else project  # (a packed shared expert written out first)
        weights, ids = route_triton(linear(x, w["router"]), m.top_k, m.norm_topk)
        run_linear = linear
        run_swiglu = lambda *a: swiglu(*a, linear=linear)  # noqa: E731
        # the device's kernels are row-invariant in prompt windows too: so are the pool's products, in fixed blocks
        cpu_rows = in_row_blocks if kernels == "decode" else PROMPT_POOL_ROWS
    yield "start", x, weights, ids
    gate_up, down = w["experts_gate_up"], w["experts_down"]
    slots = w["expert_slot"][ids.long()]  # [R, k] resident slot, or M: computed by the pool, skipped here
    if gate_up.shape[0] == 0:  # nothing resident (a budget of 0)
        out = torch.zeros_like(x)
    elif kernels == "torch":
        out = routed_experts(x, weights, slots.long(), gate_up, down, rows)
    else:
        tiles = decode_tiles(x.shape[0]) if kernels == "decode" else prompt_tiles(x.dtype)
        out = fused_experts_triton(x, weights, slots, gate_up, down, tiles)
    out = add_shared_expert(out, x, shared, w.get("shared_gate"), run_swiglu, run_linear)
    from_pool = yield "finish", cpu_rows
    return out + from_pool
