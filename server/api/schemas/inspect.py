"""The logit lens, head ablation and activation patching (server/features/inspect.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.api.schemas.base import RequestModel, Text


class LogitLensRequest(RequestModel):
    model: str | None = Field(
        None, description="Any served model on the decoder, or a fill-mask model (default: the first completion model)."
    )
    text: Text = Field(..., min_length=1, description="The text, read as /attention reads it (nothing put in front).")
    top_k: int = Field(5, ge=1, le=10, description="Predictions per layer and position.")


class Prediction(BaseModel):
    id: int
    token: str
    prob: float


class LogitLensResponse(BaseModel):
    model: str
    tokens: list[str]
    layers: list[list[list[Prediction]]] = Field(
        description="n_layer + 1 entries (after the embedding, then after each block), each per position the "
        "top_k predictions of the model's final norm and unembedding applied to that residual stream; the last "
        "is the model's own prediction"
    )


class AblateRequest(RequestModel):
    model: str | None = Field(None, description="A completion model on the decoder (default: the first).")
    text: Text = Field(..., min_length=1, description="The text; the next token after it is what is compared.")
    heads: list[list[int]] | Literal["each"] = Field(  # each pair checked against the model (features/inspect.py)
        ..., description='[[layer, head], ...] ablated together (at most 256), or "each": every head alone.'
    )
    top_k: int = Field(5, ge=1, le=10, description="Predictions shown with and without the heads.")


class AblateResponse(BaseModel):
    model: str
    tokens: list[str]
    base: list[Prediction] = Field(description="the next-token prediction with every head")
    ablated: list[Prediction] | None = Field(None, description="with the heads zeroed before the output projection")
    kl: float | None = Field(None, description="KL(base || ablated) in nats")
    each: list[list[float]] | None = Field(
        None, description='heads "each": KL(base || that head ablated) per layer and head'
    )


class PatchRequest(RequestModel):
    model: str | None = Field(None, description="A completion model on the decoder (default: the first).")
    clean: Text = Field(..., min_length=1, description="The clean text.")
    corrupt: Text = Field(..., min_length=1, description="The corrupted text: as many tokens as the clean one.")
    answer: Text = Field(..., min_length=1, description="One token: the clean run's answer (e.g. ' Paris').")
    foil: Text = Field(..., min_length=1, description="One token: the corrupt run's answer.")


class PatchResponse(BaseModel):
    model: str
    tokens: list[str] = Field(description="the corrupt text's tokens")
    clean: float = Field(description="logit(answer) - logit(foil) at the last position of the clean run")
    corrupt: float = Field(description="the same for the corrupt run")
    grid: list[list[float]] = Field(
        description="per layer and position: the corrupt run's metric with the residual stream before that block "
        "at that position replaced by the clean run's (resid_pre patching)"
    )
