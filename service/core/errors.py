"""The errors the service answers with, by kind; `service.api.errors` maps each kind to one
HTTP status and turns any error into the JSON error body."""

from __future__ import annotations

MAX_NAME_CHARS = 64  # a client's field, parameter or tensor name quoted in a message


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


class Forbidden(ServiceError):
    """What the server's settings do not allow (model control while it is off)."""

    error_type = "forbidden"


class ClientDisconnected(ServiceError):
    """The client went away while its request waited; nobody reads the answer (499)."""

    error_type = "client_disconnected"


class InternalError(ServiceError):
    """Inference failed; the message says so without details (those are logged)."""

    error_type = "internal"
