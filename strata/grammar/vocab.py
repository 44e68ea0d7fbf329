"""A tokenizer as the grammar library sees it, built once per tokenizer (about 0.3 s at 49K tokens, 1.2 s at 150K)."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance

from strata.errors import StrataError
from strata.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class GrammarVocab:
    """`size`: the tokenizer's tokens; `width`: the model's logits columns, which can be more (a head padded to a
    multiple of 64 or 128): the bitmask covers them all and the library never allows one past `size`, so a
    constrained row cannot sample a padded column. `words`: int32 words of a bitmask row, ceil(max(size, width) / 32).
    `stop_ids`: the tokens that end an answer; the grammar allows them exactly where it may end."""

    lltokenizer: llguidance.LLTokenizer
    size: int
    width: int
    stop_ids: tuple[int, ...]

    @property
    def words(self) -> int:
        return (max(self.size, self.width) + 31) // 32

    @classmethod
    def build(cls, tokenizer: Tokenizer, width: int | None = None) -> "GrammarVocab":
        """From Strata's tokenizer (its tokenizer.json, so special tokens stay special: never allowed as text
        inside a string) and the model's logits width (the tokenizer's size when None)."""
        size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        width = size if width is None else width
        stop_ids = tuple(sorted(tokenizer.stop_ids))
        try:
            # n_vocab below the tokenizer's size is refused by llguidance; tokens past a narrower head are then in
            # the bitmask but never in the logits (apply_bitmask reads only `width` columns)
            lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=max(size, width),
                                           eos_token=list(stop_ids) or None)
        except Exception as e:  # the library raises plain exceptions for tokenizers it cannot read
            raise StrataError(f"structured output is not available for this tokenizer: {e}") from None
        return cls(lltok, size, width, stop_ids)
