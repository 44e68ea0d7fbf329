"""The sampler's running sums on the GPU: which of a row's sorted probabilities the filters keep (top-k, top-p,
min-p) and which kept one the row's uniform number picks — the part of `strata.runtime.sampling.sample` that adds
up the vocabulary (`pick_reference` there is the torch version, used on the CPU). The uniform number is drawn in
the same program (`philox_uniform`, the counter-based generator `strata.runtime.sampling.philox_uniform` computes
with torch ops: about a hundred small launches there, none here).

torch.cumsum over one long row runs on the GPU as a scan whose float additions have no fixed order: two calls on
the same 151,936 probabilities differed by up to 1e-7 relative on the H200, and a uniform number that fell that
close to a boundary between two tokens picked one or the other from one run to the next (seen with seeded
requests). Here the sums have a fixed order: each 4,096-rank block's total (`_block_sums_kernel`, one program a
block, the block scanned on its own), then one program a row that adds the totals by a scan, decides whole blocks
from them and scans rank by rank only the blocks where the top-p limit, the last kept rank and the row's target
fall (each from its carry: the same sums whichever scan reads them) — so the same probabilities always give the
same pick, whatever other rows share the call. Every rule is a ratio of the row's values, so `sample` gives it
the softmax's numerators exp((x - x_max) / T) and no softmax runs at all.

On the H200 (twelfth session: GPU time of 20 calls replayed as a CUDA graph; the A/B in docs/perf-log.md): a
pick over 151,936 probabilities takes 8.2 us at top-p 0.9 and 8.4 us when every rank is kept (one program a row
walking the blocks in turn: 15.7 and 67.2 us); at 64 rows 24.2 and 24.6 (16.7 and 68.0). Sampled decode of the
30B shape: +1.3 % tok/s at 1 row, +0.5 % at 8. The sort before the pick takes about 42 us a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # probabilities a block (one program of `_block_sums_kernel`, one step of a row's scans)
M32 = tl.constexpr(0xFFFFFFFF)  # a global a jit function reads must be a constexpr


@triton.jit
def _mulhilo(a, b):
    """High and low 32 bits of a * b, for 32-bit words held in uint64."""
    p = b * a
    return p >> 32, p & M32


@triton.jit
def philox_uniform(seed, counter):
    """Philox4x32-10 keyed by the int64 seed's two words on the counter (its two words, 0, 0): the top 24 bits of
    output word 0 as a float32 in [0, 1), bit for bit what `strata.runtime.sampling.philox_uniform` gives."""
    k0 = seed.to(tl.uint64) & M32
    k1 = (seed.to(tl.uint64) >> 32) & M32
    c0 = counter.to(tl.uint64) & M32
    c1 = (counter.to(tl.uint64) >> 32) & M32
    c2 = c0 * 0
    c3 = c0 * 0
    for r in tl.static_range(10):
        if r > 0:
            k0 = (k0 + 0x9E3779B9) & M32
            k1 = (k1 + 0xBB67AE85) & M32
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0 >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _uniform_kernel(p_seed, p_counter, p_u, R, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < R
    tl.store(p_u + o, philox_uniform(tl.load(p_seed + o, mask=m, other=0), tl.load(p_counter + o, mask=m, other=0)),
             mask=m)


def uniform_triton(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """seed, counter int64 [R] -> float32 [R]: `philox_uniform` on the device (for checks against the torch one)."""
    u = torch.empty(seed.shape[0], dtype=torch.float32, device=seed.device)
    if seed.shape[0]:
        _uniform_kernel[(triton.cdiv(seed.shape[0], 128),)](seed, counter, u, seed.shape[0], BLOCK=128)
    return u


@triton.jit
def _running_sum(row, o, n, carry):
    """Block `o` of a row's probabilities (0 past n), their running sums after `carry`, and the carry after them.
    Only the carry links one block to the next; the block's own scan does not wait for it."""
    b = tl.load(row + o, mask=o < n, other=0.0)
    local = tl.cumsum(b, 0)
    return b, local + carry, carry + tl.max(local, 0)  # probabilities are >= 0: the largest sum is the last


@triton.jit
def _block_sums_kernel(p_probs, p_top_k, p_min_p, p_sums, p_counts, V, s_r, s_k, s_mp, s_sr,
                       BLOCK: tl.constexpr):
    """Program (row, block): the block's total (the last of its running sums, as `_running_sum` makes them) and
    how many of its ranks top_k and min-p keep. Ranks past top_k weigh 0 here."""
    r = tl.program_id(0)
    i_b = tl.program_id(1)
    row = p_probs + r.to(tl.int64) * s_r
    n = tl.minimum(tl.load(p_top_k + r * s_k), V)
    floor = tl.load(p_min_p + r * s_mp) * tl.load(row)
    o = i_b * BLOCK + tl.arange(0, BLOCK)
    b, _, total = _running_sum(row, o, n, 0.0)
    tl.store(p_sums + r * s_sr + i_b, total)
    tl.store(p_counts + r * s_sr + i_b, tl.sum(((o < n) & (b >= floor)).to(tl.int32), 0))


