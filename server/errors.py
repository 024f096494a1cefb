"""Every client error is a 4xx JSON body that names the field and the rule: {"error", "error_type", "field"}.

Under /v1 (the OpenAI-compatible API) the same error has OpenAI's shape, which its clients and tools
parse: {"error": {"message", "type", "param", "code"}}, and OpenAI's status: an invalid request is a 400
there (as in vLLM's server), where the rest of the API says 422.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        error_type: str = "validation",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.error_type, self.headers = (
            status,
            message,
            field,
            error_type,
            headers,
        )


def error_body(message: str, error_type: str, field: str | None = None) -> dict:
    return {"error": message, "error_type": error_type, "field": field}


def openai_error_body(message: str, error_type: str, field: str | None, status: int) -> dict:
    """OpenAI's error object: `type` by status class, our error type as `code`, the field as `param`."""
    kind = "server_error" if status >= 500 else "rate_limit_error" if status == 429 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": field, "code": error_type}}


def error_payload(path: str, status: int, message: str, error_type: str, field: str | None = None, **extra) -> dict:
    """The error in the shape its API speaks: OpenAI's under /v1, ours elsewhere."""
    if path.startswith("/v1/"):
        return openai_error_body(message, error_type, field, status)
    return {**error_body(message, error_type, field), **extra}


def error_response(request: Request, status: int, message: str, error_type: str, field: str | None = None,
                   headers: dict[str, str] | None = None, **extra) -> JSONResponse:  # fmt: skip
    if status == 422 and request.url.path.startswith("/v1/"):
        status = 400
    body = error_payload(request.url.path, status, message, error_type, field, **extra)
    return JSONResponse(body, status, headers=headers)


UNION_TAGS = {"str", "int", "float", "bool", "none"}  # how pydantic names a union's member in an error's loc


def _field_name(loc: tuple) -> str:
    """The field as the client wrote it: no request part, no union member (`heads.list[list[int]]` is `heads`)."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    parts = [p for p in parts if "[" not in p and p not in UNION_TAGS]
    return ".".join(parts) or "body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc.status, exc.message, exc.error_type, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _field_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message = f"malformed JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        else:
            message = f"{field}: {first['msg']}"
        details = [{"field": _field_name(tuple(e.get("loc", ()))), "rule": e.get("msg", "")} for e in errors]
        return error_response(request, 422, message, "validation", field, details=details)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail), "http", None, getattr(exc, "headers", None))
