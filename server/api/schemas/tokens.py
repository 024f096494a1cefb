"""POST /tokenize and POST /detokenize, in vLLM's shapes."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from server.api.schemas.base import RequestModel, Text


class TokenizeRequest(RequestModel):
    model: str | None = Field(None, description="A completion model (default: the first).")
    prompt: Text | None = Field(None, min_length=1, description="The text to tokenize (vLLM's name for it).")
    text: Text | None = Field(None, min_length=1, description="The text to tokenize (the same as `prompt`).")

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.text is None):
            raise ValueError("give exactly one of prompt (vLLM's name) or text")
        return self

    @property
    def content_field(self) -> str:
        return "prompt" if self.prompt is not None else "text"

    @property
    def content(self) -> str:
        return self.prompt if self.prompt is not None else self.text


class TokenizeResponse(BaseModel):
    tokens: list[int]
    token_strs: list[str] = Field(description="each token's own text")
    count: int


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, description="A completion model (default: the first).")
    tokens: list[int] = Field(..., max_length=100_000)


class DetokenizeResponse(BaseModel):
    prompt: str
