"""Steering a request: its `steer` parts ({layer, vector | name, scale}) checked against the model and summed into
the one (n_layer, C) tensor every pass adds after its blocks (models/steering.py).

`layer` is llama.cpp's N of `direction.N`: added to the residual stream after block N, counted from 0, so 1 is
after the second block and N runs 1..n_layer-1 (llama.cpp rejects 0: its block 0 output takes no vector). A named
vector without a layer adds every direction it has, as llama.cpp applies a control-vector file."""

from __future__ import annotations

import math
from typing import Protocol

import torch

from models.steering import Steer
from server.errors import APIError
from server.serving.registry import ModelRegistry, ServedModel

MAX_PARTS = 64


class SteerPart(Protocol):  # server/api/schemas/steering.py's, or the Cog input's
    layer: int | None
    vector: list[float] | None
    name: str | None
    scale: float


def steer_of(registry: ModelRegistry, m: ServedModel, parts: list[SteerPart] | None, field: str) -> Steer | None:
    """The request's steering, or None; 4xx naming the part's field where a part does not fit the model."""
    if not parts:
        return None
    facts = m.runner.facts if m.runner is not None else None
    if facts is None or not facts.steer_width:
        raise APIError(422, f"{field}: model {m.id} cannot be steered (its family runs in transformers)", field)
    layers, width = facts.layers, facts.steer_width
    added = []
    for i, part in enumerate(parts):
        at = f"{field}[{i}]"
        if not math.isfinite(part.scale):
            raise APIError(422, f"{at}.scale: must be a finite number", f"{at}.scale")
        if part.name is not None:
            directions = registry.vectors.get(m.id, m.folder, part.name)
            if directions is None:
                known = ", ".join(registry.vectors.names(m.id, m.folder)) or "none"
                raise APIError(
                    404,
                    f"{at}.name: model {m.id} has no vector {part.name!r} (it has: {known})",
                    f"{at}.name",
                    "not_found",
                )
            if part.layer is not None:
                if part.layer not in directions:
                    have = sorted(directions)
                    raise APIError(422, f"{at}.layer: vector {part.name!r} has blocks {have}", f"{at}.layer")
                directions = {part.layer: directions[part.layer]}
        else:
            if part.layer is None:
                raise APIError(422, f"{at}.layer: a vector needs the block it is added after", f"{at}.layer")
            directions = {part.layer: torch.tensor(part.vector, dtype=torch.float32)}
        for layer, vector in directions.items():
            if not 1 <= layer < layers:
                rule = f"1..{layers - 1} (added after that block, counted from 0, as llama.cpp's direction.N)"
                raise APIError(
                    422, f"{at}.layer: {layer} is out of range; model {m.id}'s blocks are {rule}", f"{at}.layer"
                )
            if vector.numel() != width:
                what = f"{at}.name" if part.name is not None else f"{at}.vector"
                raise APIError(
                    422, f"{what}: {vector.numel()} values; model {m.id}'s residual stream is {width} wide", what
                )
            if not torch.isfinite(vector).all():
                raise APIError(422, f"{at}.vector: every value must be finite", f"{at}.vector")
            added.append((layer, vector, part.scale))
    return Steer.added(layers, width, added)
