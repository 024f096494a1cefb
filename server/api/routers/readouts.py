"""POST /score, POST /attention, POST /fill-mask: their forward passes run on the compute thread."""

from __future__ import annotations

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from server.api.dependencies import Registry
from server.api.schemas.readouts import (
    AttentionRequest,
    AttentionResponse,
    FillMaskRequest,
    FillMaskResponse,
    ScoreRequest,
    ScoreResponse,
)
from server.features import readouts
from server.features.completion import fill_mask_models, find_model

router = APIRouter(tags=["inspection"])


@router.post("/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, registry: Registry) -> dict:
    """Per-token log-probabilities, mean loss and perplexity of a text under a completion model."""
    m = find_model(registry, body.model, "causal", "model")
    return await registry.compute.run(readouts.score, m, body.text, body.top_n_tokens)


PNG_RESPONSE = {200: {"content": {"image/png": {}}, "description": "JSON, or a PNG when format=png"}}


@router.post("/attention", response_model=AttentionResponse, responses=PNG_RESPONSE)
async def attention(body: AttentionRequest, registry: Registry):
    """Attention weights per layer and head for any served model, as JSON (bertviz shape) or a PNG grid."""
    m = find_model(registry, body.model, None, "model")
    result = await registry.compute.run(readouts.attention, m, body.text, body.layers, body.heads)
    if body.format == "png":  # drawing is not torch work: a worker thread, off the event loop
        return Response(await run_in_threadpool(readouts.attention_png, result), media_type="image/png")
    w = result.pop("weights")
    result["attention"] = [[layer.tolist()] for layer in w]  # (L, 1, H, T, T)
    result["row_sums"] = w.sum(-1).mean(-1).tolist()
    return result


@router.post("/fill-mask", response_model=FillMaskResponse)
async def fill_mask(body: FillMaskRequest, registry: Registry) -> dict:
    """Fill <mask> tokens; `variant: both` answers with softmax0 and softmax1 side by side."""
    models = fill_mask_models(registry, body.model, body.variant)
    results = {}
    for m in models:
        results[m.id] = await registry.compute.run(readouts.fill_mask, m, body.inputs, body.top_k, body.targets)
    return {"results": results}
