"""From a request body to what the engine runs: the prompt's token ids, the constraint its answer follows, how
its tool calls are read, and one engine request per sample.

Pure functions of the body, the tokenizer and the served model's limits; they raise `APIError` naming the field
that cannot be served.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from serve.errors import APIError
from serve.schemas import (ChatCompletionRequest, CompletionRequest, NamedToolChoice, SamplingFields,
                           TokenizeRequest)
from serve.tools import HERMES, QWEN3_CODER, ToolFormat, template_messages, tool_format
from strata.errors import StrataError
from strata.grammar import Constraint, tool_call_constraint
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


@dataclass(frozen=True)
class ToolPlan:
    """How a chat answer's tool calls are read: the model's format (`serve.tools`), the functions it may call (a
    call to any other is content), each with its parameters schema (None where it has none; Qwen3-Coder's XML
    values are converted by it), whether it may make several (`parallel_tool_calls`; when not, the answer ends
    with its first call), and whether the grammar forces a call (`tool_choice` "required" or a named function).
    `names` goes to `serve.tools.ToolCallStream` as it is."""

    fmt: ToolFormat
    names: Mapping[str, dict | None] = field(hash=False)
    parallel: bool
    forced: bool = False


def tool_plan(body: ChatCompletionRequest | TokenizeRequest, tokenizer: Tokenizer,
              family: str | None = None) -> ToolPlan | None:
    """Check `tools` and `tool_choice` together; the plan when tools are offered (None without tools, or with
    `tool_choice` "none": the answer is plain text)."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise APIError(400, f"tools: two tools are named {twice[0]!r}; tool names must be unique", param="tools")
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        wanted = choice if isinstance(choice, str) else f"the function {choice.function.name!r}"
        raise APIError(400, f"tool_choice: {wanted!r} needs tools, and the request offers none (send `tools`, or "
                            "leave tool_choice out)", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: names the function {choice.function.name!r}, which is not among the tools "
                            f"({', '.join(names)})", param="tool_choice")
    if not tools or body.tool_choice_value() == "none":
        return None
    fmt = tool_format(tokenizer.chat_template, family)
    parallel = getattr(body, "parallel_tool_calls", True)
    schemas = {t.function.name: t.function.parameters for t in tools}
    return ToolPlan(fmt, schemas, parallel, forced=body.tool_choice_value() != "auto")


TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})  # ours to set


def chat_prompt(body: ChatCompletionRequest | TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    """The messages, and the tools offered, through the model's chat template (`serve.tools.template_messages`:
    the template's own `tools` where it reads them, else Strata's Hermes prompt in the system message), with the
    request's `chat_template_kwargs` as more of the template's variables (Qwen3's `enable_thinking`), and its
    last message left open with `continue_final_message` (`open_final_message`)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message: the answer continues the last message, so no new turn may open: "
                            "set add_generation_prompt to false too", param="continue_final_message")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: set logprobs to true to get top log-probabilities", param="top_logprobs")
    for i, m in enumerate(body.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                           param=f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(400, f"messages.{i}.tool_call_id: only tool messages answer a call",
                           param=f"messages.{i}.tool_call_id")
    choice = body.tool_choice_value()
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    messages, extra = template_messages([m.as_openai() for m in body.messages], tools or None,
                                        tokenizer.chat_template,
                                        choice if isinstance(choice, str) else choice.model_dump())
    kwargs = body.chat_template_kwargs or {}
    taken = sorted(set(kwargs) & (TEMPLATE_VARIABLES | set(extra)))
    if taken:
        raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is a variable Strata gives the template itself "
                            f"({', '.join(sorted(TEMPLATE_VARIABLES | set(extra)))}); use the request's own field",
                       param="chat_template_kwargs")
    extra = {**kwargs, **extra}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **extra)
    except StrataError as e:
        raise APIError(400, str(e), param="messages") from None
    if body.continue_final_message:
        text = open_final_message(text, messages[-1].get("content"))
    return tokenizer.encode(text, add_special_tokens=False)  # the rendered template carries its own BOS


def open_final_message(text: str, content) -> str:
    """The rendered chat cut just after the last message's text, so that what the template closes it with (an
    end-of-turn token, a newline) is gone and the answer continues that text (as transformers'
    `continue_final_message` cuts it). A template that trims the text keeps it trimmed here."""
    if isinstance(content, list):  # text parts: the last one
        content = next((p.get("text") for p in reversed(content) if p.get("text") is not None), None)
    if not content or not content.strip():
        raise APIError(400, "continue_final_message: the last message has no text to continue",
                       param="continue_final_message")
    at = text.rfind(content.strip())
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not write the last message's text as "
                            "it was sent, so there is nothing to continue", param="continue_final_message")
    kept = content.lstrip()
    end = at + len(kept) if text[at : at + len(kept)] == kept else at + len(content.strip())
    return text[:end]


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def request_constraint(body: SamplingFields, plan: ToolPlan | None = None) -> tuple[Constraint | None, str | None]:
    """The constraint the answer follows and the field it came from (None, None: unconstrained): `response_format`
    (json_object, json_schema; text is none), vLLM's `structured_outputs` and `guided_*`, or a forced tool call
    (`tool_choice` "required" or a named function, with `plan`). More than one is refused, naming two of them."""
    found: list[tuple[str, object]] = []  # (field, a function making the constraint)
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint.json_object))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        found.append(("response_format", lambda: Constraint.json_schema(True if schema is None else schema)))
    so = body.structured_outputs
    if so is not None:
        given = [k for k in _STRUCTURED_KEYS if getattr(so, "json_" if k == "json" else k) not in (None, False)]
        if not given:
            raise APIError(400, "structured_outputs: set one of " + ", ".join(_STRUCTURED_KEYS),
                           param="structured_outputs")
        for key in given:
            found.append((f"structured_outputs.{key}", _structured(key, getattr(so, "json_" if key == "json" else key),
                                                                  f"structured_outputs.{key}")))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _structured(key, value, f"guided_{key}")))
    if plan is not None and plan.forced:
        found.append(("tool_choice", lambda: forced_call_constraint(body, plan)))
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise APIError(400, f"{first} and {second}: each constrains the answer, and a request takes one constraint; "
                            "send only one of them", param=second)
    if not found:
        return None, None
    param, make = found[0]
    try:
        return make(), param
    except StrataError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def _structured(key: str, value, param: str):
    """The maker of a `structured_outputs` / `guided_*` constraint."""
    def make() -> Constraint:
        if key == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = json.loads(value)
                except json.JSONDecodeError as e:
                    raise StrataError(f"the schema is not valid JSON: {e}") from None
            return Constraint.json_schema(schema)
        if key == "json_object":
            return Constraint.json_object()
        return getattr(Constraint, key)(value)
    return make


def forced_call_constraint(body: ChatCompletionRequest, plan: ToolPlan) -> Constraint:
    """`tool_choice` "required" (any tool; several calls with `parallel_tool_calls` where the format separates
    them) or a named function (one call of it), in the text form the model writes calls in, so the parser
    (`serve.tools`) reads the forced call like any other: Hermes' `<tool_call>` blocks, Llama 3's bare JSON
    object with "parameters", or Qwen3-Coder's XML `<tool_call>` blocks."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice_value()
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    fmt = plan.fmt
    if fmt is QWEN3_CODER:
        # strata.grammar.tools writes the block as Qwen3-Coder's template writes a past call, blocks "\n" apart
        return tool_call_constraint(tools, name, wrap="qwen3_coder", parallel=plan.parallel and name is None)
    if (fmt.prefix, fmt.suffix, fmt.separator) == (HERMES.prefix, HERMES.suffix, HERMES.separator):
        # strata.grammar.tools writes the same text: "<tool_call>\n" json "\n</tool_call>", blocks "\n" apart
        return tool_call_constraint(tools, name, wrap="hermes", parallel=plan.parallel and name is None,
                                    arguments_key=fmt.arguments_key)
    if fmt.prefix == fmt.suffix == "":  # the call's JSON alone (Llama 3): one call
        return tool_call_constraint(tools, name, arguments_key=fmt.arguments_key)
    raise StrataError(f"a forced call in the {fmt.name} format is not available yet; use tool_choice \"auto\"")


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


