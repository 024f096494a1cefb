"""FastAPI dependencies for shared state."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.config import Settings
from server.registry import ModelRegistry


def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


Registry = Annotated[ModelRegistry, Depends(get_registry)]
AppSettings = Annotated[Settings, Depends(get_settings)]
