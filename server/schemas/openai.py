"""POST /v1/completions in the OpenAI wire format, so the `openai` client works unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from server.config import Settings
from server.schemas.base import Text
from server.schemas.generation import EosControls, LogitBias, StopSequence
from training.sampling import SamplingParams


class CompletionRequest(EosControls):
    model: str = Field(..., description="Model id from GET /models.")
    prompt: Text | list[Text] = Field(..., description="The prompt, or a list of up to 16 prompts.")
    max_tokens: int = Field(
        16, ge=1, le=100_000, description="Tokens to generate at most (capped by the server's max_new_tokens_cap)."
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, gt=0, description="Extension: sample among the k most likely tokens.")
    n: int = Field(1, ge=1, le=16, description="Completions per prompt (seed s gives seeds s, s+1, ...).")
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=5, description="Return logprobs of this many alternatives.")
    echo: bool = Field(False, description="Prepend the prompt to the completion.")
    stop: StopSequence | list[StopSequence] = Field([], description="Up to 4 stop sequences.")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="Extension: CTRL-style penalty.")
    best_of: int = Field(1, ge=1, le=1, description="Only 1 is supported.")
    logit_bias: LogitBias = {}
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = None
    suffix: str | None = Field(None, max_length=0, description="Not supported.")

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        """OpenAI semantics: temperature 0 is greedy; top_p 1 is off; logprobs N asks for N alternatives."""
        greedy = self.temperature == 0
        return SamplingParams(
            max_new_tokens=min(self.max_tokens, settings.max_new_tokens_cap),
            temperature=self.temperature,
            top_k=None if greedy else self.top_k,
            top_p=None if greedy or self.top_p >= 1 else self.top_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=list(self.stop),
            seed=self.seed,
            logit_bias=dict(self.logit_bias),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            **self.eos_params(settings),
        )

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: str | list[str]) -> list[str]:
        prompts = [v] if isinstance(v, str) else v
        if not 1 <= len(prompts) <= 16:
            raise ValueError("give 1 to 16 prompts")
        if not all(prompts):
            raise ValueError("prompt must not be empty")
        return prompts

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str]) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops


class Logprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class Choice(BaseModel):
    text: str
    index: int = 0
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When the checkpoint was written (Unix time).")
    owned_by: str = "tinyserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
