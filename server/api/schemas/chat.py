"""POST /v1/chat/completions in OpenAI's wire format (the `openai` client's chat.completions.create)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from models.sampling import SamplingParams
from server.api.schemas.base import MAX_TOKENS, RequestModel, Text
from server.api.schemas.openai import OpenAISampling, Usage
from server.api.schemas.structured import Constraint, ResponseFormat
from server.config import Settings

MAX_MESSAGES = 256


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(..., description="Who says it.")
    content: Text = Field(..., description="What is said (text).")
    name: str | None = Field(None, max_length=64)


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(OpenAISampling):
    model: str = Field(..., description="A model whose tokenizer carries a chat template (GET /v1/models: chat).")
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Tokens to generate at most (deprecated name)."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Tokens to generate at most.")
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5, description="With logprobs: this many alternatives per token.")
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text, json_object, json_schema.")

    def constraint(self) -> Constraint | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        wanted = self.max_completion_tokens or self.max_tokens or settings.max_new_tokens_cap
        return self.sampling_params(settings, wanted, (self.top_logprobs or 0) if self.logprobs else None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
