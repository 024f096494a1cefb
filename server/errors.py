"""Every client error is a 4xx JSON body that names the field and the rule: {"error", "error_type", "field"}."""

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


def _field_name(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.error_type, exc.field), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _field_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message = f"malformed JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        else:
            message = f"{field}: {first['msg']}"
        details = [{"field": _field_name(tuple(e.get("loc", ()))), "rule": e.get("msg", "")} for e in errors]
        return JSONResponse({**error_body(message, "validation", field), "details": details}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "http"), exc.status_code, headers=getattr(exc, "headers", None))
