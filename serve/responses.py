"""From what the engine gave to OpenAI's response objects: choices, chunks, usage and log-probabilities.

Pure functions of the answer so far (text, tokens, the engine's `LP` entries); the routes stream or gather them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.tools import add_delta, join_deltas
from strata.model.tokenizer import Tokenizer

LogprobEntry = tuple[float, list[tuple[int, float]]]  # a token's log-probability, and the top (id, log-probability)


@dataclass
class Piece:
    """Text of one sample's answer as it is released, the tokens it came from, and, on the last, why it ended."""

    index: int
    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    finish: str | None = None
    deltas: list[dict] | None = None  # with tools offered: the text as parsed (serve.tools.ToolCallStream deltas)


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's values: "length" when max_tokens or the context ran out; "tool_calls" when the answer called a
    tool (and did not run out); "stop" for a stop token or string (and an abort, which only a stream whose client
    is gone sees)."""
    if reason is None:
        return None
    return reason if reason in ("length", "tool_calls") else "stop"


def usage(num_prompt: int, num_generated: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated, "total_tokens": num_prompt + num_generated}


def _token_fields(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, tokens: list[int], entries: list[LogprobEntry]) -> dict:
    """`choices[].logprobs` of a chat completion: per token its text, log-probability, UTF-8 bytes and top ones."""
    content = []
    for token_id, (logprob, top) in zip(tokens, entries):
        text, raw = _token_fields(tokenizer, token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt_text, alt_raw = _token_fields(tokenizer, alt_id)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, tokens: list[int], entries: list[LogprobEntry], offset: int) -> dict:
    """`choices[].logprobs` of a (legacy) completion: tokens, their log-probabilities, the top ones as
    {text: log-probability}, and each token's character offset in the answer (from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, (logprob, top) in zip(tokens, entries):
        text = _token_fields(tokenizer, token_id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({_token_fields(tokenizer, t)[0]: lp for t, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def prompt_logprobs(tokenizer: Tokenizer, ids: list[int], scored: list[LogprobEntry], answer: dict | None) -> dict:
    """A completion's `logprobs` with its echoed prompt's first (OpenAI's shape: the first prompt token has none),
    the prompt's tokens from character 0, then the answer's (`answer`: `completion_logprobs`' dict, or None)."""
    out = completion_logprobs(tokenizer, ids[1:], scored, len(_token_fields(tokenizer, ids[0])[0]) if ids else 0)
    if ids:
        out = {"tokens": [_token_fields(tokenizer, ids[0])[0], *out["tokens"]],
               "token_logprobs": [None, *out["token_logprobs"]], "top_logprobs": [None, *out["top_logprobs"]],
               "text_offset": [0, *out["text_offset"]]}
    for key in out if answer is not None else ():
        out[key] += answer[key]
    return out


def chat_choice(piece: Piece, tokenizer: Tokenizer, delta: bool, first: bool = False) -> dict:
    """A chat choice: the whole message (`delta` False) or a stream chunk's delta (the role on the `first`)."""
    logprobs = chat_logprobs(tokenizer, piece.tokens, piece.logprobs) if piece.logprobs is not None else None
    if piece.deltas is not None and not first:
        if delta:
            raise ValueError("a parsed piece streams as several choices: use chat_delta_choices")
        content, calls = join_deltas(piece.deltas)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return {"index": piece.index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason(piece.finish)}
    if delta:
        message = {"role": "assistant", "content": piece.text} if first else (
            {"content": piece.text} if piece.text or piece.finish is None else {})
        return {"index": piece.index, "delta": message, "logprobs": logprobs,
                "finish_reason": finish_reason(piece.finish)}
    return {"index": piece.index, "message": {"role": "assistant", "content": piece.text}, "logprobs": logprobs,
            "finish_reason": finish_reason(piece.finish)}


def chat_delta_choices(piece: Piece, tokenizer: Tokenizer) -> list[dict]:
    """A piece's stream choices, one per chunk. Plain text: one. Parsed for tool calls: one per delta as vLLM
    streams them (content; a call's id and name; its argument pieces), the piece's log-probabilities and finish
    reason on the last, an empty delta carrying them where the piece's text gave no delta (held back, or the end);
    none where there is nothing to say."""
    if piece.deltas is None:
        return [chat_choice(piece, tokenizer, delta=True)]
    logprobs = chat_logprobs(tokenizer, piece.tokens, piece.logprobs) if piece.logprobs else None
    deltas = piece.deltas or ([{}] if logprobs is not None or piece.finish is not None else [])
    out = [{"index": piece.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if out:
        out[-1]["logprobs"], out[-1]["finish_reason"] = logprobs, finish_reason(piece.finish)
    return out


def completion_choice(piece: Piece, tokenizer: Tokenizer, offset: int = 0) -> dict:
    """A completion choice (whole or a chunk's): `offset` is where the piece's text starts in the answer."""
    logprobs = (completion_logprobs(tokenizer, piece.tokens, piece.logprobs, offset)
                if piece.logprobs is not None else None)
    return {"index": piece.index, "text": piece.text, "logprobs": logprobs, "finish_reason": finish_reason(piece.finish)}


def gather(pieces: list[Piece]) -> Piece:
    """One sample's pieces as one (the non-streamed answer)."""
    out = Piece(pieces[0].index if pieces else 0, "")
    for p in pieces:
        out.text += p.text
        out.tokens += p.tokens
        if p.logprobs is not None:
            out.logprobs = (out.logprobs or []) + p.logprobs
        if p.deltas is not None:
            out.deltas = out.deltas if out.deltas is not None else []
            for d in p.deltas:
                add_delta(out.deltas, d)
        out.finish = p.finish or out.finish
    return out
