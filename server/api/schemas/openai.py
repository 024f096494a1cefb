"""POST /v1/completions in the OpenAI wire format, so the `openai` client works unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidatorFunctionWrapHandler, field_validator

from models.sampling import SamplingParams
from server.api.schemas.base import MAX_PENALTY, MAX_SEED, MAX_TOKENS, Text, no_nul
from server.api.schemas.generation import EosControls, LogitBias, StopSequence
from server.api.schemas.steering import Steered
from server.api.schemas.structured import StructuredOutputs
from server.config import Settings

MAX_PROMPTS = 16
Prompt = str | list[int]  # text, or token ids


def _is_token_ids(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class OpenAISampling(EosControls, Steered):
    """What /v1/completions and /v1/chat/completions share: sampling, stops, penalties, structured output."""

    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy (OpenAI's range: 0 to 2).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, gt=0, description="Extension: sample among the k most likely tokens.")
    n: int = Field(1, ge=1, le=16, description="Outputs per prompt (seed s gives seeds s, s+1, ...).")
    stream: bool = False
    stop: StopSequence | list[StopSequence] = Field([], description="Up to 4 stop sequences.")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_PENALTY, description="Extension: CTRL-style penalty.")
    logit_bias: LogitBias = {}
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice or grammar.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str]) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    def sampling_params(self, settings: Settings, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
        """OpenAI semantics: temperature 0 is greedy; top_p 1 is off; top_logprobs None = no logprobs."""
        greedy = self.temperature == 0
        return SamplingParams(
            max_new_tokens=min(max_tokens, settings.max_new_tokens_cap),
            temperature=self.temperature,
            top_k=None if greedy else self.top_k,
            top_p=None if greedy or self.top_p >= 1 else self.top_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=list(self.stop),
            seed=self.seed,
            logit_bias=dict(self.logit_bias),
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
            **self.eos_params(settings),
        )


class CompletionRequest(OpenAISampling):
    model: str = Field(..., description="Model id from GET /models.")
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        ...,
        description=f"A prompt as text or as token ids, or a list of up to {MAX_PROMPTS} of either (each "
        "completed in turn). Token ids are checked against the model's vocabulary.",
    )
    max_tokens: int = Field(
        16,
        ge=0,
        le=MAX_TOKENS,
        description="Tokens to generate at most (capped by the server's max_new_tokens_cap); 0 with `echo` "
        "scores the prompt without generating.",
    )
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Return the tokens' logprobs and this many most likely alternatives (0 to 5)."
    )
    echo: bool = Field(
        False,
        description="Prepend the prompt to the completion; with `logprobs`, the prompt tokens' logprobs too "
        "(the first one null).",
    )
    best_of: int = Field(1, ge=1, le=1, description="Only 1 is supported.")
    suffix: str | None = Field(None, max_length=0, description="Not supported.")

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        """logprobs N asks for the tokens' logprobs and N alternatives."""
        return self.sampling_params(settings, self.max_tokens, self.logprobs)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompts(cls, v: object, handler: ValidatorFunctionWrapHandler) -> list[Prompt]:
        """Every accepted shape as a list of prompts; validated here, so an error names `prompt`, not a
        member of the union."""
        prompts = [v] if isinstance(v, str) or _is_token_ids(v) else v
        if not isinstance(prompts, list):
            raise ValueError("must be a string, a list of token ids, or a list of either")
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts")
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"{where} must not be empty")
                no_nul(p)
            elif not _is_token_ids(p):
                raise ValueError(f"{where} must be a non-empty string or a non-empty list of integer token ids")
            elif (bad := next((j for j, t in enumerate(p) if t < 0), None)) is not None:
                raise ValueError(f"{where}[{bad}]: token ids are non-negative")
        return prompts


class Logprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # null for an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None] | None = None
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


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When the checkpoint was written (Unix time).")
    owned_by: str = "tinyserve"
    chat: bool = Field(False, description="Extension: its tokenizer carries a chat template (/v1/chat/completions).")


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]
