"""Each HTTP request's id, and its access line: what the app's outermost middleware
(`service.api.app.RequestMetricsMiddleware`) and the server's protocol use.

A request's id is its `X-Request-ID` header when that is 1 to 128 visible ASCII characters, else
a new random one (32 hex digits). Every answer of the app carries it back in `X-Request-ID`, the
records logged while the request is handled carry it (`service.observability.logs.REQUEST_ID`),
and when the answer is complete one access line goes to the `attnserve.access` logger at INFO:
method, path, status, milliseconds, the client's address and the id (and the model, on an
inference route); a request whose client went away before any answer is logged with status 499.
An error no handler of the app's middlewares took is answered 500 outside them, by
`service.api.errors`, which puts the id on that answer too.
`access_log=False` (`--no-access-log`) turns the lines off. The server's protocol answers the
requests it sheds itself (`service.process.http`) with the same header and line; what it refuses
before a request's headers are complete (a header timeout, too many connections) has no id.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.types import Scope

from service.observability.logs import ACCESS

HEADER = "X-Request-ID"
MAX_LENGTH = 128
CLIENT_GONE = 499  # the access line's status of a request answered with nothing
_HEADER = HEADER.lower().encode("ascii")


def request_id(scope: Scope) -> str:
    """The id of the request of `scope`: its `X-Request-ID` header if usable, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == _HEADER:
            return id_from(value)
    return uuid.uuid4().hex


def id_from(value: bytes | None) -> str:
    """`value` (a request's `X-Request-ID`, or None) as its id if usable, else a new one."""
    if value is not None and 0 < len(value) <= MAX_LENGTH and all(0x21 <= byte <= 0x7E for byte in value):
        return bytes(value).decode("ascii")
    return uuid.uuid4().hex


def id_header(value: str) -> tuple[bytes, bytes]:
    """The response header that carries the id `value`."""
    return _HEADER, value.encode("ascii")


def log_access(scope: Scope, status: int, started: float, value: str, model: str | None = None) -> None:
    """The access line of the request of `scope`, answered `status` after `started`
    (`time.perf_counter()`), whose id is `value`."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    milliseconds = round((time.perf_counter() - started) * 1e3, 1)
    client = scope.get("client")
    address = f"{client[0]}:{client[1]}" if client else None
    model = model or str(scope.get("state", {}).get("model") or "") or None
    method, path = scope.get("method", ""), scope.get("path", "")
    fields: dict[str, Any] = {"request_id": value, "method": method, "path": path, "status": status,
                              "duration_ms": milliseconds, "client": address, "model": model}
    ACCESS.info("%s %s %d %.1f ms %s request_id=%s", method, path, status, milliseconds, address or "-", value,
                extra=fields)
