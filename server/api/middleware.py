"""Pure-ASGI middleware: request metrics, request body size cap and optional bearer-token auth.

Pure ASGI rather than `@app.middleware("http")`: that wrapper relays every streamed chunk through an
extra task and memory stream, and its `call_next` returns when the headers are sent, not the body.
"""

from __future__ import annotations

import json
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.metrics import Metrics
from server.errors import error_payload


async def _reject(
    scope: Scope, send: Send, status: int, message: str, error_type: str, headers: list | None = None
) -> None:
    body = json.dumps(error_payload(scope["path"], status, message, error_type)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestMetrics:
    """Counts requests by route and status and observes their latency to the end of the response
    (a stream's last event, not its headers)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = scope.get("route")
            path = route.path if route is not None else "unmatched"  # bounded label values
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


class BodySizeLimit:
    """413 for bodies over the cap, whether announced by Content-Length or streamed in chunks."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _reject(scope, send, 413, f"request body over {self.max_bytes} bytes", "too_large")
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except BodyTooLarge:
            await _reject(scope, send, 413, f"request body over {self.max_bytes} bytes", "too_large")


class BodyTooLarge(Exception):
    pass


class BearerAuth:
    """When a token is configured, every path but the exempt ones needs `Authorization: Bearer <token>`.

    The demo page's own files (GET / and /static/) are public: they hold no data, and the calls the
    page makes to the API carry the token the user types into it.
    """

    def __init__(self, app: ASGIApp, token: str, exempt: list[str]) -> None:
        self.app, self.token, self.exempt = app, token.encode(), set(exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt or scope["method"] == "OPTIONS" or _demo(scope):
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.token):
            return await _reject(
                scope,
                send,
                401,
                "missing or wrong bearer token (header Authorization: Bearer <token>)",
                "unauthorized",
                [(b"www-authenticate", b"Bearer")],
            )
        await self.app(scope, receive, send)


def _demo(scope: Scope) -> bool:
    return scope["method"] in ("GET", "HEAD") and (scope["path"] == "/" or scope["path"].startswith("/static/"))
