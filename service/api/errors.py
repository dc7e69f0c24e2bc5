"""The one place that turns any error into an HTTP response.

Every response that is not a success has the body `{"error": "...", "error_type": "..."}`.
Each error type maps to exactly one status in `_STATUS`; unexpected exceptions become a 500
with a fixed message and no trace (the trace goes to the log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from service.api.request_id import HEADER as REQUEST_ID_HEADER
from service.core.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    InvalidInput,
    ModelNotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    shorten,
)

logger = logging.getLogger(__name__)

MAX_ERRORS_SHOWN = 3
MAX_MESSAGE_CHARS = 1000


# The one mapping from error type to HTTP status.
_STATUS: dict[type[ServiceError], int] = {
    InvalidInput: 422,
    Unauthorized: 401,
    Forbidden: 403,
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


def protocol_status(error: ServiceError) -> int:
    """The status of a service error on the routes of a protocol that answers bad input with a
    400 (KServe v2, LibreTranslate; gRPC's codes follow it): `status_of`, 400 for 422."""
    status = status_of(error)
    return 400 if status == 422 else status


def protocol_status_of(error_type: str) -> int:
    """`protocol_status` of a service error known by its `error_type` (500 when unknown)."""
    status = next((status for cls, status in _STATUS.items() if cls.error_type == error_type), 500)
    return 400 if status == 422 else status


class ProtocolRoute(APIRoute):
    """A route of a protocol that has an error body of its own (`body`; by default the server's)
    and answers bad input with a 400 (`protocol_status`): its service errors, body validation
    errors, HTTP errors, and unexpected errors (a 500 with a fixed message; the trace goes to the
    log) all answer in that body, with the statuses and headers the server gives them."""

    @staticmethod
    def body(message: str, error_type: str, status: int) -> Any:
        """The protocol's error body."""
        return {"error": message, "error_type": error_type}

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body = self.body

        async def protocol_errors(request: Request) -> Response:
            headers: Mapping[str, str] | None = None
            try:
                return await handler(request)
            except ServiceError as error:
                status, message, error_type = protocol_status(error), error.message, error.error_type
                headers = error.headers()
            except RequestValidationError as error:
                status, message = 400, describe_validation_errors(error.errors())
                error_type = InvalidInput.error_type
            except HTTPException as error:
                status, message, headers = error.status_code, str(error.detail), error.headers
                error_type = _HTTP_ERROR_TYPES.get(error.status_code, "http_error")
            except Exception as error:
                logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
                status, message, error_type = 500, "internal error", InternalError.error_type
            return JSONResponse(body(message, error_type, status), status_code=status, headers=headers)

        return protocol_errors


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
    # answered outside the app's middlewares (Starlette's outermost one): the request's id is
    # still the running one (`service.api.request_id`) and goes on the answer here
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    identity = request.scope.get("state", {}).get("request_id")
    return error_response(500, "internal error", InternalError.error_type,
                          {REQUEST_ID_HEADER: identity} if identity else None)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the one body shape."""
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
