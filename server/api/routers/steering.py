"""Steering vectors: made from contrasting prompts, listed, and exported as llama.cpp's control-vector files
(server/features/inspect.py makes them; `steer` on the completion routes adds them: server/features/steering.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fastapi import APIRouter, Query, Response
from starlette.concurrency import run_in_threadpool

from model_store.control_vectors import write_control_vector
from server.api.dependencies import AppSettings, Registry
from server.api.schemas.steering import SteeringVectorRequest, SteeringVectorResponse, VectorList, VectorName
from server.errors import APIError
from server.features import inspect as inspecting
from server.features.completion import find_model

router = APIRouter(prefix="/inspect", tags=["looking inside"])


@router.post("/steering-vector", response_model=SteeringVectorResponse)
async def steering_vector(body: SteeringVectorRequest, registry: Registry, settings: AppSettings) -> dict:
    """A direction per block from contrasting prompt pairs; kept under `name` for `steer` to name."""
    m = find_model(registry, body.model, "causal", "model")
    pairs = [(p.positive, p.negative) for p in body.pairs]
    blocks = tuple(body.layers) if body.layers is not None else None
    made = await run_in_threadpool(
        inspecting.steering_vector, registry.compute, m, pairs, blocks, body.method, settings
    )
    if body.name is not None:
        registry.vectors.add(m.id, body.name, made)
    layers = {block: v.tolist() for block, v in made.items()}
    return {"model": m.id, "name": body.name, "method": body.method, "layers": layers}


@router.get("/steering-vectors", response_model=VectorList)
async def steering_vectors(registry: Registry, model: str | None = None) -> dict:
    """The model's named vectors."""
    m = find_model(registry, model, "causal", "model")
    return {"model": m.id, "vectors": registry.vectors.names(m.id, m.folder)}


@router.get("/steering-vector/{name}.gguf", response_class=Response)
async def control_vector_file(name: VectorName, registry: Registry, model: str | None = Query(None)) -> Response:
    """A named vector as llama.cpp's control-vector file (`llama-server --control-vector FILE`)."""
    m = find_model(registry, model, "causal", "model")
    directions = registry.vectors.get(m.id, m.folder, name)
    if directions is None:
        raise APIError(404, f"name: model {m.id} has no vector {name!r}", "name", "not_found")
    with tempfile.TemporaryDirectory() as scratch:
        path = write_control_vector(Path(scratch) / "v.gguf", directions, m.id, m.facts.layers)
        data = path.read_bytes()
    headers = {"Content-Disposition": f'attachment; filename="{name}.gguf"'}
    return Response(data, media_type="application/octet-stream", headers=headers)
