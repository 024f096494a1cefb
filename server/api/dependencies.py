"""FastAPI dependencies for shared state. Coroutines: FastAPI runs a plain function dependency on its
thread pool, a thread hop per request for an attribute read."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.config import Settings
from server.features.responses import ResponseStore
from server.serving.registry import ModelRegistry


async def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_responses(request: Request) -> ResponseStore:
    return request.app.state.responses


Registry = Annotated[ModelRegistry, Depends(get_registry)]
Responses = Annotated[ResponseStore, Depends(get_responses)]
AppSettings = Annotated[Settings, Depends(get_settings)]
