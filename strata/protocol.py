"""The engine's line protocol: one command or event per line, space-separated. See docs/PROTOCOL.md.

Pure parsing and formatting; nothing here touches the model.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, fields

from strata.grammar.constraint import KINDS, Constraint

from strata.runtime.sampling import SamplingParams

_FLOAT_KEYS = {f.name for f in fields(SamplingParams) if f.type in ("float", float)}
_INT_KEYS = {f.name for f in fields(SamplingParams) if f.type in ("int", int)}


MAX_LOGPROBS = 20  # top log-probabilities a token may carry (OpenAI's limit)


class ProtocolError(ValueError):
    """A command line that cannot be understood; the engine answers `ERR <reason>` and carries on."""


@dataclass(frozen=True)
class Request:
    """What ADD carries: how many tokens, how to sample, when to stop, and the prompt."""

    max_new: int
    params: SamplingParams
    stop_ids: frozenset[int]
    ignore_eos: bool
    ids: list[int]
    logprobs: int | None = None  # log-probabilities to report with each token: None none, k >= 0 its own and k top
    grammar: Constraint | None = None  # the answer follows this constraint (structured output, forced tool calls)
    prompt_logprobs: int | None = None  # the prompt's own log-probabilities (PLP lines): None none, k >= 0 with k top


@dataclass(frozen=True)
class Add:
    id: str
    request: Request


@dataclass(frozen=True)
class Abort:
    id: str


@dataclass(frozen=True)
class Quit:
    pass


Command = Add | Abort | Quit

ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")
MAX_ID = 64


def request_id(word: str) -> str:
    """A request id as the protocol carries it: 1-64 letters, digits or `_.:-`."""
    if not 0 < len(word) <= MAX_ID or not set(word) <= ID_CHARS:
        raise ProtocolError(f"request id {word[:80]!r}: use 1 to {MAX_ID} letters, digits or _.:-")
    return word


def _int(word: str, what: str) -> int:
    try:
        return int(word)
    except ValueError:
        raise ProtocolError(f"{what} {word!r} is not an integer") from None


def _request(words: list[str]) -> Request:
    if not words:
        raise ProtocolError("ADD needs <id> <max_new> [key=value ...] <ids>")
    max_new = _int(words[0], "max_new")
    if max_new < 1:
        raise ProtocolError(f"max_new {max_new}: a request must generate at least one token")
    sampling: dict = {}
    stop_ids: set[int] = set()
    ignore_eos = False
    logprobs = prompt_logprobs = None
    grammar = None
    ids: list[int] = []
    for k, word in enumerate(words[1:], 1):
        if "=" not in word:
            try:  # the ids, all at once (a long prompt's words: a third of the time of one at a time)
                ids = list(map(int, words[k:]))
            except ValueError:
                ids = [_int(w, "token id") for w in words[k:] if "=" not in w]
                bad = next(w for w in words[k:] if "=" in w)
                raise ProtocolError(f"key {bad!r} after the token ids; keys come first") from None
            break
        key, value = word.split("=", 1)
        if key not in _FLOAT_KEYS | _INT_KEYS | {"stop", "ignore_eos", "logprobs", "grammar", "logit_bias",
                                                 "prompt_logprobs"}:
            raise ProtocolError(f"unknown key {key!r}")
        try:
            if key in _FLOAT_KEYS:
                sampling[key] = float(value)
            elif key in _INT_KEYS:
                sampling[key] = int(value)
            elif key == "stop":
                stop_ids |= {int(v) for v in value.split(",") if v}
            elif key == "grammar":
                grammar = decode_constraint(value)
            elif key == "logit_bias":
                sampling[key] = _logit_bias(value)
            elif key in ("logprobs", "prompt_logprobs"):
                k = int(value)
                if not 0 <= k <= MAX_LOGPROBS:
                    raise ProtocolError(f"{key}={k}: top log-probabilities are 0 to {MAX_LOGPROBS}")
                if key == "logprobs":
                    logprobs = k
                else:
                    prompt_logprobs = k
            else:
                ignore_eos = value not in ("0", "false", "")
        except ProtocolError:
            raise
        except ValueError:
            raise ProtocolError(f"key {key}={value!r}: not a number") from None
    if not ids:
        raise ProtocolError("ADD has no prompt token ids")
    return Request(max_new, SamplingParams(**sampling), frozenset(stop_ids), ignore_eos, ids, logprobs, grammar,
                   prompt_logprobs)


def _logit_bias(value: str) -> tuple[tuple[int, float], ...]:
    """`logit_bias=` token:bias pairs, comma-separated, as SamplingParams keeps them (ids ascending, each once)."""
    pairs: dict[int, float] = {}
    for item in value.split(","):
        token, sep, bias = item.partition(":")
        if not sep:
            raise ProtocolError(f"logit_bias={value[:80]!r}: write token:bias pairs, comma-separated")
        t = _int(token, "logit_bias token id")
        if t in pairs:
            raise ProtocolError(f"logit_bias: token id {t} is given twice")
        pairs[t] = float(bias)
    return tuple(sorted(pairs.items()))


def encode_constraint(constraint: Constraint) -> str:
    """A constraint as one word: base64url of the JSON list [kind, text]."""
    raw = json.dumps([constraint.kind, constraint.text], ensure_ascii=False).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_constraint(word: str) -> Constraint:
    try:
        kind, text = json.loads(base64.urlsafe_b64decode(word + "=" * (-len(word) % 4)))
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ProtocolError("grammar=: not base64url of a JSON list [kind, text]") from None
    if kind not in KINDS or not isinstance(text, str):
        raise ProtocolError(f"grammar=: kind {kind!r} is not one of {', '.join(KINDS)}")
    return Constraint(kind, text)


def command_id(line: str) -> str | None:
    """The request id a command line names, when it names a well-formed one (to address its error)."""
    words = line.split()
    if len(words) >= 2 and words[0] in ("ADD", "ABORT"):
        try:
            return request_id(words[1])
        except ProtocolError:
            return None
    return None


def parse_command(line: str) -> Command:
    words = line.split()
    if not words:
        raise ProtocolError("empty line")
    verb, rest = words[0], words[1:]
    if verb == "ADD":
        if not rest:
            raise ProtocolError("ADD needs <id> <max_new> [key=value ...] <ids>")
        return Add(request_id(rest[0]), _request(rest[1:]))
    if verb == "ABORT" and len(rest) == 1:
        return Abort(request_id(rest[0]))
    if verb == "QUIT" and not rest:
        return Quit()
    if verb in ("ABORT", "QUIT"):
        raise ProtocolError(f"{verb}: wrong number of arguments")
    raise ProtocolError(f"unknown command {verb[:40]!r} (known: ADD, ABORT, QUIT)")


def format_request(request: Request) -> str:
    """The keys and ids of an ADD line after its id (the inverse of parsing), for clients."""
    defaults = SamplingParams()
    keys = [f"{f.name}={getattr(request.params, f.name)}" for f in fields(SamplingParams)
            if f.name != "logit_bias" and getattr(request.params, f.name) != getattr(defaults, f.name)]
    if request.params.logit_bias:
        keys.append("logit_bias=" + ",".join(f"{t}:{b!r}" for t, b in request.params.logit_bias))
    if request.stop_ids:
        keys.append("stop=" + ",".join(str(i) for i in sorted(request.stop_ids)))
    if request.ignore_eos:
        keys.append("ignore_eos=1")
    if request.logprobs is not None:
        keys.append(f"logprobs={request.logprobs}")
    if request.grammar is not None:
        keys.append("grammar=" + encode_constraint(request.grammar))
    if request.prompt_logprobs is not None:
        keys.append(f"prompt_logprobs={request.prompt_logprobs}")
    return " ".join([str(request.max_new), *keys, *map(str, request.ids)])


def add(rid: str, request: Request) -> str:
    return f"ADD {rid} {format_request(request)}"


# events

ERR_INVALID, ERR_FULL, ERR_INTERNAL = "invalid", "full", "internal"


def ready(facts: dict) -> str:
    return "READY " + json.dumps(facts, separators=(",", ":"))


def wait(rid: str) -> str:
    """The request joined the waiting line."""
    return f"WAIT {rid}"


def run(rid: str, num_reused: int) -> str:
    """The request got a slot; its prompt is read in the next windows, less `num_reused` tokens taken from a held
    or parked state."""
    return f"RUN {rid} {num_reused}"


def tokens(pairs: list[tuple[str, int]]) -> str:
    """The tokens one window gave: (request id, token) pairs, in order."""
    return "TOK " + " ".join(f"{rid} {t}" for rid, t in pairs)


def logprobs(rid: str, token: int, logprob: float, top: list[tuple[int, float]]) -> str:
    """The log-probability of a request's next token (sent before the TOK line that carries it) and the `top` most
    likely tokens with theirs, most likely first: raw log-softmax of the model's logits, before penalties,
    temperature and filters."""
    return f"LP {rid} {token} {logprob!r} " + " ".join(f"{t} {lp!r}" for t, lp in top)


def prompt_logprobs(rid: str, scored: list[tuple[float, list[tuple[int, float]]]]) -> list[str]:
    """A request's prompt scored (`prompt_logprobs=`), sent after RUN: a line per prompt token after the first, in
    order: its log-probability given the tokens before it and the top ones (as LP's)."""
    return [f"PLP {rid} {lp!r} " + " ".join(f"{t} {v!r}" for t, v in top) for lp, top in scored]


def end(rid: str, reason: str, num_prompt: int, num_generated: int, num_reused: int = 0) -> str:
    return f"END {rid} {reason} {num_prompt} {num_generated} {num_reused}"


def window(decode_rows: int, prompt_rows: int) -> str:
    """A window was read: its decoding rows and its prompt rows."""
    return f"WIN {decode_rows} {prompt_rows}"


def parked(conversations: int, num_bytes: int, disk_conversations: int = 0, disk_bytes: int = 0,
           reused_bytes: int = 0, vram_conversations: int = 0, vram_bytes: int = 0) -> str:
    """The parked conversations and their bytes: in host RAM, then in `--park-dir`'s files; the bytes that
    conversations parked again did not copy again (their restored image's cells), a running total; and the
    conversations with a copy in VRAM (`--park-vram-gb`) and its bytes."""
    return (f"PARKED {conversations} {num_bytes} {disk_conversations} {disk_bytes} {reused_bytes} "
            f"{vram_conversations} {vram_bytes}")


def restored(seconds: float, num_tokens: int, tier: str) -> str:
    """A parked conversation was restored into a sequence (`num_tokens` positions, from `tier`: vram, ram or disk), in
    `seconds` from its admission's lookup to the device having it, checks included."""
    return f"RESTORED {seconds:.6f} {num_tokens} {tier}"


def experts(on_device: int, on_cpu: int, pool_seconds: float = 0.0, pool_bytes: int = 0, uploaded: int = 0,
            upload_bytes: int = 0) -> str:
    """Running totals of the pooled layers' routed pairs (computed on the device with resident weights / by the CPU
    pool), the pool's host seconds, the bytes of expert weights it read, and the pairs the device computed on
    uploaded weights (`--pcie-frac`) with the bytes uploaded."""
    return f"EXPERTS {on_device} {on_cpu} {pool_seconds:.6f} {pool_bytes} {uploaded} {upload_bytes}"


def spec_decode(drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: list[int]) -> str:
    """Running totals of drafting (`--spec`): drafts (a drafting slot in a window), drafted and accepted tokens,
    and accepted tokens by draft position."""
    return f"SPEC {drafts} {draft_tokens} {accepted} " + " ".join(map(str, accepted_per_pos))


def err(rid: str | None, code: str, reason: str) -> str:
    """A command that could not be carried out; `rid` the request it named ("-" when none could be read); `code`
    `invalid` (a bad command or request), `full` (the waiting line is full: try again later) or `internal`."""
    return f"ERR {rid or '-'} {code} " + " ".join(reason.split())  # one line, whatever the message held
