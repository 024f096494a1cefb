"""The FastAPI application: `uvicorn server.api.app:app` or `python -m server`."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from server.api.metrics import Metrics
from server.api.middleware import BearerAuth, BodySizeLimit, RequestMetrics
from server.api.routers import (
    chat,
    completions,
    demo,
    generate,
    inspect,
    models,
    readouts,
    responses,
    steering,
    tokens,
)
from server.config import Settings
from server.errors import install_error_handlers
from server.features.responses import ResponseStore
from server.serving.registry import ModelRegistry

log = logging.getLogger("tinyserve")


def create_app(settings: Settings | None = None, registry: ModelRegistry | None = None) -> FastAPI:
    """The app over `registry` (by default a new one over `settings`), which loads its models at start-up."""
    registry = registry or ModelRegistry(settings or Settings())
    settings = registry.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        registry.load_all()
        registry.start()  # engines + warm-up
        if settings.ready_after == "compiled":  # not ready while requests would run uncompiled
            await asyncio.to_thread(registry.compiled.wait)
        app.state.ready = True
        log.info("ready: %s (refused: %s)", sorted(registry.models), sorted(registry.failed) or "none")
        yield
        app.state.ready = False
        registry.stop()

    app = FastAPI(
        title="tinyserve",
        summary="Small transformers behind an API: completion (TGI and OpenAI formats), fill-mask, attention maps.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings, app.state.registry, app.state.ready = settings, registry, False
    app.state.responses = ResponseStore(settings.responses_kept, settings.responses_kept_mb)
    app.state.metrics = metrics = Metrics(lambda: registry.models)
    install_error_handlers(app)
    app.include_router(models.router)
    app.include_router(generate.router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(tokens.router)
    app.include_router(readouts.router)
    app.include_router(inspect.router)
    app.include_router(steering.router)
    app.include_router(demo.router)
    app.mount("/static", StaticFiles(directory=demo.STATIC_DIR), name="static")

    # each add wraps the ones before it: auth innermost, then the size cap, then CORS (so preflights and
    # 401s carry CORS headers), metrics outermost (so 401s and 413s are counted too)
    if settings.api_token is not None:
        app.add_middleware(BearerAuth, token=settings.api_token.get_secret_value(), exempt=settings.auth_exempt)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


def __getattr__(name: str):
    """`uvicorn server.api.app:app` builds the app from the environment on first access."""
    if name == "app":
        global app
        app = create_app()
        return app
    raise AttributeError(name)