@triton.jit
def _pick_kernel(p_probs, p_sums, p_counts, p_top_k, p_top_p, p_min_p, p_seed, p_pos, p_pick, V, NB, s_r, s_sr,
                 s_k, s_p, s_mp, s_seed, s_pos, BLOCK: tl.constexpr, MAX_BLOCKS: tl.constexpr):
    """One row: probs sorted in descending order (or any positive multiple of them: every rule below is a ratio).
    Kept: rank < top_k, mass before the token < top_p of what top_k keeps, and p >= min_p * the largest p (each
    keeps a prefix, so the kept count is the least of the three). Picked: the first kept rank whose running sum
    exceeds u = philox_uniform(seed, position) times the kept mass (the last kept rank if rounding leaves none).

    A rank's running sum is its block's carry (the blocks' totals before it, `_block_sums_kernel`, added by one
    scan) plus its running sum within the block. Whole blocks are decided from their totals; only the block where
    the top-p limit is passed, the block of the last kept rank and the block where the running sums pass the
    target are scanned rank by rank (each from its carry: the same sums whichever scan reads them)."""
    r = tl.program_id(0)
    row = p_probs + r.to(tl.int64) * s_r
    n = tl.minimum(tl.load(p_top_k + r * s_k), V)
    top_p = tl.load(p_top_p + r * s_p)
    floor = tl.load(p_min_p + r * s_mp) * tl.load(row)
    o_b = tl.arange(0, BLOCK)
    o_j = tl.arange(0, MAX_BLOCKS)
    m_j = o_j < NB
    sums = tl.load(p_sums + r * s_sr + o_j, mask=m_j, other=0.0)  # [MAX_BLOCKS] each block's total
    ends = tl.cumsum(sums, 0)  # the running sum after each block
    carries = ends - sums
    limit = top_p * tl.max(ends, 0)
    n_floor = tl.sum(tl.load(p_counts + r * s_sr + o_j, mask=m_j, other=0), 0)
    # top-p: blocks ending below the limit are kept whole; the next one is counted rank by rank
    j_p = tl.sum((m_j & (ends < limit)).to(tl.int32), 0)
    b, c, _ = _running_sum(row, j_p * BLOCK + o_b, n, tl.sum(tl.where(o_j == j_p, carries, 0.0), 0))
    n_top_p = j_p * BLOCK + tl.sum(((j_p * BLOCK + o_b < n) & (c - b < limit)).to(tl.int32), 0)
    n_kept = tl.minimum(tl.minimum(n, n_floor), n_top_p)
    # the kept mass: the running sum of the last kept rank
    j_k = tl.maximum(n_kept - 1, 0) // BLOCK
    _, c, _ = _running_sum(row, j_k * BLOCK + o_b, n, tl.sum(tl.where(o_j == j_k, carries, 0.0), 0))
    kept = tl.max(tl.where(j_k * BLOCK + o_b < n_kept, c, 0.0), 0)
    target = philox_uniform(tl.load(p_seed + r * s_seed), tl.load(p_pos + r * s_pos)) * kept
    # Running sums never fall, so every rank of the blocks that end at or below the target is at or below it, and
    # every rank after the first block that ends above it is above it: only that block is counted rank by rank.
    j = tl.sum((m_j & (ends <= target)).to(tl.int32), 0)
    _, c, _ = _running_sum(row, j * BLOCK + o_b, n, tl.sum(tl.where(o_j == j, carries, 0.0), 0))
    below = j * BLOCK + tl.sum(((j * BLOCK + o_b < n_kept) & (c <= target)).to(tl.int32), 0)
    tl.store(p_pick + r, tl.maximum(tl.minimum(below, n_kept - 1), 0).to(tl.int64))  # 0: NaN logits


def pick_triton(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """probs float32 [R, V] (or any positive multiple of each row), each row sorted in descending order; top_k
    int64 [R] (V for off); top_p, min_p float32 [R]; seed, position int64 [R] (u = philox_uniform(seed, position)).
    Returns the picked rank of each row, int64 [R] (see `_pick_kernel`). The [R] tensors may be strided views
    (columns of one settings tensor)."""
    R, V = probs.shape
    assert probs.dtype == torch.float32 and probs.stride(1) == 1, "probs must be float32 with contiguous rows"
    pick = torch.empty(R, dtype=torch.int64, device=probs.device)
    if R:
        nb = triton.cdiv(V, BLOCK)
        max_blocks = triton.next_power_of_2(nb)
        sums = torch.empty(R, max_blocks, dtype=torch.float32, device=probs.device)  # [R, blocks]
        counts = torch.empty(R, max_blocks, dtype=torch.int32, device=probs.device)  # [R, blocks]
        _block_sums_kernel[(R, nb)](probs, top_k, min_p, sums, counts, V, probs.stride(0), top_k.stride(0),
                                    min_p.stride(0), sums.stride(0), BLOCK=BLOCK, num_warps=8)
        per_row = (top_k, top_p, min_p, seed, position)
        _pick_kernel[(R,)](probs, sums, counts, *per_row, pick, V, nb, probs.stride(0), sums.stride(0),
                           *(t.stride(0) for t in per_row), BLOCK=BLOCK, MAX_BLOCKS=max_blocks, num_warps=8)
    return pick
