"""The engine's line protocol: one command or event per line, space-separated. See docs/PROTOCOL.md.

Pure parsing and formatting; nothing here touches the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from strata.runtime.sampling import SamplingParams

_FLOAT_KEYS = {f.name for f in fields(SamplingParams) if f.type in ("float", float)}
_INT_KEYS = {f.name for f in fields(SamplingParams) if f.type in ("int", int)}


class ProtocolError(ValueError):
    """A command line that cannot be understood; the engine answers `ERR <reason>` and carries on."""


@dataclass(frozen=True)
class Request:
    """What GEN and BGEN carry: how many tokens, how to sample, when to stop, and the prompt."""

    max_new: int
    params: SamplingParams
    stop_ids: frozenset[int]
    ignore_eos: bool
    ids: list[int]
    resume: int = 0  # the last `resume` ids were generated earlier by this request (BGEN moving a solo run into a slot)


@dataclass(frozen=True)
class Gen:
    request: Request


@dataclass(frozen=True)
class BGen:
    slot: int
    request: Request


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class BStop:
    slot: int


@dataclass(frozen=True)
class Quit:
    pass


Command = Gen | BGen | Stop | BStop | Quit


def _int(word: str, what: str) -> int:
    try:
        return int(word)
    except ValueError:
        raise ProtocolError(f"{what} {word!r} is not an integer") from None


def _request(words: list[str], verb: str) -> Request:
    if not words:
        raise ProtocolError(f"{verb} needs <max_new> [key=value ...] <ids>")
    max_new = _int(words[0], "max_new")
    if max_new < 0:
        raise ProtocolError(f"max_new {max_new} is negative")
    sampling: dict = {}
    stop_ids: set[int] = set()
    ignore_eos = False
    resume = 0
    ids: list[int] = []
    for word in words[1:]:
        if "=" not in word:
            ids.append(_int(word, "token id"))
            continue
        if ids:
            raise ProtocolError(f"key {word!r} after the token ids; keys come first")
        key, value = word.split("=", 1)
        if key not in _FLOAT_KEYS | _INT_KEYS | {"stop", "ignore_eos", "resume"}:
            raise ProtocolError(f"unknown key {key!r}")
        try:
            if key in _FLOAT_KEYS:
                sampling[key] = float(value)
            elif key in _INT_KEYS:
                sampling[key] = int(value)
            elif key == "stop":
                stop_ids |= {int(v) for v in value.split(",") if v}
            elif key == "resume":
                resume = int(value)
            else:
                ignore_eos = value not in ("0", "false", "")
        except ValueError:
            raise ProtocolError(f"key {key}={value!r}: not a number") from None
    if not ids:
        raise ProtocolError(f"{verb} has no prompt token ids")
    return Request(max_new, SamplingParams(**sampling), frozenset(stop_ids), ignore_eos, ids, resume)


def parse_command(line: str) -> Command:
    words = line.split()
    if not words:
        raise ProtocolError("empty line")
    verb, rest = words[0], words[1:]
    if verb == "GEN":
        return Gen(_request(rest, verb))
    if verb == "BGEN":
        if not rest:
            raise ProtocolError("BGEN needs <slot> <max_new> [key=value ...] <ids>")
        return BGen(_int(rest[0], "slot"), _request(rest[1:], verb))
    if verb == "STOP" and not rest:
        return Stop()
    if verb == "BSTOP" and len(rest) == 1:
        return BStop(_int(rest[0], "slot"))
    if verb == "QUIT" and not rest:
        return Quit()
    if verb in ("STOP", "BSTOP", "QUIT"):
        raise ProtocolError(f"{verb}: wrong number of arguments")
    raise ProtocolError(f"unknown command {verb!r} (known: GEN, STOP, BGEN, BSTOP, QUIT)")


def format_request(request: Request) -> str:
    """The keys and ids of a GEN / BGEN line (the inverse of parsing), for clients."""
    defaults = SamplingParams()
    keys = [f"{f.name}={getattr(request.params, f.name)}" for f in fields(SamplingParams)
            if getattr(request.params, f.name) != getattr(defaults, f.name)]
    if request.stop_ids:
        keys.append("stop=" + ",".join(str(i) for i in sorted(request.stop_ids)))
    if request.ignore_eos:
        keys.append("ignore_eos=1")
    if request.resume:
        keys.append(f"resume={request.resume}")
    return " ".join([str(request.max_new), *keys, *map(str, request.ids)])


# events


def ready(facts: dict) -> str:
    return "READY " + json.dumps(facts, separators=(",", ":"))


def token(token_id: int) -> str:
    return f"T {token_id}"


def done(reason: str, num_prompt: int, num_generated: int, num_reused: int = 0) -> str:
    """`num_reused`: prompt tokens taken from a held or parked state instead of being read."""
    return f"DONE {reason} {num_prompt} {num_generated} {num_reused}"


def badm(slot: int, admitted: bool, num_reused: int = 0) -> str:
    """An admission (with the prompt tokens it took from a held or parked state), or a refusal."""
    return f"BADM {slot} 1 {num_reused}" if admitted else f"BADM {slot} 0"


def btoken(slot: int, token_id: int) -> str:
    return f"BT {slot} {token_id}"


def bdone(slot: int, reason: str, num_prompt: int, num_generated: int) -> str:
    return f"BDONE {slot} {reason} {num_prompt} {num_generated}"


def parked(conversations: int, num_bytes: int) -> str:
    return f"PARKED {conversations} {num_bytes}"


def experts(on_device: int, on_cpu: int) -> str:
    return f"EXPERTS {on_device} {on_cpu}"


def err(reason: str) -> str:
    return "ERR " + " ".join(reason.split())  # one line, whatever the message held
