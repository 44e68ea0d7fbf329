"""Reading the engine's event lines in tests: the tokens a request got, how it ended."""

from __future__ import annotations


def tokens(lines: list[str], rid: str) -> list[int]:
    """The tokens of request `rid` in TOK lines (pairs of request id and token), in order."""
    out = []
    for line in lines:
        words = line.split()
        if words and words[0] == "TOK":
            out += [int(words[k + 1]) for k in range(1, len(words) - 1, 2) if words[k] == rid]
    return out


def end_of(lines: list[str], rid: str) -> list[str] | None:
    """The fields of request `rid`'s END line after its id (reason, prompt, generated, reused), None before it."""
    return next((line.split()[2:] for line in lines if line.startswith(f"END {rid} ")), None)


def add(rid: str, max_new: int, ids: list[int], keys: str = "ignore_eos=1") -> str:
    return f"ADD {rid} {max_new} {keys} " + " ".join(map(str, ids))
