"""From a request body to what the engine runs: the prompt's token ids and one engine request per sample.

Pure functions of the body, the tokenizer and the served model's limits; they raise `APIError` naming the field
that cannot be served.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from serve.errors import APIError
from serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest
from strata.errors import StrataError
from strata.model.tokenizer import Tokenizer
from strata.protocol import Request as EngineRequest
from strata.runtime.sampling import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of a request's samples


@dataclass(frozen=True)
class Limits:
    """What the served model can hold."""

    vocab_size: int
    max_cells: int


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: the seed itself for the first (so `n=1` and the
    first of `n=3` agree), then a different stream for each other sample."""
    return seed if index == 0 else (seed + index * _GOLDEN) % 2**63


def chat_prompt(body: ChatCompletionRequest | TokenizeRequest, tokenizer: Tokenizer,
                add_generation_prompt: bool = True) -> list[int]:
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: set logprobs to true to get top log-probabilities", param="top_logprobs")
    try:
        return tokenizer.encode_chat([m.as_template_message() for m in body.messages],
                                     add_generation_prompt=add_generation_prompt)
    except StrataError as e:
        raise APIError(400, str(e), param="messages") from None


def completion_prompt(body: CompletionRequest, tokenizer: Tokenizer) -> tuple[list[int], str]:
    """The prompt's ids, and the text an `echo` puts before the answer ("" without echo)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (a list of several strings is not supported; send "
                                "one request each, or use n for several samples of one prompt)", param="prompt")
        prompt = prompt[0]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else ""
    return ids, echo


def tokenize_ids(body: TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise APIError(400, "add_special_tokens: chat messages take their special tokens from the chat template",
                           param="add_special_tokens")
        return chat_prompt(body, tokenizer, add_generation_prompt=body.add_generation_prompt)
    return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)


def check_prompt(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if any(not 0 <= i < limits.vocab_size for i in ids):
        raise APIError(400, f"a prompt token id is outside the vocabulary (0..{limits.vocab_size - 1})", param="prompt")
    if len(ids) >= limits.max_cells:
        raise APIError(400, f"This model's maximum context length is {limits.max_cells} tokens. However, your prompt "
                            f"has {len(ids)} tokens and the answer needs at least one more. Shorten the prompt.",
                       param="messages", code="context_length_exceeded")


def engine_requests(body: SamplingFields, ids: list[int], limits: Limits) -> list[EngineRequest]:
    """One engine request per sample (`n`), sample i seeded `sample_seed(seed, i)`."""
    check_prompt(ids, limits)
    if any(not 0 <= i < limits.vocab_size for i in body.stop_token_ids or []):
        raise APIError(400, "stop_token_ids: a token id is outside the vocabulary "
                            f"(0..{limits.vocab_size - 1})", param="stop_token_ids")
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None and len(ids) + max_tokens > limits.max_cells:
        raise APIError(400, f"This model's maximum context length is {limits.max_cells} tokens. However, you "
                            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                            "completion). Reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    out = []
    for index in range(body.n):
        params = SamplingParams(
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=max(0, body.top_k or 0),
            min_p=body.min_p or 0.0,
            seed=sample_seed(seed, index),
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
        )
        try:
            params.validate()
        except StrataError as e:
            raise APIError(400, str(e)) from None
        out.append(EngineRequest(max_tokens or limits.max_cells - len(ids), params,
                                 frozenset(body.stop_token_ids or []), body.ignore_eos, ids,
                                 body.top_logprobs_wanted()))
    return out
