"""Mixture-of-experts MLP: router top-k, routed SwiGLU experts, optional gated shared expert.

The torch reference (`route`, `swiglu`, `routed_experts`, `moe`) and, beside it, Triton kernels
(`route_triton`, `fused_experts_triton`, `moe_triton`) that run without a host sync on a grid fixed by
the shapes, and give each row the same bits whatever other rows share the call."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels import cpu_decode
from strata.kernels.deferred import PairSum, SplitSum, add_shared, load_rows, pair_args, source, sum_pairs, tl_dtype
from strata.kernels.elementwise import sigmoid_gate_add, silu_mul, silu_mul_triton
from strata.kernels.invariant import plain
from strata.kernels.packed import (SCALED_AFTER, grid_words, packed_mm, packed_mm2, packed_tile, plain_weight, project,
                                   scaled_after)
from strata.kernels.pdl import pdl, wait_for_prior
from strata.quant.packed import PackedWeight

Rows = Callable[..., torch.Tensor]  # how per-row work is run: `plain` or `in_row_blocks` (row-invariant)
Linear = Callable[..., torch.Tensor]  # F.linear or a row-invariant linear


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool):
    """x: [R, H]; router: [E, H] -> (weights [R, k] in x's dtype, expert ids [R, k] int64)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, linear: Linear = project) -> torch.Tensor:
    """x: [R, H]; gate_up: [2I, H] (gate rows then up rows); down: [H, I]."""
    return linear(silu_mul(linear(x, gate_up)), down)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   rows: Rows = plain) -> torch.Tensor:
    """Each row's top-k experts, weighted and summed. gate_up: [E, 2I, H]; down: [E, H, I]. Returns [R, H].
    An id >= E names an expert not held here (the CPU expert pool computes it): its pair adds nothing. Packed
    experts are written out whole first (this reference is not the path a GPU's windows take), but for the CPU's own
    kernel, which reads each expert's records as they are (`strata.kernels.cpu_packed`)."""
    if rows is not plain and cpu_decode.takes_experts(x, gate_up, down):  # decode rows on the CPU's packed kernel:
        return cpu_decode.experts(x, weights, ids, gate_up, down)  # one C call for the window's pairs
    gate_up, down = (w if getattr(w, "host_kernel", False) else plain_weight(w, x.dtype) for w in (gate_up, down))
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()[: gate_up.shape[0]]
    row_of = order // ids.shape[1]  # the row of each (row, choice) pair, grouped by expert
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        r = row_of[start : start + n]
        start += n
        y = rows(swiglu, x[r], gate_up[expert], down[expert]) * weights.reshape(-1)[sel, None]
        out.index_add_(0, r, y)  # a reference: rows may repeat within an expert (ids clamped by a caller)
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
    return add_shared_expert(out, x, shared, shared_gate, lambda *a: rows(swiglu, *a), lambda *a: rows(project, *a))


def add_shared_expert(out: torch.Tensor, x: torch.Tensor, shared, shared_gate, run_swiglu, run_linear) -> torch.Tensor:
    """out + the shared expert's SwiGLU of x, scaled by sigmoid(x @ shared_gate) when there is a gate."""
    if shared is None:
        return out
    s = run_swiglu(x, *shared)
    return out + s if shared_gate is None else sigmoid_gate_add(out, s, run_linear(x, shared_gate))


# --- Triton ---------------------------------------------------------------------------------------------------------

BLOCK_M = 16  # (row, choice) pairs of one expert per tile: the tensor-core minimum
BLOCK_N = 64  # output columns per tile
BLOCK_K = 64  # reduction step: fixed, so a row's sums run in the same order whatever shares its tile


@dataclass(frozen=True)
class ExpertTiles:
    """How `fused_experts_triton` tiles its grouped GEMMs. Decode windows (a few pairs per expert) use the
    tensor-core minimum; prompt windows (hundreds of pairs per expert) take bigger tiles, which read each
    expert's weights fewer times and keep the tensor cores busy."""

    block_m: int = BLOCK_M  # (row, choice) pairs of one expert per tile
    block_n: int = BLOCK_N  # output columns per tile
    block_k: int = BLOCK_K  # reduction step
    num_warps: int = 4
    num_stages: int = 3
    combine_n: int = BLOCK_N  # columns per program of the combine (a row's sum order does not depend on it)
    down_n: int | None = None  # the down projection's columns and reduction step per tile, if not block_n/k
    down_k: int | None = None
    round_pairs: bool = False  # each pair's output rounded to the activations' dtype (else kept in float32)
    persistent: int = 0  # programs per multiprocessor that walk the used tiles (0: one program per tile)
    down_persistent: int | None = None  # the same for the down products, if not `persistent`
    down_stages: int | None = None  # the down products' pipeline stages, if not `num_stages`
    tma: bool = False  # weight tiles read by the copy engine (tensor descriptors); not with a shared pair
    handoff: bool = False  # gate_up and down in one launch, each down tile starting when its pairs' h is written


# Decode windows: bench/moe_tiles.py on an H200 (graph-replayed, Qwen3-30B-A3B and Qwen3-Next experts at 1, 8 and
# 64 rows) had 32 columns x 128-deep steps with 4 stages fastest or within 1 % of the fastest at every row count;
# the down products' 64-column tiles were 0.3-2.8 % faster than 32 at 1, 8 and 64 rows (fourth session). Both
# products in one launch (handoff), seventh session: 30B experts 125.1 -> 119.2 us at 8 rows, 282.3 -> 275.9 at 64,
# 26.6 -> 26.8 at 1 (Qwen3-Next 118.1 -> 114.0, 527.4 -> 530.3, 26.3 -> 25.5); decode at 8 rows 1,061 -> 1,098 tok/s.
# Pipeline stages (ninth session, bench/ab.py on an H200, A/B in one process, checks all yes): 3 instead of 4 at 8
# rows +0.8 % tok/s (30B) and +1.0 % (Qwen3-Next); at 1 row 5 stages gave the 30B shape +1.3 % and Qwen3-Next
# -1.7 %, so a one-row window keeps 4 (`decode_tiles`). Stages do not change a row's bits.
DECODE_TILES = ExpertTiles(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3, combine_n=64, down_n=64,
                            handoff=True)
ONE_ROW_STAGES = 4


def decode_tiles(rows: int) -> ExpertTiles:
    """A decode window's expert tiles: DECODE_TILES, deeper pipelines for a one-row window (the same bits)."""
    return replace(DECODE_TILES, num_stages=ONE_ROW_STAGES) if rows == 1 else DECODE_TILES


