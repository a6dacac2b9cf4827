"""Every error in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``; bad input never gets a 500."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from twophase.engine.async_engine import EngineDeadError
from twophase.engine.scheduler import QueueFullError
from twophase.sampling_params import InvalidRequestError

logger = logging.getLogger("twophase.server")

RETRY_AFTER_S = 1
# pydantic's names for union members and validators in an error's loc (not field names)
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|(list|dict|union|nullable|tagged-union|function-\w+|"
                       r"json-or-python|lax-or-strict)\[.*\])$")
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
    503: "service_unavailable",
}  # fmt: skip


class APIError(Exception):
    """An error with an HTTP status, rendered in the OpenAI envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying the envelope."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map engine and validation exceptions to API errors (used for pre-stream and in-stream errors)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, exc.param, "invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(503, f"server overloaded: {exc}; retry later", None, "queue_full",
                        {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), None, "engine_dead", {"Retry-After": str(RETRY_AFTER_S)})
    logger.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", None, "internal_error")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body"]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not _TYPE_TAG.match(str(part)):
            text += ("." if text else "") + str(part)
    return text or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = _loc_to_param(tuple(first.get("loc", ())))
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so every failure leaves in the envelope."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    for kind in (InvalidRequestError, QueueFullError, EngineDeadError):
        app.add_exception_handler(kind, _engine_error)
    app.add_exception_handler(Exception, _engine_error)


async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
    error = to_api_error(exc)
    return error_response(error.status, error.message, error.param, error.code, error.headers)
