"""Server-sent events for the streaming routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse

from server.config import Settings


def sse_response(stream: AsyncIterator[dict], settings: Settings) -> EventSourceResponse:
    """Server-sent events that outlive a SIGTERM: sse-starlette ends every stream at once on shutdown
    unless given a grace period, and a drain must let in-flight generations finish."""
    return EventSourceResponse(stream, ping=15, shutdown_grace_period=settings.shutdown_grace_s)
