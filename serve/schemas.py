"""OpenAI-compatible request bodies: the fields Strata honours. A field it does not honour is refused by name
(400), except a few that change nothing in the answer (`user`, `metadata`, `store`, `service_tier`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

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
    ignore_eos: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
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


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def as_template_message(self) -> dict:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
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
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (the template's)
    return_token_strs: StrictBool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
