"""Completion requests in the text-generation-inference (TGI) wire format, plus our extensions."""

from __future__ import annotations

import secrets
from typing import Annotated, Literal

from pydantic import BaseModel, Field, Strict, StringConstraints, field_validator

from models.sampling import SamplingParams
from server.api.schemas.base import MAX_EOS_BIAS, MAX_PENALTY, MAX_SEED, MAX_TEMPERATURE, MAX_TOKENS, RequestModel, Text
from server.api.schemas.steering import Steered
from server.api.schemas.structured import TGIGrammar
from server.config import Settings

NEVER = -1e9  # JSON has no -inf: an EOS bias at or below this means "never stop"

FinishReason = Literal["length", "eos_token", "stop_sequence"]
StopSequence = Annotated[Text, StringConstraints(min_length=1, max_length=200)]
TokenIdKey = Annotated[int, Strict(False)]  # JSON object keys are strings: "50256" is a token id
LogitBias = Annotated[
    dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=300, description="Token id -> additive logit bias in [-100, 100] (at most 300)."),
]


class EosControls(RequestModel):
    """EOS downweighting, shared by the TGI and OpenAI formats (our extension)."""

    eos_bias: float | None = Field(
        None,
        description="Added to the end-of-text logit. Negative = longer outputs; -1e9 or less = never stop "
        "(JSON has no -inf). Default: the server's configured default.",
        le=MAX_EOS_BIAS,
    )
    eos_bias_decay: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Relax the EOS bias by this factor per generated token (after eos_bias_start).",
    )
    eos_bias_start: int = Field(
        0, ge=0, le=MAX_TOKENS, description="Generated tokens before the EOS bias starts to relax."
    )
    min_new_tokens: int = Field(
        0, ge=0, le=MAX_TOKENS, description="The end-of-text token is impossible before this many tokens."
    )

    def eos_params(self, settings: Settings) -> dict:
        """The EOS fields of SamplingParams: the server's default bias when none is given, -1e9 = never."""
        bias = settings.default_eos_bias if self.eos_bias is None else self.eos_bias
        return dict(
            eos_bias=float("-inf") if bias <= NEVER else bias,
            eos_bias_decay=self.eos_bias_decay,
            eos_bias_start=self.eos_bias_start,
            min_new_tokens=self.min_new_tokens,
        )


class GenerateParameters(EosControls, Steered):
    model: str | None = Field(None, description="Model id from GET /models (default: the first completion model).")
    max_new_tokens: int = Field(
        20, ge=1, le=MAX_TOKENS, description="Tokens to generate at most (capped by the server's max_new_tokens_cap)."
    )
    do_sample: bool = Field(
        False, description="Sample. As in TGI, setting temperature (other than 1), top_k or top_p samples too."
    )
    temperature: float | None = Field(
        None, gt=0.0, le=MAX_TEMPERATURE, description="Softmax temperature (> 0) when sampling."
    )
    top_k: int | None = Field(None, gt=0, description="Sample among the k most likely tokens.")
    top_p: float | None = Field(None, gt=0.0, lt=1.0, description="Nucleus sampling: smallest set with this mass.")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=MAX_PENALTY, description="> 1 discourages repeats (CTRL)."
    )
    stop: list[StopSequence] = Field([], max_length=16, description="Stop sequences, matched on text (not returned).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed and inputs give the same output.")
    logit_bias: LogitBias = {}
    details: bool = Field(False, description="Return finish reason, token ids, texts and logprobs.")
    grammar: TGIGrammar | None = Field(None, description="Constrain the output to a JSON schema or a regex.")
    top_n_tokens: int | None = Field(None, ge=1, le=10, description="Also return this many most likely alternatives.")
    return_full_text: bool = Field(False, description="Prepend the prompt to generated_text.")
    decoder_input_details: bool = Field(
        False, description="Accepted for TGI compatibility; prefill details are not returned."
    )
    truncate: int | None = Field(None, ge=1, description="Keep only the last N prompt tokens.")
    watermark: bool = Field(False, description="Not supported: must be false.")
    best_of: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")
    typical_p: float | None = Field(None, description="Not supported: must be null.")

    @property
    def sampling(self) -> bool:
        """TGI's rule: sample when do_sample is set or any warper is (a temperature other than 1, top_k,
        top_p); greedy otherwise."""
        warpers = (self.temperature not in (None, 1.0)) or self.top_k is not None or self.top_p is not None
        return self.do_sample or warpers

    def to_sampling_params(self, settings: Settings) -> SamplingParams:
        """TGI semantics: greedy unless sampling (above); a sampled request without a seed gets one drawn
        here, so details.seed can report it; logprobs when details or top_n_tokens are asked for."""
        greedy = not self.sampling
        seed = self.seed if greedy or self.seed is not None else secrets.randbelow(2**63)
        return SamplingParams(
            max_new_tokens=min(self.max_new_tokens, settings.max_new_tokens_cap),
            temperature=0.0 if greedy else (self.temperature or 1.0),
            top_k=None if greedy else self.top_k,
            top_p=None if greedy else self.top_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=list(self.stop),
            seed=None if greedy else seed,
            logit_bias=dict(self.logit_bias),
            logprobs=self.details or self.top_n_tokens is not None,
            top_logprobs=self.top_n_tokens or 0,
            **self.eos_params(settings),
        )

    @field_validator("watermark")
    @classmethod
    def _no_watermark(cls, v: bool) -> bool:
        if v:
            raise ValueError("watermarking is not supported")
        return v

    @field_validator("typical_p")
    @classmethod
    def _no_typical(cls, v: float | None) -> float | None:
        if v is not None:
            raise ValueError("typical_p is not supported")
        return v


class GenerateRequest(RequestModel):
    inputs: Text = Field(..., min_length=1, description="The prompt.")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="POST / only (TGI compatibility route): stream server-sent events.")


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = Field(None, description="The seed the sampler used (drawn when none was given); null if greedy")
    prefill: list[Token] = []
    tokens: list[Token] = []
    top_tokens: list[list[Token]] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None


class StreamResponse(BaseModel):
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None