# Prompt windows: bench/moe_tiles.py --prompt on an H200 (4,096 rows, eager): of twelve candidates, 128 x 128 x 64
# tiles on 8 warps with down products 256 columns wide were fastest at both shapes (Qwen3-Next experts 1,459 us, 52 %
# of their floor; the 128-wide down products 1,489 us; 30B 1,060 vs 1,098 us), fifth session. A prompt's pair
# outputs (40,960 x 2,048 for a 4,096-token Qwen3-Next prompt) are written and read back once each: rounded to
# bfloat16 they move half the bytes, and torch's reference rounds each expert's output there too. Sixth session,
# same command: pairs rounded 1,432 -> 1,330 us (Qwen3-Next), 1,143 -> 1,028 (30B); the down products walked by 2
# programs per multiprocessor (a down tile is 8 steps deep: one program per tile spends much of it starting and
# storing) 487 -> 421 us (Qwen3-Next), 335 -> 330 (30B); gate_up walked the same way: 657 -> 643 and 465 -> 526.
# Then the weight tiles read through tensor descriptors (the copy engine, no address math or masks in the
# programs) with 4 stages for gate_up (the copy engine's tiles leave room for one more): gate_up 661 -> 608 us
# (Qwen3-Next), 467 -> 420 (30B); down 402 -> 361 and 322 -> 271 with one program per multiprocessor.
PROMPT_TILES = ExpertTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, combine_n=512, down_n=256,
                           down_stages=3, round_pairs=True, down_persistent=1, tma=True)
# float32 weights (`--dtype float32` on a GPU): the same tiles take twice the shared memory (360 KB at 4 stages, over
# an H200's 227 KB), so half as deep a reduction step and one stage fewer; fixed for the dtype, so rows stay
# invariant. Not tuned: float32 on a GPU is for checking against references, not for speed.
FLOAT32_PROMPT_TILES = replace(PROMPT_TILES, block_k=32, num_stages=3)


def prompt_tiles(dtype: torch.dtype) -> ExpertTiles:
    return FLOAT32_PROMPT_TILES if dtype == torch.float32 else PROMPT_TILES


