"""Per-row token sampling for a window of rows that may belong to different sequences.

A row's token depends only on its logits, its settings, its seed and its position, never on the
other rows of the window: every step below works along the vocabulary of one row, and the random
number comes from a counter-based generator keyed by (seed, position) instead of a shared stream.
So a conversation samples the same tokens alone or batched, and a replay from the same position
gives the same token. Nothing here reads a tensor back to the host.

`logit_bias` adds each row's own (token, bias) pairs to its logits before anything else (OpenAI's field: -100 bans
a token in practice, +100 all but forces it); one scatter for the window's pairs, rows without any untouched.

Penalties take two dense per-row tensors that the caller keeps beside its sequences (a decode step
adds one count with a scatter; `token_counts` builds them from id lists):
  seen_prompt       bool [R, V]  the token occurs in the prompt (repetition penalty only)
  generated_counts  int  [R, V]  how often the token occurs in the output so far (all three)
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from strata.errors import StrataError
from strata.runtime.window import row_tensor

_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax; ties -> lowest id)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0  # on prompt + output tokens: divide a positive logit, multiply a negative
    presence_penalty: float = 0.0  # on output tokens: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # on output tokens: logit -= frequency * count
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logit first; ids ascending, once
    min_tokens: int = 0  # the answer's stop tokens are not drawn before this many tokens (the slots ban them)

    def validate(self) -> None:
        """Raise StrataError naming the first bad field. Call once, when a request is admitted."""
        checks = (
            ("temperature", self.temperature, 0 <= self.temperature < math.inf, "must be finite and >= 0 (0 = greedy)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0,
             "must be an int >= 0 (0, or the vocabulary's size or more: off)"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed, isinstance(self.seed, int) and 0 <= self.seed < 2**63, "must be an int in [0, 2**63)"),
            ("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty < math.inf,
             "must be finite and > 0 (1 = off)"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("min_tokens", self.min_tokens, isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             "must be an int >= 0"),
        )
        for name, value, ok, rule in checks:
            # `ok` is False for NaN, since every comparison with NaN is.
            if not ok:
                raise StrataError(f"sampling setting {name}={value!r} is invalid: it {rule}")
        ids = [t for t, _ in self.logit_bias]
        if any(not isinstance(t, int) or t < 0 for t in ids) or ids != sorted(set(ids)):
            raise StrataError(f"sampling setting logit_bias: token ids {ids[:8]} must be ints >= 0, each once, ascending")
        bad = next((b for _, b in self.logit_bias if not -100 <= b <= 100), None)
        if bad is not None:
            raise StrataError(f"sampling setting logit_bias: bias {bad!r} is invalid: it must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of a * b for a 32-bit constant a and 32-bit words b, without int64 overflow."""
    p_lo = a * (b & 0xFFFF)  # < 2**48
    p_hi = a * (b >> 16)  # < 2**48
    low_sum = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2**49
    return (p_hi >> 16) + (low_sum >> 32), low_sum & _M32


def philox4x32(counter: Tensor, key: Tensor, rounds: int = 10) -> Tensor:
    """Philox4x32-R (Salmon et al. 2011, Random123). counter int64 [..., 4], key int64 [..., 2], each
    word in [0, 2**32). Returns the four output words, int64 [..., 4]."""
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def philox_uniform(seed: Tensor, counter: Tensor) -> Tensor:
    """seed, counter: int64 [R]; returns float32 [R] uniform in [0, 1).

    Philox4x32-10 with key = (seed low word, seed high word) and counter = (counter low word,
    counter high word, 0, 0); the top 24 bits of output word 0 become the float, exactly."""
    key = torch.stack((seed & _M32, (seed >> 32) & _M32), dim=-1)
    zero = torch.zeros_like(counter)
    ctr = torch.stack((counter & _M32, (counter >> 32) & _M32, zero, zero), dim=-1)
    word = philox4x32(ctr, key)[..., 0]
    return (word >> 8).to(torch.float32) * 2.0**-24


def token_counts(ids: Tensor, vocab_size: int) -> Tensor:
    """ids int64 [R, L], padded with -1 -> int32 [R, V]: how often each token occurs in each row."""
    num_rows = ids.shape[0]
    slots = torch.where(ids < 0, vocab_size, ids)  # padding lands in a spare column, dropped below
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """logits [R, V] with each row's `logit_bias` pairs added (in the logits' dtype, one scatter for the window; a
    copy, since the input may be the forward's); the input itself when no row has any. Other rows keep their bits."""
    pairs = [(j, t, b) for j, p in enumerate(params) for t, b in p.logit_bias]
    if not pairs:
        return logits
    rows = row_tensor([[j, t] for j, t, _ in pairs], torch.int64, logits.device)
    bias = row_tensor([b for _, _, b in pairs], logits.dtype, logits.device)
    return logits.index_put((rows[:, 0], rows[:, 1]), bias, accumulate=True)


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    seen_prompt: Tensor | None = None,
    generated_counts: Tensor | None = None,
) -> Tensor:
    """logits [R, V]; seen_prompt bool [R, V] or None; generated_counts int [R, V] or None.

    Returns new logits (same dtype) with, per row, the repetition penalty applied to every token seen
    in prompt or output, then presence and frequency subtracted for output tokens. Rows whose three
    penalties are neutral keep their logits bitwise; with no such row the input itself is returned."""
    if not any(p.has_penalties for p in params):
        return logits
    device, dtype = logits.device, logits.dtype
    rep = row_tensor([p.repetition_penalty for p in params], dtype, device)[:, None]
    presence = row_tensor([p.presence_penalty for p in params], dtype, device)[:, None]
    frequency = row_tensor([p.frequency_penalty for p in params], dtype, device)[:, None]
    active = row_tensor([p.has_penalties for p in params], torch.bool, device)[:, None]

    counts = generated_counts if generated_counts is not None else torch.zeros_like(logits, dtype=torch.int32)
    in_output = counts > 0
    seen = in_output | seen_prompt if seen_prompt is not None else in_output
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    out = out - frequency * counts.to(dtype) - presence * in_output.to(dtype)
    return torch.where(active, out, logits)


