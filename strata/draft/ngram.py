"""Prompt lookup: draft the tokens that followed the last time the sequence's final tokens appeared in it.

Text that quotes, edits or repeats what came before (code, a document being rewritten, a list being copied)
continues as it did earlier; there the model mostly agrees with the lookup and a window verifies several tokens
for the weight reads of one. Elsewhere the lookup finds nothing or is rejected, and the window costs a little more
than a decode row.
"""

from __future__ import annotations


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
