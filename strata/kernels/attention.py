"""Causal attention of a sequence's rows over that sequence's K/V cells (GQA): torch references, and
Triton kernels beside them for decode rows over a pool of sequences and for a prompt window."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels.pdl import pdl, wait_for_prior


def attention(q: torch.Tensor, k_cells: torch.Tensor, v_cells: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of one sequence attend to its cells up to their own position.

    q: [T, H, D] rows at `positions` [T]; k_cells, v_cells: [L, Hkv, D] cells 0..L-1 of the sequence
    (L > every position). Each query head h reads K/V head h // (H / Hkv). Returns [T, H, D].
    """
    t, h, d = q.shape
    n_cells, hkv, _ = k_cells.shape
    group = h // hkv
    if t > 1 and q.device.type == "cpu" and q.dtype == k_cells.dtype == v_cells.dtype == torch.float32:
        # a prompt window's rows on the CPU: torch's fused attention (blocked, no [T, L] scores held), with each row's
        # visible cells as its mask; 2.3x the matmuls below at SmolLM2's heads, 256 rows over 2,048 cells
        visible = torch.arange(n_cells, device=q.device)[None, :] <= positions[:, None]  # [T, L]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cells.transpose(0, 1)[None],
                                             v_cells.transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                             enable_gqa=group > 1)
        return out[0].transpose(0, 1)
    qg = q.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, t * group, d)  # [Hkv, T*G, D]
    scores = torch.matmul(qg.float(), k_cells.permute(1, 2, 0).float()) * scale  # [Hkv, T*G, L]
    # a decode row over the cells up to its own (on the CPU, where reading its position costs no wait) sees them
    # all: no mask to build, the same bits (a third of the call's time at SmolLM2's sizes)
    if not (t == 1 and q.device.type == "cpu" and int(positions[0]) >= n_cells - 1):
        cells = torch.arange(n_cells, device=q.device)
        visible = cells[None, :] <= positions[:, None]  # [T, L]
        mask = visible.repeat_interleave(group, dim=0)  # [T*G, L]
        scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_cells.dtype)
    out = torch.matmul(probs, v_cells.permute(1, 0, 2))  # [Hkv, T*G, D]
    return out.reshape(hkv, t, group, d).permute(1, 0, 2, 3).reshape(t, h, d)


