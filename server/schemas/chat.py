"""POST /v1/chat/completions in OpenAI's wire format (the `openai` client's chat.completions.create)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from models.sampling import SamplingParams
from server.config import Settings
from server.schemas.base import RequestModel, Text
from server.schemas.generation import EosControls, LogitBias, StopSequence
from server.schemas.openai import Usage
from server.schemas.structured import Constraint, ResponseFormat, StructuredOutputs

MAX_MESSAGES = 256


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(..., description="Who says it.")
    content: Text = Field(..., description="What is said (text).")
    name: str | None = Field(None, max_length=64)


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(EosControls):
    model: str = Field(..., description="A model whose tokenizer carries a chat template (GET /v1/models: chat).")
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=100_000, description="Tokens to generate at most (deprecated name).")
    max_completion_tokens: int | None = Field(None, ge=1, le=100_000, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, gt=0, description="Extension: sample among the k most likely tokens.")
    n: int = Field(1, ge=1, le=16, description="Replies (seed s gives seeds s, s+1, ...).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5, description="With logprobs: this many alternatives per token.")
    stop: StopSequence | list[StopSequence] = Field([], description="Up to 4 stop sequences.")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="Extension: CTRL-style penalty.")
    logit_bias: LogitBias = {}
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = None
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text, json_object, json_schema.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice or grammar.")

    def constraint(self) -> Constraint | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str]) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        """OpenAI semantics: temperature 0 is greedy, top_p 1 is off."""
        greedy = self.temperature == 0
        wanted = self.max_completion_tokens or self.max_tokens or settings.max_new_tokens_cap
        return SamplingParams(
            max_new_tokens=min(wanted, settings.max_new_tokens_cap),
            temperature=self.temperature,
            top_k=None if greedy else self.top_k,
            top_p=None if greedy or self.top_p >= 1 else self.top_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=list(self.stop),
            seed=self.seed,
            logit_bias=dict(self.logit_bias),
            logprobs=self.logprobs,
            top_logprobs=(self.top_logprobs or 0) if self.logprobs else 0,
            **self.eos_params(settings),
        )


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
