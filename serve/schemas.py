"""OpenAI-compatible request bodies: the fields Strata honours. A field it does not honour is refused by name
(400), except a few that change nothing in the answer (`user`, `metadata`, `store`, `service_tier`).

Shapes only: what the fields mean together (one constraint per request, `tool_choice` naming an offered tool...)
is checked in `serve/requests.py`, which answers 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# Request fields hold what the engine can honour, checked here so no value reaches it that could make it fail:
# integers are JSON integers (not true/false, not 1.0) within 32 or 63 bits, floats are finite and within
# OpenAI's ranges (vLLM's for the fields OpenAI does not have).
INT32_MAX = 2**31 - 1
MAX_N = 64  # samples one request may ask for
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit for chat; vLLM's for completions too)
Count = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage in every chunk


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`: OpenAI's named schema. `strict` is accepted: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    schema_: dict | StrictBool | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these constrains the answer."""

    json_: dict | StrictBool | StrictStr | None = Field(default=None, alias="json")  # a schema (or its JSON text)
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None  # Lark (llguidance's), or GBNF / EBNF as vLLM's guided_grammar takes
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SamplingFields(Strict):
    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 or 0: off; past the vocabulary: off
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # and below the vocabulary
    presence_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100.0, le=100.0)]] | None = None  # token id (a string) -> bias
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] = 0  # vLLM's: no stop before this many tokens
    include_stop_str_in_output: StrictBool = False  # vLLM's: a stop string that ends the answer is kept in it
    skip_special_tokens: StrictBool = True  # vLLM's: special tokens' text (end of turn, ...) left out of the answer
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # structured output (serve/requests.py `request_constraint`: at most one per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | StrictBool | StrictStr | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # accepted, and change nothing in the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def top_logprobs_wanted(self) -> int | None:
        """How many top log-probabilities each token reports; None when the request asks for none."""
        raise NotImplementedError


class ContentPart(Strict):
    type: Literal["text"] = "text"
    text: str


class FunctionDefinition(Strict):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema; None: the function takes no arguments
    strict: StrictBool | None = None  # accepted: a forced call's arguments always follow `parameters`


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class CalledFunction(Strict):
    name: StrictStr
    arguments: StrictStr  # a JSON text, as answers give it


class ToolCallMessage(Strict):
    """A past call in an assistant message's `tool_calls`."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None  # None: an assistant message that only calls tools
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant messages only
    tool_call_id: StrictStr | None = None  # tool messages: the call this is the result of

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def as_openai(self) -> dict:
        """The message as an OpenAI dict (what `serve.tools.template_messages` reads), unset keys left out."""
        return self.model_dump(exclude_none=True)


class ChatFields(Strict):
    """What chat requests and chat /tokenize share: the messages and the tools offered."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without (OpenAI's)
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, object] | None = None  # vLLM's: more variables for the chat template
    add_generation_prompt: StrictBool = True  # vLLM's: the template's opening of the assistant's turn
    continue_final_message: StrictBool = False  # vLLM's: the last message left open, the answer continues it

    def tool_choice_value(self) -> str | NamedToolChoice:
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")


class ChatCompletionRequest(ChatFields, SamplingFields):
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str]
    echo: StrictBool = False
    logprobs: TopLogprobs | None = None

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or chat messages (with the `tools` offered) through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # "none" leaves the tools out of the prompt, as in a chat request
    chat_template_kwargs: dict[str, object] | None = None  # as in a chat request
    continue_final_message: StrictBool = False  # as in a chat request

    def tool_choice_value(self) -> str | NamedToolChoice:
        return self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (the template's)
    return_token_strs: StrictBool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