def pick_reference(probs: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, u: Tensor) -> Tensor:
    """probs float32 [R, V] (or any positive multiple of each row), each row sorted in descending order; top_k
    int64 [R] (V for off); top_p, min_p, u float32 [R]. Returns each row's picked rank, int64 [R]: of the ranks the
    filters keep, the first whose running sum exceeds u times the kept mass. On a GPU
    `strata.kernels.sampling.pick_triton` does this: torch.cumsum over one long row does not add in a fixed order
    there, and the pick must not change from run to run."""
    vocab_size = probs.shape[-1]
    # Each filter keeps a prefix of the sorted order, and every one keeps the first token.
    rank = torch.arange(vocab_size, device=probs.device)
    keep = rank[None, :] < top_k[:, None]
    probs = probs.masked_fill(~keep, 0.0)
    cum = probs.cumsum(dim=-1)
    keep &= (cum - probs) < top_p[:, None] * cum[:, -1:]  # mass before the token is short of top_p
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = probs.masked_fill(~keep, 0.0)
    cum = probs.cumsum(dim=-1)  # [R, V]
    target = (u * cum[:, -1])[:, None]
    pick = torch.searchsorted(cum, target, right=True)  # first rank whose cumulative mass exceeds u
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1)  # rounding at the top end
    return pick.clamp(min=0).squeeze(-1)  # NaN logits keep nothing: rank 0 rather than an index out of range


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    positions: Tensor | Sequence[int],
    seen_prompt: Tensor | None = None,
    generated_counts: Tensor | None = None,
) -> Tensor:
    """logits [R, V] float; params one per row (already validated); positions int64 [R] (or the ints, made a
    tensor only when some row samples), the position the sampled token will take. Penalty inputs as in `apply_penalties`.
    Each row's `logit_bias` is added first, then the penalties.

    Returns token ids int64 [R]. Greedy rows: argmax. Sampled rows: each token weighs exp((logit - the row's
    largest) / temperature) in float32 (the softmax unnormalised: every rule below is a ratio), keep the top_k,
    then the smallest prefix of the sorted weights whose mass reaches top_p (of what top_k kept), then the tokens
    weighing >= min_p times the largest; pick by inverse CDF over what is kept with u = philox_uniform(seed,
    position). Ties in the sort go to the lowest id."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"sample: {len(params)} params for {logits.shape[0]} rows")
    logits = apply_penalties(apply_logit_bias(logits, params), params, seen_prompt, generated_counts)
    if all(p.is_greedy for p in params):
        return logits.argmax(dim=-1)

    device = logits.device
    vocab_size = logits.shape[-1]
    # the rows' settings in two host-to-device copies: (temperature, top_p, min_p) and (greedy, top_k, seed)
    floats = row_tensor([[p.temperature if p.temperature > 0 else 1.0, p.top_p, p.min_p] for p in params],
                        torch.float32, device)
    ints = row_tensor([[p.is_greedy, min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size, p.seed] for p in params],
                      torch.int64, device)
    temperature, top_p, min_p = floats.unbind(-1)
    greedy, top_k, seed = ints[:, 0].bool(), ints[:, 1], ints[:, 2]
    if not isinstance(positions, Tensor):
        positions = row_tensor(list(positions), torch.int64, device)
    positions = positions.to(torch.int64)

    # Sorted by logit (the order of logit / T for any T > 0), then each token's weight exp((x - x_max) / T): the
    # softmax without its normalisation, which no filter and not the pick needs (each is a ratio of weights).
    # Subtracting the largest logit first keeps a tiny T from overflowing.
    x_sorted, order = logits.float().sort(dim=-1, descending=True, stable=True)  # [R, V]
    weights = ((x_sorted - x_sorted[:, :1]) / temperature[:, None]).exp_()  # [R, V], descending, the first 1

    if weights.is_cuda:  # fixed-order sums and the uniform number in one launch
        from strata.kernels.sampling import pick_triton  # imports triton: only where a GPU samples

        pick = pick_triton(weights, top_k, top_p, min_p, seed, positions)
    else:
        pick = pick_reference(weights, top_k, top_p, min_p, philox_uniform(seed, positions))  # [R]
    sampled_ids = order.gather(-1, pick[:, None]).squeeze(-1)
    if not any(p.is_greedy for p in params):
        return sampled_ids
    return torch.where(greedy, logits.argmax(dim=-1), sampled_ids)