def tokenize_ids(body: TokenizeRequest, tokenizer: Tokenizer, family: str | None = None) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise APIError(400, "add_special_tokens: chat messages take their special tokens from the chat template",
                           param="add_special_tokens")
        tool_plan(body, tokenizer, family)  # the checks a chat request gets
        return chat_prompt(body, tokenizer)
    if body.tools is not None or body.tool_choice is not None:
        raise APIError(400, "tools: tools go into a chat prompt; send messages with them", param="tools")
    return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)


def check_prompt(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:  # two C loops (a generator: ~0.2 ms at 4K ids)
        raise APIError(400, f"a prompt token id is outside the vocabulary (0..{limits.vocab_size - 1})", param="prompt")
    if len(ids) >= limits.max_cells:
        raise APIError(400, f"This model's maximum context length is {limits.max_cells} tokens. However, your prompt "
                            f"has {len(ids)} tokens and the answer needs at least one more. Shorten the prompt.",
                       param="messages", code="context_length_exceeded")


def logit_bias(field: dict[str, float] | None, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as JSON object keys, biases in [-100, 100]) as the engine takes it: (id,
    bias) pairs, ids ascending. A key that is not a token id of this vocabulary is refused by name."""
    pairs = {}
    for key, bias in (field or {}).items():
        token = key.strip()
        if not (token.isascii() and token.isdigit()) or int(token) >= limits.vocab_size:
            raise APIError(400, f"logit_bias: key {key[:40]!r} is not a token id of this model's vocabulary "
                                f"(0..{limits.vocab_size - 1}); /tokenize gives a text's ids", param="logit_bias")
        if int(token) in pairs:
            raise APIError(400, f"logit_bias: token id {int(token)} is given twice", param="logit_bias")
        pairs[int(token)] = float(bias)
    return tuple(sorted(pairs.items()))


def engine_requests(body: SamplingFields, ids: list[int], limits: Limits,
                    grammar: Constraint | None = None) -> list[EngineRequest]:
    """One engine request per sample (`n`), sample i seeded `sample_seed(seed, i)`, each constrained by
    `grammar` (the engine keeps one matcher per request)."""
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
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})",
                       param="min_tokens")
    bias = logit_bias(body.logit_bias, limits)
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
            logit_bias=bias,
            min_tokens=body.min_tokens,
        )
        try:
            params.validate()
        except StrataError as e:
            raise APIError(400, str(e)) from None
        scored = body.logprobs if getattr(body, "echo", False) else None  # a completion's echo with logprobs
        out.append(EngineRequest(max_tokens or limits.max_cells - len(ids), params,
                                 frozenset(body.stop_token_ids or []), body.ignore_eos, ids,
                                 body.top_logprobs_wanted(), grammar=grammar, prompt_logprobs=scored))
    return out
