"""`--spec METHOD:K`: which drafter proposes tokens, and how many per window."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import StrataError

METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names: `method` ("ngram": prompt lookup in the sequence's own text), `num_speculative_tokens` (drafts
    per slot and window, at most), `prompt_lookup_max` / `prompt_lookup_min` (the longest and shortest run of last
    tokens looked up)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2  # a lone repeated token is weak evidence: most such drafts are rejected

    def __str__(self) -> str:
        return f"{self.method}:{self.num_speculative_tokens}"


def parse_spec(value: str | None) -> SpeculativeConfig | None:
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
    if method == "mtp":
        raise StrataError(f"drafts from the checkpoint's MTP layer are not implemented yet; "
                          f"use ngram:{k}")
    return SpeculativeConfig(method, k)
