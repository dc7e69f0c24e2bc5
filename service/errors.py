"""Typed service errors and the one place that turns any error into an HTTP response.

Every response that is not a success has the body `{"error": "...", "error_type": "..."}`.
Each error type maps to exactly one status in `_STATUS`; unexpected exceptions become a 500
with a fixed message and no trace (the trace goes to the log).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

MAX_ERRORS_SHOWN = 3
MAX_NAME_CHARS = 64  # a client's field, parameter or tensor name quoted in a message
MAX_MESSAGE_CHARS = 1000


def shorten(name: object, limit: int = MAX_NAME_CHARS) -> str:
    """`name` as text of at most `limit` characters (cut with "..." and its length): a message
    may quote what the client sent, never all of it."""
    text = str(name)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class ServiceError(Exception):
    """Base of the errors the service answers with; `error_type` names it in the body."""

    error_type = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        """Extra response headers (none by default)."""
        return {}


class InvalidInput(ServiceError):
    """The request is well-formed JSON but breaks a limit or a rule."""

    error_type = "invalid_input"


class PayloadTooLarge(ServiceError):
    """The request body is larger than the configured limit."""

    error_type = "payload_too_large"


class ModelNotFound(ServiceError):
    """No model of that name (or none for the route's task)."""

    error_type = "model_not_found"


class Overloaded(ServiceError):
    """The model's queue is full; the client should retry after `retry_after_s`."""

    error_type = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class NotReady(ServiceError):
    """The model (or the server) is loading, failed to load, or is draining for shutdown."""

    error_type = "not_ready"


class DeadlineExceeded(ServiceError):
    """The request did not finish within its deadline."""

    error_type = "deadline_exceeded"


class Unauthorized(ServiceError):
    """The route needs the server's bearer token and the request lacks it or has another."""

    error_type = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="attnserve"'}


class ClientDisconnected(ServiceError):
    """The client went away while its request waited; nobody reads the answer (499)."""

    error_type = "client_disconnected"


class InternalError(ServiceError):
    """Inference failed; the message says so without details (those are logged)."""

    error_type = "internal"


# The one mapping from error type to HTTP status.
_STATUS: dict[type[ServiceError], int] = {
    InvalidInput: 422,
    Unauthorized: 401,
    PayloadTooLarge: 413,
    ModelNotFound: 404,
    Overloaded: 429,
    NotReady: 503,
    DeadlineExceeded: 504,
    ClientDisconnected: 499,  # nginx's "client closed request": logged, never read
    InternalError: 500,
}

# error_type of the statuses Starlette raises itself (unknown route, wrong method, ...).
_HTTP_ERROR_TYPES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def status_of(error: ServiceError) -> int:
    """The HTTP status of a service error (500 for an unmapped subclass)."""
    for cls in type(error).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


def error_response(
    status_code: int, message: str, error_type: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """A response with the one error body."""
    return JSONResponse(
        {"error": message, "error_type": error_type}, status_code=status_code, headers=headers
    )


def describe_validation_errors(errors: Any) -> str:
    """A short message from pydantic errors: where and what, never the input itself; names in
    the location (an unknown field's) are shortened (`shorten`)."""
    parts = []
    for error in list(errors)[:MAX_ERRORS_SHOWN]:
        location = ".".join(shorten(part) for part in error.get("loc", ()) if part != "body")
        message = str(error.get("msg", "invalid value"))
        parts.append(f"{location}: {message}" if location else message)
    extra = len(list(errors)) - MAX_ERRORS_SHOWN
    if extra > 0:
        parts.append(f"and {extra} more")
    return shorten("; ".join(parts), MAX_MESSAGE_CHARS) or "invalid request"


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return error_response(status_of(exc), exc.message, exc.error_type, exc.headers())


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, describe_validation_errors(exc.errors()), InvalidInput.error_type)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, str(exc.detail), error_type, exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal error", InternalError.error_type)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the one body shape."""
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
