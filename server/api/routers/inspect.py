"""POST /inspect/logit-lens, /inspect/ablate, /inspect/patch: looking inside a model (server/features/inspect.py)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from server.api.dependencies import AppSettings, Registry
from server.api.schemas.inspect import (
    AblateRequest,
    AblateResponse,
    LogitLensRequest,
    LogitLensResponse,
    PatchRequest,
    PatchResponse,
)
from server.features import inspect as inspecting
from server.features.completion import find_model

router = APIRouter(prefix="/inspect", tags=["looking inside"])


@router.post("/logit-lens", response_model=LogitLensResponse)
async def logit_lens(body: LogitLensRequest, registry: Registry, settings: AppSettings) -> dict:
    """What each layer would predict: its residual stream through the model's final norm and unembedding."""
    m = find_model(registry, body.model, None if body.model else "causal", "model")
    return await run_in_threadpool(inspecting.logit_lens, registry.compute, m, body.text, body.top_k, settings)


@router.post("/ablate", response_model=AblateResponse, response_model_exclude_none=True)
async def ablate(body: AblateRequest, registry: Registry, settings: AppSettings) -> dict:
    """The next-token distribution with and without some heads (or each head alone)."""
    m = find_model(registry, body.model, "causal", "model")
    return await run_in_threadpool(inspecting.ablate, registry.compute, m, body.text, body.heads, body.top_k, settings)


@router.post("/patch", response_model=PatchResponse)
async def patch(body: PatchRequest, registry: Registry, settings: AppSettings) -> dict:
    """Which layer and position carry what changes the answer: resid_pre activation patching."""
    m = find_model(registry, body.model, "causal", "model")
    return await run_in_threadpool(
        inspecting.patch, registry.compute, m, body.clean, body.corrupt, body.answer, body.foil, settings
    )
