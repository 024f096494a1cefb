"""POST /tokenize and POST /detokenize, in vLLM's shapes."""

from __future__ import annotations

from pydantic import BaseModel, Field

from server.api.schemas.base import RequestModel, Text


class TokenizeRequest(RequestModel):
    model: str | None = Field(None, description="A completion model (default: the first).")
    text: Text = Field(..., min_length=1)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    token_strs: list[str] = Field(description="each token's own text")
    count: int


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, description="A completion model (default: the first).")
    tokens: list[int] = Field(..., max_length=100_000)


class DetokenizeResponse(BaseModel):
    prompt: str
