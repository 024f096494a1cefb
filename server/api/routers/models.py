"""GET /models, /models/{id} (and its card as HTML with its images), /health, /info, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.api.dependencies import AppSettings, Registry
from server.api.schemas.models import INFO_SETTINGS, Health, Info, ModelCard, ModelList, ModelSummary
from server.errors import APIError
from server.features.chat import chats
from server.features.completion import find_model
from server.serving.model_card import IMAGE_TYPES, card_image, render_html
from server.serving.registry import ServedModel

router = APIRouter(tags=["models and service"])

TASKS = {"causal": ["generate", "completions", "score", "attention"], "mlm": ["fill-mask", "attention"]}


def summary(m: ServedModel) -> ModelSummary:
    return ModelSummary(
        id=m.id,
        kind=m.kind,
        tasks=TASKS[m.kind] + (["chat"] if chats(m) else []),
        attention=m.facts.normaliser,
        attention_settings=m.facts.attention_settings,
        parameters=m.facts.parameters,
        layers=m.facts.layers,
        heads=m.facts.heads,
        context_length=m.facts.context_length,
        weights=m.facts.weights,
    )


@router.get("/models", response_model=ModelList)
async def list_models(registry: Registry) -> ModelList:
    """Every served model with its task list and attention variant, and the checkpoints refused at start-up."""
    return ModelList(data=[summary(m) for m in registry.models.values()], failed=registry.failed)


@router.get("/models/{model_id}", response_model=ModelCard)
async def get_model(model_id: str, registry: Registry) -> ModelCard:
    """A model's summary, configuration and model card (markdown)."""
    m = find_model(registry, model_id, None, "model_id")
    return ModelCard(**summary(m).model_dump(), config=m.facts.config, card=m.card)


@router.get("/models/{model_id}/card", response_class=HTMLResponse)
async def get_model_card(model_id: str, registry: Registry) -> HTMLResponse:
    """The model card rendered as an HTML fragment (raw HTML escaped); its images point at the route below."""
    m = find_model(registry, model_id, None, "model_id")
    return HTMLResponse(render_html(m.card, lambda name: f"/models/{m.id}/card/{name}"))


@router.get(
    "/models/{model_id}/card/{name}", response_class=FileResponse, responses={200: {"content": {"image/png": {}}}}
)
async def get_model_card_image(model_id: str, name: str, registry: Registry) -> FileResponse:
    """An image the model card links to (its loss curve); no other file of the store is served."""
    m = find_model(registry, model_id, None, "model_id")
    path = card_image(m.folder, m.card, name)
    if path is None:
        raise APIError(
            404, f"name: {name!r} is not an image that the model card of {m.id!r} links to", "name", "not_found"
        )
    return FileResponse(path, media_type=IMAGE_TYPES[path.suffix.lower()])


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(request: Request, registry: Registry) -> JSONResponse:
    """200 once the default model (ready_after="all": every model; "compiled": and their compiled steps) is
    loaded and warmed up, 503 before; lists the models loading behind it, those compiling, and refused
    checkpoints."""
    ready = bool(getattr(request.app.state, "ready", False))
    loading = list(registry.loading)  # before models, as the registry reads them
    body = Health(
        status="ok" if ready else "loading",
        models=list(registry.models),
        failed=registry.failed,
        loading=loading,
        compiling=registry.compiling(),
    )
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/info", response_model=Info)
async def info(registry: Registry, settings: AppSettings) -> Info:
    """Service limits and devices (TGI's /info, extended)."""
    devices = sorted({str(next(m.model.parameters()).device) for m in registry.models.values()})
    models = registry.models.values()
    return Info(
        **settings.model_dump(include=set(INFO_SETTINGS)),
        models=list(registry.models),
        devices=devices,
        auth=settings.api_token is not None,
        kv_cache_bytes={m.id: m.facts.kv_cache_bytes for m in models if m.runner},
        kv_pool={m.id: m.engine.kv.pool.describe() for m in models if m.engine is not None and m.engine.kv.pool},
        context={m.id: m.facts.context_length for m in models if m.runner},
        weights={m.id: m.facts.weights for m in models if m.runner},
        compile_seconds={m.id: m.compiler.build_seconds() for m in models if m.compiler},
        compile_states={m.id: m.compiler.states() for m in models if m.compiler},
        placement=registry.placement.describe(),
    )


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
