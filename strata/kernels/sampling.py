"""The sampler's running sums on the GPU: which of a row's sorted probabilities the filters keep (top-k, top-p,
min-p) and which kept one the row's uniform number picks — the part of `strata.runtime.sampling.sample` that adds
up the vocabulary (`pick_reference` there is the torch version, used on the CPU). The uniform number is drawn in
the same program (`philox_uniform`, the counter-based generator `strata.runtime.sampling.philox_uniform` computes
with torch ops: about a hundred small launches there, none here).

torch.cumsum over one long row runs on the GPU as a scan whose float additions have no fixed order: two calls on
the same 151,936 probabilities differed by up to 1e-7 relative on the H200, and a uniform number that fell that
close to a boundary between two tokens picked one or the other from one run to the next (seen with seeded
requests). Here one program sums one row in a fixed order: its total lane by lane, then its running sums block
after block (each block scanned on its own, then the carry added) until the kept prefix ends, and once more the
one block where they pass the row's target — so the same probabilities always give the same pick, whatever
other rows share the call. Every rule is a ratio of the row's values, so `sample` gives it the softmax's
numerators exp((x - x_max) / T) and no softmax runs at all.

On the H200 (`bench/kernels_check.py`, tenth session): a pick over 151,936 probabilities takes 48 us at top-p 0.9
and 70 us when every rank is kept (59 and 117 when the kept blocks were scanned twice); a `sample` call of one
row spends 102 us of GPU time on random logits (the sort 42 of it) and 76 on logits eight times as peaked,
against 177 and 129 with the softmax and the two scans.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # probabilities per step of a row's program
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
def _pick_kernel(p_probs, p_top_k, p_top_p, p_min_p, p_seed, p_pos, p_pick, V, s_r, s_k, s_p, s_mp, s_seed, s_pos,
                 BLOCK: tl.constexpr, MAX_BLOCKS: tl.constexpr):
    """One row: probs sorted in descending order (or any positive multiple of them: every rule below is a ratio).
    Kept: rank < top_k, mass before the token < top_p of what top_k keeps, and p >= min_p * the largest p (each
    keeps a prefix). Picked: the first kept rank whose running sum exceeds u = philox_uniform(seed, position) times
    the kept mass (the last kept rank if rounding leaves none). The kept prefix ends where the mass before a block
    reaches the top-p limit; the running sums are made once, block after block, and only the block where they
    pass the target is scanned again (from the same carry: the same sums). Counts and maxima gather lane by lane
    across the blocks and are reduced once at the end (integers and maxima: in any order alike)."""
    r = tl.program_id(0)
    row = p_probs + r.to(tl.int64) * s_r
    n = tl.minimum(tl.load(p_top_k + r * s_k), V)
    top_p = tl.load(p_top_p + r * s_p)
    floor = tl.load(p_min_p + r * s_mp) * tl.load(row)
    o_b = tl.arange(0, BLOCK)
    o_j = tl.arange(0, MAX_BLOCKS)
    lanes = tl.zeros([BLOCK], dtype=tl.float32)  # what top_k keeps, lane by lane
    for b0 in range(0, n, BLOCK):
        lanes += tl.load(row + b0 + o_b, mask=b0 + o_b < n, other=0.0)
    limit = top_p * tl.sum(lanes, 0)
    carry = 0.0
    count = tl.zeros([BLOCK], dtype=tl.int32)  # kept ranks (a prefix), lane by lane
    kept = tl.zeros([BLOCK], dtype=tl.float32)  # the largest running sum of a kept rank: the kept mass
    ends = tl.full([MAX_BLOCKS], float("inf"), tl.float32)  # the running sum after each block scanned
    b0 = 0
    while (b0 < n) & (carry < limit):  # past that point no rank is kept
        b, c, carry = _running_sum(row, b0 + o_b, n, carry)
        ok = (b0 + o_b < n) & (c - b < limit) & (b >= floor)
        count += ok.to(tl.int32)
        kept = tl.maximum(kept, tl.where(ok, c, 0.0))
        ends = tl.where(o_j == b0 // BLOCK, carry, ends)
        b0 += BLOCK
    n_kept = tl.sum(count, 0)
    target = philox_uniform(tl.load(p_seed + r * s_seed), tl.load(p_pos + r * s_pos)) * tl.max(kept, 0)
    # Running sums never fall, so every rank of the blocks that end at or below the target is at or below it, and
    # every rank after the first block that ends above it is above it: only that block is counted rank by rank.
    j = tl.sum((ends <= target).to(tl.int32), 0)
    b, c, _ = _running_sum(row, j * BLOCK + o_b, n, tl.max(tl.where(o_j < j, ends, 0.0), 0))
    ok = (j * BLOCK + o_b < n) & (c - b < limit) & (b >= floor)
    below = j * BLOCK + tl.sum((ok & (c <= target)).to(tl.int32), 0)  # kept ranks whose running sum is <= target
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
        per_row = (top_k, top_p, min_p, seed, position)
        _pick_kernel[(R,)](probs, *per_row, pick, V, probs.stride(0), *(t.stride(0) for t in per_row), BLOCK=BLOCK,
                           MAX_BLOCKS=triton.next_power_of_2(triton.cdiv(V, BLOCK)), num_warps=8)
    return pick