@triton.jit
def _route_row(i_r, p_logits, p_weights, p_ids, p_x, p_gate, E, H, s_r, s_chunk, s_xr, SPLIT: tl.constexpr,
               TY: tl.constexpr, K_TOP: tl.constexpr, NORM_TOPK: tl.constexpr, SHARED: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row i_r: softmax over the E logits, the top K_TOP (weights renormalised when NORM_TOPK). SHARED 1 or 2: one
    more pair, the shared expert as expert E, weighted 1 (SHARED 1) or sigmoid(x . gate) (2, the logit rounded
    to the model's dtype as a projection's output is)."""
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_p = load_rows(p_logits + i_r * s_r + o_e, m_e, s_chunk, SPLIT, TY).to(tl.float32)
    b_p = tl.where(m_e, b_p, float("-inf"))
    b_p = tl.exp(b_p - tl.max(b_p, axis=0))
    b_p = b_p / tl.sum(b_p, axis=0)
    # Each lane's key: its probability's bits above (BLOCK_E - 1 - lane), so one max over the keys gives the
    # largest probability and, among equal ones, the lowest expert id (probabilities are >= 0: their bits order as
    # the floats do). Padding lanes and lanes already picked hold key -1 and are never picked.
    b_key = tl.where(m_e, (b_p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - o_e), -1)
    o_j = tl.arange(0, BLOCK_TOP)
    b_w = tl.zeros([BLOCK_TOP], dtype=tl.float32)
    b_i = tl.zeros([BLOCK_TOP], dtype=tl.int32)
    for j in tl.static_range(K_TOP):  # one reduction a round
        b_top = tl.max(b_key, axis=0)
        i_e = tl.minimum(BLOCK_E - 1 - (b_top & 0xFFFFFFFF).to(tl.int32), E - 1)  # (a NaN row: keep ids in range)
        b_max = (b_top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        b_w = tl.where(o_j == j, b_max, b_w)
        b_i = tl.where(o_j == j, i_e, b_i)
        b_key = tl.where(o_e == i_e, -1, b_key)
    if NORM_TOPK:
        b_w = b_w / tl.sum(b_w, axis=0)
    n_pairs = K_TOP + (SHARED > 0)
    if SHARED > 0:
        b_shared = 1.0
        if SHARED == 2:
            o_h = tl.arange(0, BLOCK_H)
            m_h = o_h < H
            b_x = tl.load(p_x + (tl.full([], 0, tl.int64) + i_r) * s_xr + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_g = tl.load(p_gate + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_shared = tl.sigmoid(tl.sum(b_x * b_g, axis=0).to(TY).to(tl.float32))
        b_w = tl.where(o_j == K_TOP, b_shared, b_w)
        b_i = tl.where(o_j == K_TOP, E, b_i)
    m_j = o_j < n_pairs
    tl.store(p_weights + i_r * n_pairs + o_j, b_w, mask=m_j)
    tl.store(p_ids + i_r * n_pairs + o_j, b_i, mask=m_j)


@triton.jit
def _route_kernel(p_logits, p_weights, p_ids, p_x, p_gate, E, H, s_r, s_chunk, s_xr, R,
                  p_pair, p_expert, p_scratch, p_used, p_done, NUM_SLOTS, MAX_BLOCKS, SPLIT: tl.constexpr,
                  TY: tl.constexpr, K_TOP: tl.constexpr, NORM_TOPK: tl.constexpr, SHARED: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_H: tl.constexpr, LAYOUT: tl.constexpr,
                  BM: tl.constexpr, BLOCK_P: tl.constexpr, PAIR_BITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  DONE: tl.constexpr, PDL: tl.constexpr):
    """One program per row (`_route_row`), or LAYOUT: one program routes all R rows, then lays their pairs out in
    expert tiles (`_lay_out_tiles`, the shared pair's id E counted as an expert): no launch between the two."""
    wait_for_prior(PDL)
    if LAYOUT:
        for i_r in range(0, R):
            _route_row(i_r, p_logits, p_weights, p_ids, p_x, p_gate, E, H, s_r, s_chunk, s_xr, SPLIT, TY, K_TOP,
                       NORM_TOPK, SHARED, BLOCK_E, BLOCK_TOP, BLOCK_H)
        tl.debug_barrier()  # every row's ids stored before the layout reads them
        _lay_out_tiles(p_ids, p_pair, p_expert, p_scratch, p_used, p_done, R * (K_TOP + (SHARED > 0)),
                       E + (SHARED > 0), NUM_SLOTS, MAX_BLOCKS, BM, BLOCK_P, PAIR_BITS, BLOCK_S, DONE)
    else:
        _route_row(tl.program_id(0), p_logits, p_weights, p_ids, p_x, p_gate, E, H, s_r, s_chunk, s_xr, SPLIT, TY,
                   K_TOP, NORM_TOPK, SHARED, BLOCK_E, BLOCK_TOP, BLOCK_H)


def route_warps(num_experts: int) -> int:
    """Warps of a routing program: its top-k is k rounds of a reduction over the experts, latency-bound, and one
    warp reduces by register shuffles alone (bench on an H200: 4.1 us a row with 4 warps). The softmax's sum order
    depends on it, so every routing kernel uses this rule."""
    return 1 if num_experts <= 256 else 2


def route_triton(logits: torch.Tensor | SplitSum, top_k: int, norm_topk: bool, shared: str | None = None,
                 x: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                 layout: tuple[int, bool] | None = None):
    """logits: [R, E] router logits (any float dtype, or a `SplitSum` the kernel adds up first) -> (weights [R, k]
    float32, expert ids [R, k] int32). Softmax in float32 and top-k like `route`, one program per row.

    `shared`: also route every row to the shared expert, as pair k with id E (k + 1 pairs a row): "plain" weighs
    it 1, "gated" sigmoid(x . shared_gate) (x [R, H], shared_gate [1, H], the rows' MoE input and gate).

    `layout` (bm, done): one program routes the rows and then lays their pairs out in expert tiles of bm (as
    `expert_tiles` does, with handoff counters when `done`); returns (weights, ids, tiles), tiles as
    `fused_experts_triton` takes them. For a row or two: the rows are routed one after another."""
    R, E = logits.shape
    if isinstance(logits, torch.Tensor):
        logits = logits.contiguous()
    p, s_chunk, split = source(logits)
    mode = {None: 0, "plain": 1, "gated": 2}[shared]
    pairs = top_k + (mode > 0)
    if mode == 2:
        assert x is not None and shared_gate is not None and x.stride(-1) == 1, "the gated shared pair needs x, gate"
    xs = x if mode == 2 else p
    gate = shared_gate.reshape(-1).contiguous() if mode == 2 else p
    h = x.shape[1] if mode == 2 else 1
    weights = torch.empty(R, pairs, dtype=torch.float32, device=logits.device)  # [R, pairs]
    ids = torch.empty(R, pairs, dtype=torch.int32, device=logits.device)  # [R, pairs]
    tiles = None
    if layout is not None:
        assert 0 < R * pairs <= SMALL_P, "the routing program lays out decode windows' pairs only"
        bm, done = layout
        tiles, lay = _layout_buffers(R * pairs, E + (mode > 0), bm, logits.device, done)
    if R:
        one = dict(LAYOUT=False, BM=16, BLOCK_P=16, PAIR_BITS=4, BLOCK_S=16, DONE=False)
        lay_args = lay["pointers"] + lay["sizes"] if layout is not None else (ids,) * 5 + (0, 0)
        _route_kernel[(1 if layout is not None else R,)](
            p, weights, ids, xs, gate, E, h, logits.stride(0), s_chunk, xs.stride(0), R, *lay_args, SPLIT=split,
            TY=tl_dtype(logits.dtype), K_TOP=top_k, NORM_TOPK=norm_topk, SHARED=mode,
            BLOCK_E=triton.next_power_of_2(E), BLOCK_TOP=triton.next_power_of_2(pairs),
            BLOCK_H=triton.next_power_of_2(h), **(dict(lay["meta"], LAYOUT=True) if layout is not None else one),
            num_warps=route_warps(E), **pdl(p))
    return (weights, ids) if layout is None else (weights, ids, tiles)


@triton.jit
def _expert_weights(p_w, p_sw, i_e, s_we, E, SHARED: tl.constexpr):
    """Where expert i_e's weights start: in the routed experts' [E, ...] tensor, or the shared expert's own when
    SHARED and i_e is E (the shared pair's id)."""
    p_base = p_w + i_e.to(tl.int64) * s_we
    if SHARED:
        if i_e == E:
            p_base = p_sw
    return p_base


@triton.jit
def _gate_up_tile(i_b, i_n, i_e, p_x, p_w, p_sw, p_grid, p_h, p_pair, P, E, H, I, s_xr, s_we, s_wn, s_wk,
                  SHARED: tl.constexpr, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, TMA: tl.constexpr, FMT: tl.constexpr = 0):
    """h[pair, n] = silu(x[row] . gate[e, n]) * (x[row] . up[e, n]) for tile i_b's pairs (expert i_e), columns
    tile i_n. TMA: p_w is a tensor descriptor of the weights as [E * 2I, H] rows, read by the copy engine (a
    tile's columns past I read the next rows, whose products are not stored). FMT > 0: the weights are packed
    (`strata.kernels.packed`; s_wn: a row record's bytes), each tile dequantized and rounded to x's dtype."""
    b_pair = tl.load(p_pair + i_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], P in padding slots
    m_m = b_pair < P
    b_row = b_pair // K_TOP
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        r_gate = i_e * 2 * I + i_n * BLOCK_N  # the tile's first gate row of the [E * 2I, H] weights
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_x = tl.load(p_x + b_row[:, None].to(tl.int64) * s_xr + o_k[None, :],
                          mask=m_m[:, None] & (o_k < H)[None, :], other=0.0)  # [BM, BK]
            b_wg = p_w.load([r_gate, k0]).to(b_x.dtype)  # [BN, BK]
            b_wu = p_w.load([r_gate + I, k0]).to(b_x.dtype)
            b_gate = tl.dot(b_x, tl.trans(b_wg), b_gate, input_precision="ieee")
            b_up = tl.dot(b_x, tl.trans(b_wu), b_up, input_precision="ieee")
    elif scaled_after(FMT, BLOCK_M, SCALED_AFTER):
        p_e = _expert_weights(p_w, p_sw, i_e, s_we, E, SHARED)
        p_xr = p_x + b_row.to(tl.int64) * s_xr
        p_g = p_e + o_n.to(tl.int64) * s_wn
        b_gate, b_up = packed_mm2(p_xr, m_m, p_g, p_g + I * s_wn, m_n, 0, H, H, FMT, BLOCK_M, BLOCK_N)
    elif FMT > 0:
        p_e = _expert_weights(p_w, p_sw, i_e, s_we, E, SHARED)
        r_n = o_n.to(tl.int64)
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_x = tl.load(p_x + b_row[:, None].to(tl.int64) * s_xr + o_k[None, :],
                          mask=m_m[:, None] & (o_k < H)[None, :], other=0.0)  # [BM, BK]
            b_wg = packed_tile(p_e, r_n, m_n, k0, H, s_wn, p_grid, FMT, BLOCK_K).to(b_x.dtype)  # [BN, BK]
            b_wu = packed_tile(p_e, r_n + I, m_n, k0, H, s_wn, p_grid, FMT, BLOCK_K).to(b_x.dtype)
            b_gate = tl.dot(b_x, tl.trans(b_wg), b_gate, input_precision="ieee")
            b_up = tl.dot(b_x, tl.trans(b_wu), b_up, input_precision="ieee")
    else:
        p_gate = _expert_weights(p_w, p_sw, i_e, s_we, E, SHARED) + o_n[None, :] * s_wn  # [1, BN]
        p_up = p_gate + I * s_wn
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < H
            b_x = tl.load(p_x + b_row[:, None].to(tl.int64) * s_xr + o_k[None, :],
                          mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            m_w = m_k[:, None] & m_n[None, :]
            b_wg = tl.load(p_gate + o_k[:, None] * s_wk, mask=m_w, other=0.0).to(b_x.dtype)  # [BK, BN]
            b_wu = tl.load(p_up + o_k[:, None] * s_wk, mask=m_w, other=0.0).to(b_x.dtype)  # [BK, BN]
            b_gate = tl.dot(b_x, b_wg, b_gate, input_precision="ieee")
            b_up = tl.dot(b_x, b_wu, b_up, input_precision="ieee")
    b_h = b_gate * tl.sigmoid(b_gate) * b_up
    tl.store(p_h + b_pair[:, None].to(tl.int64) * I + o_n[None, :], b_h.to(p_h.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _gate_up_kernel(p_x, p_w, p_sw, p_grid, p_h, p_pair, p_expert, p_used, P, E, H, I, s_xr, s_we, s_wn, s_wk,
                    SHARED: tl.constexpr, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PERSISTENT: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
                    FMT: tl.constexpr = 0):
    """The experts' gate/up products: one tile per program on a [tiles, column tiles] grid, or PERSISTENT: each
    program walks the used tiles (p_used) with a stride of the grid, one loop the compiler pipelines across
    tiles, so a tile's weight loads start while the one before finishes."""
    wait_for_prior(PDL)
    if PERSISTENT:
        n_tiles = tl.cdiv(I, BLOCK_N)
        for t in tl.range(tl.program_id(0), tl.load(p_used) * n_tiles, tl.num_programs(0), flatten=True):
            i_b = t // n_tiles
            _gate_up_tile(i_b, t % n_tiles, tl.load(p_expert + i_b), p_x, p_w, p_sw, p_grid, p_h, p_pair, P, E, H, I, s_xr,
                          s_we, s_wn, s_wk, SHARED, K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, TMA, FMT)
    else:
        i_b = tl.program_id(0)
        i_e = tl.load(p_expert + i_b)
        if i_e < E + SHARED:  # else past the last used block (expert E: the shared one, when SHARED)
            _gate_up_tile(i_b, tl.program_id(1), i_e, p_x, p_w, p_sw, p_grid, p_h, p_pair, P, E, H, I, s_xr, s_we, s_wn, s_wk,
                          SHARED, K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, TMA, FMT)


@triton.jit
def _down_tile(i_b, i_n, i_e, p_h, p_w, p_sw, p_grid, p_route, p_y, p_pair, P, E, H, I, s_we, s_wn, s_wk,
               SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               TMA: tl.constexpr, H_CG: tl.constexpr = False, FMT: tl.constexpr = 0):
    """y[pair, n] = route_weight[pair] * (h[pair] . down[e, n]) for tile i_b's pairs (expert i_e), columns tile
    i_n. TMA: p_w is a tensor descriptor of the weights as [E * H, I] rows (as in `_gate_up_tile`). H_CG: h is
    read from L2, not the multiprocessor's own cache (written by other programs of the same launch). FMT: packed
    weights, as in `_gate_up_tile`."""
    b_pair = tl.load(p_pair + i_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    m_m = b_pair < P
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    b_y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        r_down = i_e * H + i_n * BLOCK_N
        for k0 in range(0, I, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_h = tl.load(p_h + b_pair[:, None].to(tl.int64) * I + o_k[None, :],
                          mask=m_m[:, None] & (o_k < I)[None, :], other=0.0)  # [BM, BK]
            b_w = p_w.load([r_down, k0]).to(b_h.dtype)  # [BN, BK]
            b_y = tl.dot(b_h, tl.trans(b_w), b_y, input_precision="ieee")
    elif scaled_after(FMT, BLOCK_M, SCALED_AFTER):
        b_y = packed_mm(p_h + b_pair.to(tl.int64) * I, m_m,
                        _expert_weights(p_w, p_sw, i_e, s_we, E, SHARED) + o_n.to(tl.int64) * s_wn, m_n, 0, I, I, FMT,
                        BLOCK_M, BLOCK_N, H_CG)
    else:
        p_down = _expert_weights(p_w, p_sw, i_e, s_we, E, SHARED) + o_n[None, :] * s_wn  # [1, BN]
        for k0 in range(0, I, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < I
            p_hk = p_h + b_pair[:, None].to(tl.int64) * I + o_k[None, :]
            m_hk = m_m[:, None] & m_k[None, :]
            if H_CG:
                b_h = tl.load(p_hk, mask=m_hk, other=0.0, cache_modifier=".cg")  # [BM, BK]
            else:
                b_h = tl.load(p_hk, mask=m_hk, other=0.0)
            if FMT > 0:
                b_w = tl.trans(packed_tile(_expert_weights(p_w, p_sw, i_e, s_we, E, SHARED), o_n.to(tl.int64), m_n, k0,
                                           I, s_wn, p_grid, FMT, BLOCK_K)).to(b_h.dtype)
            else:
                b_w = tl.load(p_down + o_k[:, None] * s_wk, mask=m_k[:, None] & m_n[None, :], other=0.0).to(b_h.dtype)
            b_y = tl.dot(b_h, b_w, b_y, input_precision="ieee")
    b_route = tl.load(p_route + b_pair, mask=m_m, other=0.0).to(tl.float32)  # [BM]
    b_y = (b_y * b_route[:, None]).to(p_y.dtype.element_ty)  # float32, or rounded (ExpertTiles.round_pairs)
    tl.store(p_y + b_pair[:, None].to(tl.int64) * H + o_n[None, :], b_y, mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _down_kernel(p_h, p_w, p_sw, p_grid, p_route, p_y, p_pair, p_expert, p_used, P, E, H, I, s_we, s_wn, s_wk,
                 SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PERSISTENT: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, FMT: tl.constexpr = 0):
    """The experts' down products, on a grid like `_gate_up_kernel`'s (one tile per program, or PERSISTENT)."""
    wait_for_prior(PDL)
    if PERSISTENT:
        n_tiles = tl.cdiv(H, BLOCK_N)
        for t in tl.range(tl.program_id(0), tl.load(p_used) * n_tiles, tl.num_programs(0), flatten=True):
            i_b = t // n_tiles
            _down_tile(i_b, t % n_tiles, tl.load(p_expert + i_b), p_h, p_w, p_sw, p_grid, p_route, p_y, p_pair, P, E, H, I,
                       s_we, s_wn, s_wk, SHARED, BLOCK_M, BLOCK_N, BLOCK_K, TMA, False, FMT)
    else:
        i_b = tl.program_id(0)
        i_e = tl.load(p_expert + i_b)
        if i_e < E + SHARED:
            _down_tile(i_b, tl.program_id(1), i_e, p_h, p_w, p_sw, p_grid, p_route, p_y, p_pair, P, E, H, I, s_we, s_wn, s_wk,
                       SHARED, BLOCK_M, BLOCK_N, BLOCK_K, TMA, False, FMT)


@triton.jit
def _experts_kernel(p_x, p_wgu, p_sgu, p_ggu, p_h, p_wd, p_sd, p_gd, p_route, p_y, p_pair, p_expert, p_done, P, E, H, I, s_xr,
                    s_gue, s_gun, s_guk, s_de, s_dn, s_dk, GATE_UP_PROGRAMS,
                    SHARED: tl.constexpr, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOWN_N: tl.constexpr, DOWN_K: tl.constexpr, PDL: tl.constexpr,
                    FMT: tl.constexpr = 0, DOWN_FMT: tl.constexpr = 0):
    """Both products in one launch (ExpertTiles.handoff). Programs below GATE_UP_PROGRAMS compute one gate_up tile
    each (as `_gate_up_kernel`) and then count it done for their pair tile (p_done[tile], zeroed by the layout);
    the programs after them compute one down tile each (as `_down_kernel`) once every gate_up tile of their pair
    tile is counted. The hardware starts a grid's programs in id order, so every gate_up program has started
    before a down program waits: the wait always ends. A pair tile's down products start as soon as its own h
    is written, not after the last gate_up tile of the window, and the launch between them is gone. Same tile
    functions, same bits as the two launches (the interpreter runs the programs in id order: no wait there)."""
    wait_for_prior(PDL)
    i_p = tl.program_id(0)
    n_gate_up = tl.cdiv(I, BLOCK_N)
    if i_p < GATE_UP_PROGRAMS:
        i_b = i_p // n_gate_up
        i_e = tl.load(p_expert + i_b)
        if i_e < E + SHARED:
            _gate_up_tile(i_b, i_p % n_gate_up, i_e, p_x, p_wgu, p_sgu, p_ggu, p_h, p_pair, P, E, H, I, s_xr, s_gue, s_gun,
                          s_guk, SHARED, K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, False, FMT)
            tl.debug_barrier()  # every thread's h stores issued before the tile is counted
            tl.atomic_add(p_done + i_b, 1, sem="release", scope="gpu")
    else:
        n_down = tl.cdiv(H, DOWN_N)
        i_b = (i_p - GATE_UP_PROGRAMS) // n_down
        i_n = (i_p - GATE_UP_PROGRAMS) % n_down
        i_e = tl.load(p_expert + i_b)
        if i_e < E + SHARED:
            done = tl.atomic_add(p_done + i_b, 0, sem="acquire", scope="gpu")
            while done < n_gate_up:
                done = tl.atomic_add(p_done + i_b, 0, sem="acquire", scope="gpu")
            _down_tile(i_b, i_n, i_e, p_h, p_wd, p_sd, p_gd, p_route, p_y, p_pair, P, E, H, I, s_de, s_dn, s_dk, SHARED,
                       BLOCK_M, DOWN_N, DOWN_K, False, True, DOWN_FMT)


@triton.jit
def _combine_kernel(p_y, p_ids, p_s, p_g, p_out, E, H, s_s, s_chunk_s, s_g, s_chunk_g,
                    K_TOP: tl.constexpr, BLOCK_TOP: tl.constexpr, SHARED: tl.constexpr, SPLIT_S: tl.constexpr,
                    SPLIT_G: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[row] = the row's k pair outputs added in ascending expert id, rounded, plus the shared expert."""
    wait_for_prior(PDL)
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    ty = p_out.dtype.element_ty
    b_out = sum_pairs(p_y, p_ids, i_r, o_n, m_n, E, H, K_TOP, BLOCK_TOP).to(ty)
    b_out = add_shared(b_out, p_s + i_r.to(tl.int64) * s_s + o_n, s_chunk_s, p_g + i_r.to(tl.int64) * s_g, s_chunk_g,
                       m_n, SHARED, SPLIT_S, SPLIT_G, ty)
    tl.store(p_out + i_r.to(tl.int64) * H + o_n, b_out, mask=m_n)


def combine_triton(value: PairSum, block_n: int = BLOCK_N) -> torch.Tensor:
    """A PairSum finished: [R, H] in its dtype (each row's pairs in ascending expert id, then the shared expert)."""
    R, H = value.shape
    out = torch.empty(R, H, dtype=value.dtype, device=value.device)  # [R, H]
    if R and H:
        a = pair_args(value)
        y, ids, s, g = a.tensors
        _combine_kernel[(R, triton.cdiv(H, block_n))](y, ids, s, g, out, value.num_experts, H, *a.strides,
                                                      **a.meta, BLOCK_N=block_n, **pdl(y))
    return out


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _expert_tiles_kernel(p_ids, p_pair, p_expert, p_scratch, p_used, p_done, P, E, NUM_SLOTS, MAX_BLOCKS,
                         BM: tl.constexpr, BLOCK_P: tl.constexpr, PAIR_BITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         DONE: tl.constexpr, PDL: tl.constexpr):
    """One program: `_lay_out_tiles`."""
    wait_for_prior(PDL)
    _lay_out_tiles(p_ids, p_pair, p_expert, p_scratch, p_used, p_done, P, E, NUM_SLOTS, MAX_BLOCKS, BM, BLOCK_P,
                   PAIR_BITS, BLOCK_S, DONE)


@triton.jit
def _lay_out_tiles(p_ids, p_pair, p_expert, p_scratch, p_used, p_done, P, E, NUM_SLOTS, MAX_BLOCKS,
                   BM: tl.constexpr, BLOCK_P: tl.constexpr, PAIR_BITS: tl.constexpr, BLOCK_S: tl.constexpr,
                   DONE: tl.constexpr):
    """Group the P (row, choice) pairs by expert into tiles of BM pairs of one expert, in pair
    order within an expert (what a stable sort by expert gives). p_pair[slot] = the pair in that slot (P in
    padding slots); p_expert[tile] = its expert (E past the last used tile); p_used = the tiles in use. Ids >= E
    are left out. DONE: p_done[tile] = 0 (the handoff counters of `_experts_kernel`).

    The pairs are sorted by (expert, pair) in registers; each sorted pair's slot is its position plus the
    padding of the experts' tiles before it. The work grows with P, not with the number of experts."""
    o_q = tl.arange(0, BLOCK_P)
    m_q = o_q < P
    b_ids = tl.minimum(tl.load(p_ids + o_q, mask=m_q, other=E), E)  # ids >= E: not held here, sorted after
    b_ids = tl.where(m_q, b_ids, E + 1)  # padding lanes last
    b_key = tl.sort((b_ids << PAIR_BITS) | o_q, 0)  # unique keys: the order of a stable sort by expert
    b_e = b_key >> PAIR_BITS
    b_pair = b_key & ((1 << PAIR_BITS) - 1)
    tl.store(p_scratch + 1 + o_q, b_e)  # to read each sorted pair's neighbours' experts
    for s0 in range(0, NUM_SLOTS, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        tl.store(p_pair + o_s, tl.zeros([BLOCK_S], dtype=tl.int32) + P, mask=o_s < NUM_SLOTS)
    for t0 in range(0, MAX_BLOCKS, BLOCK_S):
        o_t = t0 + tl.arange(0, BLOCK_S)
        tl.store(p_expert + o_t, tl.zeros([BLOCK_S], dtype=tl.int32) + E, mask=o_t < MAX_BLOCKS)
        if DONE:
            tl.store(p_done + o_t, tl.zeros([BLOCK_S], dtype=tl.int32), mask=o_t < MAX_BLOCKS)
    tl.debug_barrier()  # the neighbours and the padding are written before they are read or overwritten
    b_prev = tl.load(p_scratch + o_q, mask=o_q > 0, other=-1)
    b_next = tl.load(p_scratch + 2 + o_q, mask=o_q < BLOCK_P - 1, other=-1)
    b_first = tl.associative_scan(tl.where(b_prev != b_e, o_q, 0), 0, _max)  # where this pair's expert begins
    b_rank = o_q - b_first  # the pair's place among its expert's pairs
    m_held = b_e < E
    b_count = b_rank + 1
    b_pad = tl.where(m_held & (b_next != b_e), (b_count + BM - 1) // BM * BM - b_count, 0)  # at each expert's end
    b_slot = o_q + tl.cumsum(b_pad, 0) - b_pad  # plus the padding of the experts before
    tl.store(p_pair + b_slot, b_pair, mask=m_held)
    m_first = m_held & (b_rank % BM == 0)  # the first pair of a tile
    tl.store(p_expert + b_slot // BM, b_e, mask=m_first)
    tl.store(p_used, tl.sum(m_first.to(tl.int32), 0))


SMALL_P = 4096  # up to this many pairs (decode windows) the tiles are laid out by one program
ROUTE_LAYOUT_ROWS = 1  # up to this many rows the routing program lays the tiles out itself (it routes them in turn)
LAYOUT_CHUNK = 1024  # pairs per program of the prompt windows' layout


@triton.jit
def _tile_counts_kernel(p_ids, p_counts, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[c, e]: the pairs of chunk c whose expert is e (ids >= E counted in a bin no one reads)."""
    i_c = tl.program_id(0)
    o_q = i_c * CHUNK + tl.arange(0, CHUNK)
    b_ids = tl.minimum(tl.load(p_ids + o_q, mask=o_q < P, other=E), E)
    o_e = tl.arange(0, BLOCK_E)
    tl.store(p_counts + i_c * E + o_e, tl.histogram(b_ids, BLOCK_E), mask=o_e < E)


@triton.jit
def _tile_offsets_kernel(p_counts, p_off, p_expert, p_used, E, NUM_CHUNKS, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program over the experts: each expert's tiles (as many as its pairs fill, in expert order), the tile
    each starts at, p_expert for the used tiles, p_used = their number, and off[c, e] = the slot of the first of
    chunk c's expert-e pairs minus their place in the chunk's sorted order (the pairs of experts below e)."""
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(0, NUM_CHUNKS):
        b_total += tl.load(p_counts + c * E + o_e, mask=m_e, other=0)
    b_blocks = (b_total + BM - 1) // BM
    b_start = tl.cumsum(b_blocks, 0) - b_blocks  # the expert's first tile
    tl.store(p_used, tl.sum(b_blocks, 0))
    b_slot = b_start * BM  # where the expert's next pair goes
    for c in range(0, NUM_CHUNKS):
        b_count = tl.load(p_counts + c * E + o_e, mask=m_e, other=0)
        b_below = tl.cumsum(b_count, 0) - b_count  # the chunk's pairs of lower experts: sorted before
        tl.store(p_off + c * E + o_e, b_slot - b_below, mask=m_e)
        b_slot += b_count
    for j in range(0, tl.max(b_blocks, 0)):
        tl.store(p_expert + b_start + j, o_e, mask=m_e & (j < b_blocks))


@triton.jit
def _tile_slots_kernel(p_ids, p_off, p_pair, P, E, CHUNK: tl.constexpr, PAIR_BITS: tl.constexpr):
    """Chunk c's pairs sorted by (expert, pair) in registers; the pair at sorted place q of expert e goes to slot
    off[c, e] + q: after the pairs of e in earlier chunks and the ones before it in this chunk."""
    i_c = tl.program_id(0)
    o_q = tl.arange(0, CHUNK)
    m_q = i_c * CHUNK + o_q < P
    b_ids = tl.minimum(tl.load(p_ids + i_c * CHUNK + o_q, mask=m_q, other=E), E)
    b_ids = tl.where(m_q, b_ids, E + 1)  # past P: sorted last
    b_key = tl.sort((b_ids << PAIR_BITS) | o_q, 0)
    b_e = b_key >> PAIR_BITS
    m_held = b_e < E
    b_slot = tl.load(p_off + i_c * E + b_e, mask=m_held, other=0) + o_q
    tl.store(p_pair + b_slot, i_c * CHUNK + (b_key & ((1 << PAIR_BITS) - 1)), mask=m_held)


def _max_tiles(P: int, E: int, bm: int) -> int:
    """Tiles of `bm` pairs enough for P pairs over E experts whatever the routing (each expert's last tile may be
    partly filled): the grid the expert kernels are launched on."""
    return triton.cdiv(P, bm) + min(E, P)


def _layout_buffers(P: int, E: int, bm: int, dev: torch.device, done: bool) -> tuple[tuple, dict]:
    """What the one-program layout of P pairs writes, ((pair_of_slot, expert_of_block, used, done or None), and
    its launch arguments: pointers, sizes and constexprs)."""
    max_blocks = _max_tiles(P, E, bm)
    pair_of_slot = torch.empty(max_blocks * bm + 1, dtype=torch.int32, device=dev)
    expert_of_block = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    block_p = max(16, triton.next_power_of_2(P))
    scratch = torch.empty(block_p + 3, dtype=torch.int32, device=dev)  # (its last word: `used`)
    used = scratch[block_p + 2 :]
    counters = torch.empty(max_blocks, dtype=torch.int32, device=dev) if done else None
    return (pair_of_slot, expert_of_block, used, counters), dict(
        pointers=(pair_of_slot, expert_of_block, scratch, used, counters if done else used),
        sizes=(max_blocks * bm + 1, max_blocks),
        meta=dict(BM=bm, BLOCK_P=block_p, PAIR_BITS=block_p.bit_length() - 1, BLOCK_S=1024, DONE=done))


def expert_tiles(ids: torch.Tensor, E: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [R, k] -> (pair_of_slot [max_blocks * bm + 1] int32, expert_of_block [max_blocks] int32, used): the
    pairs grouped by expert in tiles of `bm`, in pair order within an expert (P in padding slots, E past the last
    used tile; ids >= E left out) and `used` ([1] int32: the tiles in use). Decode windows: one program; prompt
    windows: three launches over chunks of the pairs. The same layout as `expert_tiles_sorted`."""
    return _expert_tiles(ids, E, bm, False)[:3]


def _expert_tiles(ids: torch.Tensor, E: int, bm: int, done: bool) -> tuple:
    """`expert_tiles` plus the handoff counters (`done`: [max_blocks] int32 zeroed by the layout program; decode
    windows only), or None."""
    P = ids.numel()
    dev = ids.device
    max_blocks = _max_tiles(P, E, bm)
    flat = ids.reshape(-1).to(torch.int32)
    if P <= SMALL_P:
        tiles, lay = _layout_buffers(P, E, bm, dev, done)
        block_p = lay["meta"]["BLOCK_P"]
        _expert_tiles_kernel[(1,)](flat, *lay["pointers"], P, E, *lay["sizes"], **lay["meta"],
                                   num_warps=8 if block_p >= 1024 else 4, **pdl(ids))
        return tiles
    assert not done, "handoff counters are zeroed by the decode windows' layout program only"
    chunk, chunks = LAYOUT_CHUNK, triton.cdiv(P, LAYOUT_CHUNK)
    block_e = triton.next_power_of_2(E + 1)
    counts = torch.empty(chunks, E, dtype=torch.int32, device=dev)  # [chunks, E]
    off = torch.empty(chunks, E, dtype=torch.int32, device=dev)  # [chunks, E]
    pair_of_slot = torch.full((max_blocks * bm + 1,), P, dtype=torch.int32, device=dev)
    expert_of_block = torch.full((max_blocks,), E, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    _tile_counts_kernel[(chunks,)](flat, counts, P, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    _tile_offsets_kernel[(1,)](counts, off, expert_of_block, used, E, chunks, BM=bm, BLOCK_E=block_e,
                               num_warps=4 if block_e <= 1024 else 8)
    _tile_slots_kernel[(chunks,)](flat, off, pair_of_slot, P, E, CHUNK=chunk, PAIR_BITS=chunk.bit_length() - 1,
                                  num_warps=8)
    return pair_of_slot, expert_of_block, used, None


def expert_tiles_sorted(ids: torch.Tensor, E: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_tiles`' layout by a device sort and torch ops (the reference its kernels are checked against)."""
    P = ids.numel()
    dev = ids.device
    max_blocks = _max_tiles(P, E, bm)
    flat = ids.reshape(-1).to(torch.int32)  # [P]
    order = torch.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    sorted_e = flat[order]  # [P]
    experts = torch.arange(E, device=dev, dtype=torch.int32)  # [E]
    starts = torch.searchsorted(sorted_e, experts)  # [E] (bincount would sync on CUDA)
    counts = torch.searchsorted(sorted_e, experts, right=True) - starts  # [E]
    blocks = (counts + bm - 1) // bm  # [E]
    block_ends = blocks.cumsum(0)  # [E]
    held = sorted_e.clamp(max=E - 1)  # skipped pairs (ids >= E) sort last; their slot is the spare one below
    slot = (block_ends - blocks)[held] * bm + torch.arange(P, device=dev) - starts[held]  # [P]
    slot = torch.where(sorted_e < E, slot, max_blocks * bm)
    pair_of_slot = torch.full((max_blocks * bm + 1,), P, dtype=torch.int32, device=dev)  # [max_blocks * BM + spare]
    pair_of_slot[slot] = order.int()
    expert_of_block = torch.searchsorted(block_ends, torch.arange(max_blocks, device=dev), right=True).int()
    return pair_of_slot, expert_of_block


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (4 off the GPU, where Triton's interpreter runs the kernels)."""
    return _multiprocessors(device) if device.type == "cuda" else 4


def _stored(w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """What the kernels address: a weight itself, or a packed one's row records."""
    return w.data if isinstance(w, PackedWeight) else w


def _format(w: torch.Tensor | PackedWeight) -> tuple[str | None, int]:
    return (w.fmt, w.kernel_format) if isinstance(w, PackedWeight) else (None, 0)


def shared_fits(shared: tuple, gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight) -> bool:
    """Whether a shared expert (gate_up [2I, H], down [H, I]) can run as one more expert of the routed ones: the
    same shapes, strides and packing as one routed expert's, so the experts' kernels address it like the others."""
    return all(tuple(s.shape) == tuple(w.shape[1:]) and _format(s) == _format(w)
               and _stored(s).stride() == _stored(w).stride()[1:] for s, w in zip(shared, (gate_up, down)))


def fused_experts_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, tiles: ExpertTiles = DECODE_TILES, defer: bool = False,
                         shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                         layout: tuple | None = None) -> torch.Tensor | PairSum:
    """`routed_experts` on the device: x [R, H]; weights, ids [R, k]; gate_up [E, 2I, H]; down [E, H, I]. The pairs'
    tile layout, then the gate_up and the down products (one launch each, or one for both: `ExpertTiles.handoff`).
    Returns [R, H] in x's dtype. The (row, choice) pairs are grouped by expert on the device, in tiles of
    `tiles.block_m` pairs of one expert; the grid is an upper bound on the tiles, fixed by the shapes.
    A row's bits depend on `tiles` but not on the other rows: decode windows always use `decode_tiles(rows)`
    (DECODE_TILES, its pipeline stages aside, which do not change the bits).
    A pair whose id is >= E (an expert not held on this device: the CPU expert pool computes it) is never
    computed and adds nothing; the rows' other pairs keep their bits. `defer`: return the pairs' outputs as a
    `PairSum` for the next kernel to add (no combine launch). `shared`: the shared expert's (gate_up [2I, H],
    down [H, I]), computed as expert E for the pairs whose id is E (`route_triton(..., shared=...)`). `layout`:
    the pairs' tiles already laid out (`route_triton(..., layout=...)`), else laid out here."""
    R, H = x.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    k = ids.shape[1]
    P = R * k
    held = E + (shared is not None)  # ids below this are computed here
    if P == 0 or held == 0:  # no rows, or no expert held here: every pair adds nothing
        pairs = PairSum(torch.empty(P, H, dtype=torch.float32, device=x.device), ids, held, x.dtype)
        return pairs if defer else combine_triton(pairs, tiles.combine_n)
    assert shared is None or shared_fits(shared, gate_up, down), \
        "the shared expert's gate_up and down must have the routed experts' shapes and strides"
    s_gate_up, s_down = (_stored(w) for w in (shared if shared is not None else (gate_up, down)))
    fmt, down_fmt = _format(gate_up)[1], _format(down)[1]  # each packed or not on its own (Q4_K_M: q4_k, q6_k)
    g_gate_up, g_down = grid_words(gate_up), grid_words(down)  # IQ3_S's grid (read by iq3_s tiles only)
    gate_up, down = _stored(gate_up), _stored(down)  # from here on, what the kernels address
    x, ids = x.contiguous(), ids.contiguous()
    dev = x.device
    bm = tiles.block_m
    handoff = tiles.handoff and P <= SMALL_P
    if layout is None:
        layout = _expert_tiles(ids, held, bm, handoff)
    pair_of_slot, expert_of_block, used, done = layout
    assert (done is not None) == handoff, "handoff tiles need the layout's counters"
    max_blocks = expert_of_block.shape[0]

    down_persistent = tiles.persistent if tiles.down_persistent is None else tiles.down_persistent
    t = dict(BLOCK_M=bm, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
             num_stages=tiles.num_stages, SHARED=shared is not None, FMT=fmt)

    def grid(columns: int, block_n: int, per_sm: int) -> tuple[int, ...]:
        if per_sm:
            return (min(max_blocks * triton.cdiv(columns, block_n), per_sm * multiprocessors(dev)),)
        return (max_blocks, triton.cdiv(columns, block_n))

    t_down = dict(t, BLOCK_N=tiles.down_n or tiles.block_n, BLOCK_K=tiles.down_k or tiles.block_k,
                  PERSISTENT=down_persistent > 0, num_stages=tiles.down_stages or tiles.num_stages, FMT=down_fmt)
    tma = tiles.tma and shared is None and fmt == 0 and down_fmt == 0 and all(  # the descriptors' rules: contiguous, 16-byte aligned rows
        w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[-1] * w.element_size() % 16 == 0 for w in (gate_up, down))
    w_gate_up, w_down = gate_up, down
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_gate_up = TensorDescriptor.from_tensor(gate_up.view(E * 2 * I, H), [tiles.block_n, tiles.block_k])
        w_down = TensorDescriptor.from_tensor(down.view(E * H, I), [t_down["BLOCK_N"], t_down["BLOCK_K"]])
    h = torch.empty(P, I, dtype=x.dtype, device=dev)  # [P, I]
    y = torch.empty(P, H, dtype=x.dtype if tiles.round_pairs else torch.float32, device=dev)  # [P, H]
    route = weights.reshape(-1).contiguous()
    if handoff:
        assert not (tma or tiles.persistent or down_persistent) and t_down["num_stages"] == tiles.num_stages, \
            "handoff tiles: one program per tile, pointer loads, the same pipeline stages for both products"
        gate_up_programs = max_blocks * triton.cdiv(I, tiles.block_n)
        _experts_kernel[(gate_up_programs + max_blocks * triton.cdiv(H, t_down["BLOCK_N"]),)](
            x, gate_up, s_gate_up, g_gate_up, h, down, s_down, g_down, route, y, pair_of_slot, expert_of_block, done,
            P, E, H, I,
            x.stride(0), *gate_up.stride(), *down.stride(), gate_up_programs, K_TOP=k, DOWN_N=t_down["BLOCK_N"],
            DOWN_K=t_down["BLOCK_K"], DOWN_FMT=down_fmt, **t, **pdl(x))
    else:
        _gate_up_kernel[grid(I, tiles.block_n, tiles.persistent)](
            x, w_gate_up, s_gate_up, g_gate_up, h, pair_of_slot, expert_of_block, used, P, E, H, I, x.stride(0),
            *gate_up.stride(), K_TOP=k, PERSISTENT=tiles.persistent > 0, TMA=tma, **t, **pdl(x))
        _down_kernel[grid(H, t_down["BLOCK_N"], down_persistent)](
            h, w_down, s_down, g_down, route, y, pair_of_slot, expert_of_block, used, P, E, H, I,
            *down.stride(), TMA=tma, **t_down, **pdl(x))
    pairs = PairSum(y, ids, held, x.dtype)
    return pairs if defer else combine_triton(pairs, tiles.combine_n)


def moe_triton(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk: bool,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_gate: torch.Tensor | None = None,
    linear: Linear = project,
    tiles: ExpertTiles = DECODE_TILES,
    defer: bool = False,
    shared_pair: bool = False,
) -> torch.Tensor | PairSum:
    """`moe` with the Triton router and experts; `linear` runs the router and the shared expert's products (it
    may return `SplitSum`s: `linear_split`; by default `project`, which writes a packed shared expert out first, as
    prompt windows' projections are). `defer`: the result is a `PairSum` for the next kernel to finish.
    `shared_pair`: a shared expert of the routed experts' shape runs as one more pair of every row inside the
    experts' kernels (its weight 1 or the sigmoid of its gate), not as products of its own: fewer launches, other
    roundings than the separate products (the same for a row whatever shares its window)."""
    logits = linear(x, router)
    as_pair = shared is not None and shared_pair and shared_fits(shared, gate_up, down)
    mode = ("gated" if shared_gate is not None else "plain") if as_pair else None
    # a window of a row or two: the routing program lays the tiles out too (one launch fewer)
    lay = (tiles.block_m, True) if tiles.handoff and 0 < x.shape[0] <= ROUTE_LAYOUT_ROWS else None
    routed = route_triton(logits, top_k, norm_topk, mode, x, shared_gate, layout=lay)
    weights, ids, layout = routed if lay is not None else (*routed, None)
    pairs = fused_experts_triton(x, weights, ids, gate_up, down, tiles, defer=True, shared=shared if as_pair else None,
                                 layout=layout)
    if shared is not None and not as_pair:
        s = linear(silu_mul_triton(linear(x, shared[0])), shared[1])
        g = linear(x, shared_gate) if shared_gate is not None else None
        pairs = replace(pairs, shared=s, shared_gate=g)
    return pairs if defer else combine_triton(pairs, tiles.combine_n)
