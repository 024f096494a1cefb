"""Scoring, attention maps and fill-mask."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.api.schemas.base import RequestModel, Text


class ScoreRequest(RequestModel):
    model: str | None = Field(None, description="A completion model (default: the first).")
    text: Text = Field(
        ..., min_length=1, description="Text to score, read as a new document: every token is predicted."
    )
    top_n_tokens: int = Field(0, ge=0, le=10, description="Also return this many most likely alternatives per token.")


class ScoredToken(BaseModel):
    id: int
    text: str
    logprob: float = Field(description="log p(token | previous tokens); the first token follows the end-of-text token")
    top_tokens: list[tuple[str, float]] = []


class ScoreResponse(BaseModel):
    model: str
    tokens: list[ScoredToken]
    loss: float = Field(description="mean negative log-likelihood per scored token (nats)")
    perplexity: float
    scored_tokens: int


class AttentionRequest(RequestModel):
    model: str = Field(..., description="Any served model (completion or fill-mask).")
    text: Text = Field(..., min_length=1, description="Sentence whose attention to show.")
    layers: list[int] | None = Field(None, min_length=1, max_length=64, description="Layer indices (default: all).")
    heads: list[int] | None = Field(None, min_length=1, max_length=64, description="Head indices (default: all).")
    format: Literal["json", "png"] = Field("json", description="json (bertviz shape) or a PNG heatmap grid.")


class AttentionResponse(BaseModel):
    model: str
    attention_variant: str
    tokens: list[str]
    layers: list[int]
    heads: list[int]
    attention: list[list[list[list[list[float]]]]] = Field(
        description="per selected layer: [1][heads][query][key], as bertviz's head_view(attention, tokens) takes"
    )
    row_sums: list[list[float]] = Field(
        description="per layer and head: mean row sum (< 1 where softmax1 attends to nothing)"
    )


class FillMaskRequest(RequestModel):
    inputs: Text = Field(..., min_length=1, description="Text with one or more <mask> tokens.")
    model: str | None = Field(None, description="A fill-mask model id; default: chosen by `variant`.")
    variant: Literal["softmax0", "softmax1", "both"] = Field(
        "softmax0", description="Which EsperBERTo, or both side by side."
    )
    top_k: int = Field(5, ge=1, le=50)
    targets: list[str] | None = Field(None, max_length=100, description="Only score these candidate words.")


class FillMaskCandidate(BaseModel):
    score: float
    token: int
    token_str: str
    sequence: str


FillMaskResult = list[FillMaskCandidate] | list[list[FillMaskCandidate]]


class FillMaskResponse(BaseModel):
    results: dict[str, FillMaskResult] = Field(
        description="model id -> the transformers fill-mask pipeline's output (a list per mask when several)"
    )