def decode_attention_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode rows of several sequences over a pool of cells, one `attention` call per row.

    q: [R, H, D]; k_pool, v_pool: [S, L, Hkv, D]; seq_ids, positions: [R]. Row r attends cells
    0..positions[r] of sequence seq_ids[r]. Returns [R, H, D].
    """
    rows = [
        attention(q[r : r + 1], k_pool[seq_ids[r]], v_pool[seq_ids[r]], positions[r : r + 1], scale)
        for r in range(q.shape[0])
    ]
    return torch.cat(rows) if rows else torch.empty_like(q)


# --- Triton kernels -------------------------------------------------------------------------------
#
# Scores are kept in the log2 domain (scale * log2(e) folded in, exp2 for the softmax). A row's
# arithmetic depends only on its own cells: one program per (row, K/V head) for decode, with fixed
# constexpr blocks, and the cells visited in a fixed order, so a row rounds the same in any batch.
# Cells past a row's position are never loaded.

LOG2E = 1.4426950408889634
# Decode windows split each row's cells in chunks of SPLIT_CELLS (one program per row, K/V head and chunk), merged by
# the chunk that finishes last: a row of up to SPLIT_CELLS cells is one program, as without the split, and a long
# one is spread over the GPU (H200, 8,000 cells: the 30B shape 122.6 tok/s at 1 row with one program per head,
# 315.1 split). A constant, never derived from the rows: a row's bits do not depend on what shares its window.
SPLIT_CELLS = 512


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 stays exact; 16-bit types ignore it


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


@triton.jit
def _decode_kernel(
    q, k_pool, v_pool, seq_ids, positions, out, gate, acc_part, m_part, l_part, arrivals,
    qk_scale,
    s_qr, s_qh, s_qd,
    s_ks, s_kl, s_kh, s_kd,
    s_vs, s_vl, s_vh, s_vd,
    s_or, s_oh, s_od,
    s_gr, s_gh,
    s_ar, s_ah, s_ac, s_ad,
    s_mr, s_mh, s_mc,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, CHUNK_CELLS: tl.constexpr, BLOCK_C: tl.constexpr, ONE_TILE: tl.constexpr,
    MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATE: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (row, K/V head[, chunk of CHUNK_CELLS cells when SPLIT]); the G query heads of
    the group are the rows of the [BLOCK_G, D] x [D, BLOCK_N] products (padded rows read zeros).

    SPLIT: only the chunks holding the row's cells 0..position work. A row held by one chunk is finished by
    it as without SPLIT (the same bits). Otherwise each chunk stores its partial (acc, max, sum) and counts
    itself on the row's and head's arrival counter; the last to arrive merges the partials (each weighted by
    exp2(its max - the largest), added in chunk order; ONE_TILE: the maxima and sums of all of them in one
    [BLOCK_G, BLOCK_C] load, else BLOCK_C at a time), finishes the row and sets the counter back to zero for the
    next launch: no second launch.
    GATE: each head's output times sigmoid(gate), with torch's roundings (`out * torch.sigmoid(gate)`)."""
    wait_for_prior(PDL)
    i_r = tl.program_id(0)
    i_hkv = tl.program_id(1)
    i_c = tl.program_id(2)
    pos = tl.load(positions + i_r).to(tl.int32)
    if SPLIT:
        n_used = tl.maximum(pos, 0) // CHUNK_CELLS + 1  # chunks holding cells 0..pos
        lo = i_c * CHUNK_CELLS
        hi = tl.minimum(lo + CHUNK_CELLS, pos + 1)
    else:
        n_used = 1
        lo = 0
        hi = pos + 1
    if i_c < n_used:
        i_s = tl.load(seq_ids + i_r).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = i_hkv * G + offs_g  # [BLOCK_G]
        mask_g = offs_g < G
        mask_d = offs_d < D
        mask_o = mask_g[:, None] & mask_d[None, :]

        p_q = q + i_r * s_qr + heads[:, None] * s_qh + offs_d[None, :] * s_qd
        b_q = tl.load(p_q, mask=mask_o, other=0.0)  # [BLOCK_G, BLOCK_D]
        p_k0 = k_pool + i_s * s_ks + i_hkv * s_kh
        p_v0 = v_pool + i_s * s_vs + i_hkv * s_vh

        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # finite: a row with no cell yet never gives NaN
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cells = start + offs_n  # [BLOCK_N]
            mask_n = cells < hi  # the row's cells of this program's range (a block may pass a chunk's end)
            cells64 = cells.to(tl.int64)
            p_k = p_k0 + cells64[None, :] * s_kl + offs_d[:, None] * s_kd
            b_k = tl.load(p_k, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            p_v = p_v0 + cells64[:, None] * s_vl + offs_d[None, :] * s_vd
            b_v = tl.load(p_v, mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D], with K's load
            b_s = tl.dot(b_q, b_k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
            b_s = tl.where(mask_n[None, :], b_s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            alpha = tl.exp2(m_i - m_new)
            b_p = tl.exp2(b_s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(b_p, 1)
            acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
            m_i = m_new

        finish = n_used == 1
        if n_used > 1:  # this chunk's partial, then the merge by the last chunk to arrive
            o_part = i_r * s_mr + heads * s_mh + i_c * s_mc  # [BLOCK_G]
            tl.store(acc_part + i_r * s_ar + heads[:, None] * s_ah + i_c * s_ac + offs_d[None, :] * s_ad, acc,
                     mask=mask_o)
            tl.store(m_part + o_part, m_i, mask=mask_g)
            tl.store(l_part + o_part, l_i, mask=mask_g)
            tl.debug_barrier()  # every thread's partial stored before the chunk is counted
            p_count = arrivals + i_r * tl.num_programs(1) + i_hkv
            finish = tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == n_used - 1
            if finish:
                tl.store(p_count, 0)  # ready for the next launch
                o_cc = tl.arange(0, BLOCK_C)
                o_ml = i_r * s_mr + heads[:, None] * s_mh  # [BLOCK_G, 1]: the row's heads in m_part and l_part
                p_a = acc_part + i_r * s_ar + heads[:, None] * s_ah + offs_d[None, :] * s_ad  # [BLOCK_G, BLOCK_D]
                if ONE_TILE:  # every chunk's max and sum in one [BLOCK_G, BLOCK_C] load, the weights from that tile
                    m_gc = mask_g[:, None] & (o_cc < n_used)[None, :]
                    o_gc = o_ml + o_cc[None, :] * s_mc  # [BLOCK_G, BLOCK_C]
                    b_m = tl.load(m_part + o_gc, mask=m_gc, other=-1.0e30, cache_modifier=".cg")
                    b_l = tl.load(l_part + o_gc, mask=m_gc, other=0.0, cache_modifier=".cg")
                    b_w = tl.exp2(b_m - tl.max(b_m, 1)[:, None])  # [BLOCK_G, BLOCK_C]
                    l_i = tl.sum(b_l * b_w, 1)
                    # the weighted partials added in chunk order, MERGE chunks' loads issued together
                    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
                    for c0 in range(0, n_used, MERGE):
                        for j in tl.static_range(MERGE):
                            b_a = tl.load(p_a + (c0 + j) * s_ac, mask=mask_o & (c0 + j < n_used), other=0.0,
                                          cache_modifier=".cg")
                            acc += b_a * tl.sum(tl.where(o_cc[None, :] == c0 + j, b_w, 0.0), 1)[:, None]
                else:  # more chunks than one tile holds: the same merge, the tile's work made linear in the chunks
                    # the largest of the chunks' maxima, BLOCK_C chunks a load, reduced over the chunks once after
                    # the loop (a reduction inside it fails triton 3.6's OptimizeThreadLocality pass at BLOCK_C 16)
                    b_tops = tl.full([BLOCK_G, BLOCK_C], -1.0e30, dtype=tl.float32)
                    for c0 in range(0, n_used, BLOCK_C):
                        m_gc = mask_g[:, None] & (c0 + o_cc < n_used)[None, :]
                        b_tops = tl.maximum(b_tops, tl.load(m_part + o_ml + (c0 + o_cc)[None, :] * s_mc, mask=m_gc,
                                                            other=-1.0e30, cache_modifier=".cg"))
                    b_top = tl.max(b_tops, 1)  # [BLOCK_G]
                    # each chunk weighted by exp2(its max - the largest); MERGE chunks' maxima, sums and partials
                    # loaded together, their weights a [BLOCK_G, MERGE] tile, the partials added in chunk order (the
                    # weighted sums kept as a tile too, reduced after the loop)
                    o_cm = tl.arange(0, MERGE)
                    b_ls = tl.zeros([BLOCK_G, MERGE], dtype=tl.float32)
                    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
                    for c0 in range(0, n_used, MERGE):
                        m_gm = mask_g[:, None] & (c0 + o_cm < n_used)[None, :]
                        o_gm = o_ml + (c0 + o_cm)[None, :] * s_mc  # [BLOCK_G, MERGE]
                        b_mm = tl.load(m_part + o_gm, mask=m_gm, other=-1.0e30, cache_modifier=".cg")
                        b_lm = tl.load(l_part + o_gm, mask=m_gm, other=0.0, cache_modifier=".cg")
                        b_w = tl.exp2(b_mm - b_top[:, None])  # [BLOCK_G, MERGE]
                        b_ls += b_lm * b_w
                        for j in tl.static_range(MERGE):
                            b_a = tl.load(p_a + (c0 + j) * s_ac, mask=mask_o & (c0 + j < n_used), other=0.0,
                                          cache_modifier=".cg")
                            acc += b_a * tl.sum(tl.where(o_cm[None, :] == j, b_w, 0.0), 1)[:, None]
                    l_i = tl.sum(b_ls, 1)
        if finish:
            l_i = tl.where(l_i > 0.0, l_i, 1.0)  # a row with position < 0 gives zeros
            ty = out.dtype.element_ty
            b_o = (acc / l_i[:, None]).to(ty)
            if GATE:  # the output gate: sigmoid rounded to the model's dtype, then the product rounded
                b_g = tl.load(gate + i_r * s_gr + heads[:, None] * s_gh + offs_d[None, :], mask=mask_o, other=0.0)
                b_g = tl.sigmoid(b_g.to(tl.float32)).to(ty)
                b_o = (b_o.to(tl.float32) * b_g.to(tl.float32)).to(ty)
            tl.store(out + i_r * s_or + heads[:, None] * s_oh + offs_d[None, :] * s_od, b_o, mask=mask_o)


def _decode_blocks(d: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_D, BLOCK_N): from the head shape only."""
    block_d = _block_d(d)
    # cells per step: 64 for heads of up to 128 (eighth session, H200, 30B shape at 128-160 cells: +0.5 and +0.6 %
    # tok/s at 1 row in two A/Bs against 128, +0.1 % at 8), 32 for wider heads
    return max(16, triton.next_power_of_2(group)), block_d, 32 if block_d > 128 else 64


def _check_decode(q, k_pool, v_pool) -> tuple[int, int, int, int]:
    r, h, d = q.shape
    hkv = k_pool.shape[2]
    assert k_pool.shape == v_pool.shape and k_pool.shape[3] == d and h % hkv == 0, (q.shape, k_pool.shape, v_pool.shape)
    assert q.dtype == k_pool.dtype == v_pool.dtype, (q.dtype, k_pool.dtype, v_pool.dtype)
    return r, h, d, hkv


def decode_attention_triton(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
    scale: float, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention_reference` as one Triton program per (row, K/V head). Returns [R, H, D] in q's dtype.
    `gate` [R, H, D] (any row and head strides, unit last stride): the output gate, applied as the heads are
    stored (`out * torch.sigmoid(gate)`)."""
    r, h, d, hkv = _check_decode(q, k_pool, v_pool)
    out = torch.empty_like(q)  # [R, H, D]
    if r == 0:
        return out
    assert gate is None or (gate.shape == q.shape and gate.stride(-1) == 1), "gate: [R, H, D], unit last stride"
    block_g, block_d, block_n = _decode_blocks(d, h // hkv)
    _decode_kernel[(r, hkv, 1)](
        q, k_pool, v_pool, seq_ids, positions, out, gate if gate is not None else out, out, out, out, seq_ids,
        scale * LOG2E,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *out.stride(),
        *(gate.stride()[:2] if gate is not None else (0, 0)),
        0, 0, 0, 0, 0, 0, 0,
        G=h // hkv, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=False, CHUNK_CELLS=block_n, BLOCK_C=1, ONE_TILE=True, MERGE=1, DOT_PRECISION=_dot_precision(q.dtype),
        GATE=gate is not None,
        num_warps=4, **pdl(q)
    )
    return out


MERGE_CHUNKS = 8  # chunk partials the merge loads at a time for heads up to 128 wide (half as many for wider heads)
# Pools of up to this many chunks (32,768 cells) merge from one [heads, chunks] tile of the chunks' maxima and sums,
# each chunk's weight picked out of it (work growing with the square of the chunks: past 256 registers spill).
# Larger pools take the largest max in a first pass, then MERGE chunks' tiles at a time: linear, but slower where
# both run (H200, 30B shape, 8,000 cells = 16 chunks: 304.7 against 310.5 tok/s at 1 row). An online softmax over
# the chunks (the running max raised MERGE chunks at a time, no first pass) was slower still: 298.2.
ONE_TILE_CHUNKS = 64


def _merge_chunks(block_d: int, n_chunks: int) -> int:
    return min(MERGE_CHUNKS if block_d <= 128 else MERGE_CHUNKS // 2, triton.next_power_of_2(n_chunks))


_arrivals: dict[tuple[torch.device, int], list[torch.Tensor]] = {}  # (device, thread) -> its counters, last in use


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on `device`, zero between launches (the kernel that counts on them sets them back).
    One set per device and launching thread: a thread's launches on a device run one after the other (a stage's
    worker queues its windows on its own stream, and captures and replays its graphs itself), and stages that
    share a device never share counters. Grown when a window needs more, never freed: a captured graph keeps the
    address it was given."""
    held = _arrivals.setdefault((device, threading.get_ident()), [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(4096, triton.next_power_of_2(n)), dtype=torch.int32, device=device))
    return held[-1]


def decode_attention_split_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
    chunk_cells: int | None = None,
) -> torch.Tensor:
    """Flash-decoding: `decode_attention_reference` with each row's cells split in fixed chunks of
    `chunk_cells` (one program per (row, K/V head, chunk); chunks past a row's position do nothing), merged in
    chunk order by the chunk that finishes last (one launch). A row within the first chunk gets bitwise what
    `decode_attention_triton` gives. `chunk_cells` must be a constant (a multiple of 64), never derived from the
    number of rows; None: SPLIT_CELLS, what decode windows use. `gate` as in `decode_attention_triton`. Returns
    [R, H, D] in q's dtype."""
    r, h, d, hkv = _check_decode(q, k_pool, v_pool)
    out = torch.empty_like(q)  # [R, H, D]
    if r == 0:
        return out
    assert gate is None or (gate.shape == q.shape and gate.stride(-1) == 1), "gate: [R, H, D], unit last stride"
    block_g, block_d, block_n = _decode_blocks(d, h // hkv)
    chunk_cells = SPLIT_CELLS if chunk_cells is None else chunk_cells  # read at the call: tests lower it
    assert chunk_cells % 64 == 0, chunk_cells
    n_chunks = triton.cdiv(k_pool.shape[1], chunk_cells)
    acc_part = torch.empty(r, h, n_chunks, d, device=q.device, dtype=torch.float32)  # [R, H, C, D]
    m_part = torch.empty(r, h, n_chunks, device=q.device, dtype=torch.float32)  # [R, H, C]
    l_part = torch.empty_like(m_part)  # [R, H, C]
    _decode_kernel[(r, hkv, n_chunks)](
        q, k_pool, v_pool, seq_ids, positions, out, gate if gate is not None else out, acc_part, m_part, l_part,
        _arrival_counters(q.device, r * hkv),
        scale * LOG2E,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *out.stride(),
        *(gate.stride()[:2] if gate is not None else (0, 0)),
        *acc_part.stride(), *m_part.stride(),
        G=h // hkv, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=True, CHUNK_CELLS=chunk_cells, BLOCK_C=min(triton.next_power_of_2(n_chunks), ONE_TILE_CHUNKS),
        ONE_TILE=n_chunks <= ONE_TILE_CHUNKS,
        MERGE=_merge_chunks(block_d, n_chunks),
        DOT_PRECISION=_dot_precision(q.dtype), GATE=gate is not None,
        num_warps=4, **pdl(q)
    )
    return out


@triton.jit
def _prefill_kernel(
    q, k_cells, v_cells, positions, out,
    qk_scale, T,
    s_qt, s_qh, s_qd,
    s_kl, s_kh, s_kd,
    s_vl, s_vh, s_vd,
    s_ot, s_oh, s_od,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (BLOCK_M rows, query head), the blocks with the most cells first (they take longest);
    cells up to the block's highest position: first the blocks every row sees whole (no mask), then the rest."""
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_h = tl.program_id(1)
    i_hkv = i_h // G
    offs_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < T
    mask_d = offs_d < D
    b_pos = tl.load(positions + offs_m, mask=mask_m, other=-1).to(tl.int32)  # [BLOCK_M]
    hi = tl.max(b_pos, 0) + 1
    seen_by_all = (tl.min(tl.where(mask_m, b_pos, hi), 0) + 1) // BLOCK_N * BLOCK_N  # cells every row sees

    p_q = q + offs_m[:, None] * s_qt + i_h * s_qh + offs_d[None, :] * s_qd
    b_q = tl.load(p_q, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    p_k0 = k_cells + i_hkv * s_kh
    p_v0 = v_cells + i_hkv * s_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, seen_by_all, BLOCK_N):
        cells = start + offs_n  # [BLOCK_N]
        b_k = tl.load(p_k0 + cells[None, :] * s_kl + offs_d[:, None] * s_kd, mask=mask_d[:, None], other=0.0)
        b_s = tl.dot(b_q, b_k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        alpha = tl.exp2(m_i - m_new)
        b_p = tl.exp2(b_s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v0 + cells[:, None] * s_vl + offs_d[None, :] * s_vd, mask=mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        m_i = m_new
    for start in range(seen_by_all, hi, BLOCK_N):
        cells = start + offs_n  # [BLOCK_N]
        mask_n = cells < hi
        p_k = p_k0 + cells[None, :] * s_kl + offs_d[:, None] * s_kd
        b_k = tl.load(p_k, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        b_s = tl.dot(b_q, b_k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        b_s = tl.where(cells[None, :] <= b_pos[:, None], b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        alpha = tl.exp2(m_i - m_new)
        b_p = tl.exp2(b_s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        p_v = p_v0 + cells[:, None] * s_vl + offs_d[None, :] * s_vd
        b_v = tl.load(p_v, mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    p_o = out + offs_m[:, None] * s_ot + i_h * s_oh + offs_d[None, :] * s_od
    tl.store(p_o, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_tiles(d: int) -> tuple[int, int, int, int]:
    """(rows per block, cells per step, warps, stages) of the prompt attention for heads `d` wide."""
    return PREFILL_TILES_WIDE if _block_d(d) > 128 else PREFILL_TILES


# Candidates timed one by one on an H200 (sixth session), causal attention over 4,096 rows: heads of 128 (30B:
# 32 q / 4 kv heads) 307.6 us with these, 347-587 us with 128-row blocks; heads of 256 (Qwen3-Next: 16 / 2)
# 330.1 us with 128 rows x 64 cells on 8 warps, 2 stages, against 765.7 us with the 64 x 32 blocks before and
# 405-609 us otherwise (128 x 64 with 3 stages and 128 x 128 do not fit in shared memory).
PREFILL_TILES = (64, 64, 4, 3)
PREFILL_TILES_WIDE = (128, 64, 8, 2)  # heads over 128 wide (Qwen3-Next's 256)


def prefill_attention_triton(
    q: torch.Tensor, k_cells: torch.Tensor, v_cells: torch.Tensor, positions: torch.Tensor, scale: float,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`attention` (rows of one sequence over its cells [L, Hkv, D]) flash-attention style.
    Returns [T, H, D] in q's dtype. `tiles`: (rows per block, cells per step, warps, stages), if not
    `prefill_tiles(D)`; a row's result depends on them."""
    t, h, d = q.shape
    hkv = k_cells.shape[1]
    assert k_cells.shape == v_cells.shape and k_cells.shape[2] == d and h % hkv == 0, (q.shape, k_cells.shape)
    assert q.dtype == k_cells.dtype == v_cells.dtype, (q.dtype, k_cells.dtype, v_cells.dtype)
    out = torch.empty_like(q)  # [T, H, D]
    if t == 0:
        return out
    block_m, block_n, warps, stages = tiles or prefill_tiles(d)
    _prefill_kernel[(triton.cdiv(t, block_m), h)](
        q, k_cells, v_cells, positions, out,
        scale * LOG2E, t,
        *q.stride(), *k_cells.stride(), *v_cells.stride(), *out.stride(),
        G=h // hkv, D=d, BLOCK_M=block_m, BLOCK_D=_block_d(d), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages,
    )
    return out
