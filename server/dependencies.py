"""FastAPI dependencies for shared state."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.config import Settings
from server.errors import APIError
from server.registry import ModelRegistry, ServedModel, UnknownModelError


def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


Registry = Annotated[ModelRegistry, Depends(get_registry)]
AppSettings = Annotated[Settings, Depends(get_settings)]


def find_model(registry: ModelRegistry, model_id: str | None, kind: str, field: str) -> ServedModel:
    """The requested model, or the default one of that kind; unknown ids are 404s naming the field."""
    try:
        return registry.get(model_id, kind) if model_id is not None else registry.default(kind)
    except UnknownModelError as e:
        raise APIError(404, f"{field}: {e}", field, "not_found") from None
