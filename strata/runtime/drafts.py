"""Drafts: tokens proposed ahead of the model and verified by it in one window (speculative decoding).

`parse_spec` reads `--spec METHOD:K` into a `SpeculativeConfig` (vLLM's names: `method`, `num_speculative_tokens`,
`prompt_lookup_max` / `_min`); `propose` is the n-gram drafter (prompt lookup): the continuation of the latest earlier
match of a sequence's last tokens in its own text. Text that quotes, edits or repeats what came before continues
as it did earlier; there the model mostly agrees with the lookup and a window verifies several tokens for the
weight reads of one. The slots (`strata.runtime.slots`) put a drafting slot's last token and its drafts in a
window as decode rows, one row each, and keep the longest prefix the model agrees with (docs/BATCHING.md, drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import StrataError

METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 8
# by device type, measured (docs/PERFORMANCE.md, bench/spec.py): on the CPU n-gram drafts gained 1.15-1.24x at 4
# and 8 streams on a repeated text (MTP drafts there keep to the free rows of a block: `within_row_block`); on an
# H200 a window of 1 + k rows a slot still pays at 8 slots, while at 32 a Qwen3-Next shape's breaks even only at an
# acceptance of 0.5 or more
DEFAULT_SPEC_MAX_ACTIVE = {"cpu": 4, "cuda": 16}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names: `method` ("ngram": prompt lookup in the sequence's own text), `num_speculative_tokens` (drafts
    per slot and window, at most), `prompt_lookup_max` / `prompt_lookup_min` (the longest and shortest run of last
    tokens looked up)."""

    method: str  # "ngram" or "mtp" (the checkpoint's multi-token-prediction layer, chained)
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2  # a lone repeated token is weak evidence: most such drafts are rejected
    adaptive: bool = True  # draft one more token than the slot's drafts had accepted last time (False: always K)
    max_active: int = DEFAULT_SPEC_MAX_ACTIVE["cpu"]  # no slot drafts while more slots than this are active (`--spec-max-active`)
    # on the CPU, drafts take only the rows the decoding slots leave free in their last block of rows: a decode
    # window's products run in zero-padded blocks (`strata.kernels.invariant.row_block`), so those rows cost the
    # products nothing, while a row more starts a block of its own. None: by method: MTP drafts (proposed in every
    # window, each costing the MTP layer) keep to the free rows, n-gram drafts (proposed only where the text
    # repeats) do not. Measured with a block of 4, drafting everywhere: MTP 0.64-0.87x at 4 and 8 slots, n-gram
    # 1.15-1.24x on a repeated text and 0.99-1.00x on a question (docs/PERFORMANCE.md, Drafts)
    within_row_block: bool | None = None

    @property
    def keeps_to_free_rows(self) -> bool:
        return self.method == "mtp" if self.within_row_block is None else self.within_row_block

    def __str__(self) -> str:
        return f"{self.method}:{self.num_speculative_tokens}"


def parse_spec(value: str | None, max_active: int = DEFAULT_SPEC_MAX_ACTIVE["cpu"]) -> SpeculativeConfig | None:
    """`ngram:K` -> SpeculativeConfig; None or "" or "off" -> None; anything else a StrataError saying what is wrong
    (the caller names the flag and the value)."""
    if value is None or value.strip().lower() in ("", "off", "none"):
        return None
    method, _, count = value.strip().partition(":")
    method = method.lower()
    if method not in METHODS:
        raise StrataError(f"unknown method {method!r}; give ngram:K or mtp:K (K drafts per window)")
    try:
        k = int(count)
    except ValueError:
        raise StrataError(f"K must be a whole number of drafted tokens, as in {method}:3") from None
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise StrataError(f"K must be between 1 and {MAX_SPECULATIVE_TOKENS}")
    return SpeculativeConfig(method, k, max_active=max_active)



def propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to `k` tokens continuing `tokens`: for n from `max_n` down to `min_n`, the latest earlier place where
    the last n tokens occur, and what followed it there. [] when no run of them occurred before."""
    size = len(tokens)
    if k < 1 or size < 2:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = tokens[size - n :]
        first = tail[0]
        # the latest start s < size - n with tokens[s : s + n] == tail and something after it
        s = size - n - 1
        while s >= 0:
            try:
                s = _rindex(tokens, first, s)
            except ValueError:
                break
            if tokens[s : s + n] == tail:
                return tokens[s + n : s + n + k]
            s -= 1
    return []


def _rindex(tokens: list[int], value: int, stop: int) -> int:
    """The largest index <= stop holding value (ValueError when none)."""
    for i in range(stop, -1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
