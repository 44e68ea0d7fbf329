"""OpenAI-compatible request bodies (the fields Strata honours; unknown fields are ignored, like vLLM)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# Request fields hold what the engine can honour, checked here so no value reaches it that could make it fail:
# integers are JSON integers (not true/false, not 1.0) within 32 or 63 bits, floats are finite and within
# OpenAI's ranges (vLLM's for the fields OpenAI does not have).
INT32_MAX = 2**31 - 1
Count = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 or 0: off; past the vocabulary: off
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]] | None = None  # and below the vocabulary
    presence_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0.0, le=2.0)] | None = None
    ignore_eos: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]] | list[str]
    echo: StrictBool = False
