"""The `steer` field (our extension) of /generate's parameters, /v1/completions, /v1/chat/completions and
/v1/responses: activation steering per request (server/features/steering.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, model_validator

from model_store.control_vectors import NAME
from server.api.schemas.base import RequestModel, Text
from server.features.steering import MAX_PARTS

MAX_WIDTH = 16_384  # a vector's values at most: wider than any residual stream served here
MAX_PAIRS = 256
VectorName = Annotated[str, StringConstraints(pattern=f"^{NAME.pattern}$")]


class SteerPart(RequestModel):
    layer: int | None = Field(
        None,
        description="Add after this block, counted from 0 as llama.cpp's direction.N (1..n_layer-1). With a name: "
        "only that block's direction (default: all the vector's).",
    )
    vector: list[float] | None = Field(
        None, min_length=1, max_length=MAX_WIDTH, description="The direction, d_model values."
    )
    name: VectorName | None = Field(
        None, description="A named vector of the model (GET /inspect/steering-vectors lists them)."
    )
    scale: float = Field(1.0, allow_inf_nan=False, description="Multiplies the vector (negative: the opposite way).")

    @model_validator(mode="after")
    def one_source(self) -> SteerPart:
        if (self.vector is None) == (self.name is None):
            raise ValueError("give exactly one of vector and name")
        return self


class Steered(RequestModel):
    steer: list[SteerPart] | None = Field(
        None,
        max_length=MAX_PARTS,
        description="Activation steering: each part's vector times its scale added to the residual stream after its "
        "block, at every position of the request (prompt and generated).",
    )


class ContrastPair(RequestModel):
    positive: Text = Field(..., min_length=1, description="A prompt of the behaviour to steer towards.")
    negative: Text = Field(..., min_length=1, description="Its contrast: the same prompt the other way.")


class SteeringVectorRequest(RequestModel):
    model: str | None = Field(None, description="A completion model on the decoder (default: the first).")
    pairs: list[ContrastPair] = Field(..., min_length=1, max_length=MAX_PAIRS)
    layers: list[int] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="[first, last] blocks to make a direction for, as `steer`'s layer (default: all, 1..n-1).",
    )
    method: Literal["mean", "pca"] = Field(
        "mean",
        description="mean: the mean difference of the residual streams at the pairs' last tokens (contrastive "
        "activation addition); pca: the differences' first principal component (repeng).",
    )
    name: VectorName | None = Field(
        None, description="Keep the vector under this name for the model (in memory): `steer` may then name it."
    )


class SteeringVectorResponse(BaseModel):
    model: str
    name: str | None
    method: str
    layers: dict[int, list[float]] = Field(description="block -> its direction (d_model values)")


class VectorList(BaseModel):
    model: str
    vectors: list[str] = Field(description="its named vectors: the store's files and those made here")
