"""The HTTP server around the app: uvicorn's options from the settings, and the connection
guards uvicorn does not have.

uvicorn already closes idle keep-alive connections (`timeout_keep_alive`) and drains on
shutdown (`timeout_graceful_shutdown`); those come from the settings here. What it lacks is
added by `GuardedProtocol`, a subclass of uvicorn's HTTP protocol (httptools when installed,
else h11) that every server of `attnserve serve` uses:

- a **header timeout**: a connection must complete the headers of its request within
  `header_timeout_s` of opening (or of its previous response); else it gets a 408, or is
  closed when it sent nothing -- a client that trickles its headers holds no socket for long;
- a **header size limit**: headers still incomplete after `max_header_bytes` get a 431;
- a **connection cap**: a connection beyond `max_connections` open ones is answered 503 and
  closed at once (uvicorn's `limit_concurrency` accepts it and answers in plain text only
  once its headers arrive, so a slow client would still hold it);
- **the error body**: a request the parser refuses (a malformed request line, `Content-Length:
  -1`, ...) gets the service's JSON error body instead of uvicorn's plain text;
- **shedding in the parser** (httptools' protocol): a generation request that every model of its
  task would refuse (`service.api.shed.Shedder`, found in the lifespan state) is answered 429 as
  soon as its headers are complete, without starting the app (with the request's
  `X-Request-ID` and access line, as the app's answers: `service.api.request_id`); the parser
  discards its body and the connection stays open for the next request, under the header
  timeout meanwhile.

Each refusal is counted in `attnserve_connections_refused_total{reason}`, and
`attnserve_open_connections` follows the open connections. The body's own deadline
(`body_timeout_s`) is ASGI middleware (`service.api.app.BodyTimeoutMiddleware`): by then a request
exists to answer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from service.api.request_id import id_header, log_access, request_id
from service.api.shed import SHED_CHECKED, SHED_STATE, Refusal
from service.core.settings import Settings
from service.observability import metrics
from service.process.uvicorn_config import PROTOCOL, server_options


@dataclass(frozen=True)
class ConnectionLimits:
    """What `GuardedProtocol` enforces per connection and over all of them."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 * 1024
    max_connections: int = 1000

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(settings.header_timeout_s, settings.max_header_bytes, settings.max_connections)


@functools.cache
def _limits_from_environment() -> ConnectionLimits:
    """The limits of a worker process, whose settings come from the environment."""
    return ConnectionLimits.from_settings(Settings())


def raw_error(status: int, message: str, error_type: str) -> bytes:
    """A complete HTTP/1.1 response with the error body that closes the connection."""
    body = json.dumps({"error": message, "error_type": error_type}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class Guards:
    """The header timeout, header size limit, connection cap and JSON error body of the
    module's docstring, mixed into one of uvicorn's HTTP protocols (httptools' or h11's: both
    have `cycle`, `connections`, `transport`, `loop` and these hooks); `limits` None: from the
    environment."""

    limits: ConnectionLimits | None = None
    # what the protocol provides
    cycle: Any
    connections: set[Any]
    transport: Any
    loop: asyncio.AbstractEventLoop
    app_state: dict[str, Any]
    server_state: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = type(self).limits or _limits_from_environment()
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # received while waiting for the current request's headers
        self._seen_cycle: Any = None  # the request whose headers were complete last
        self._discarding: Any = None  # a shed request whose body is still arriving

    # ---- asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # uvicorn's protocol, after this mixin
        metrics.OPEN_CONNECTIONS.inc()
        if len(self.connections) > self.guard.max_connections:
            self._refuse(503, f"more than {self.guard.max_connections} open connections; "
                         "retry later", "overloaded", "too_many_connections")
            return
        self._wait_for_headers()

    def data_received(self, data: bytes) -> None:
        # bytes count toward the next request's headers when it was awaited before they came
        # and no request's headers completed in them (not a shed request's body)
        counting = self._header_timer is not None and self._discarding is None
        cycle = self.cycle
        super().data_received(data)  # type: ignore[misc]  # uvicorn's protocol, after this mixin
        if self.transport.is_closing():
            self._stop_waiting()
            return
        if self.cycle is not None and self.cycle is not self._seen_cycle:
            self._seen_cycle = self.cycle  # a request's headers are complete
            self._stop_waiting()
        elif counting and self.cycle is cycle and self._header_timer is not None:
            self._header_bytes += len(data)
            if self._header_bytes > self.guard.max_header_bytes:
                self._refuse(431, f"request headers over {self.guard.max_header_bytes} bytes",
                             "headers_too_large", "headers_too_large")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)  # type: ignore[misc]  # uvicorn's protocol, after this mixin
        metrics.OPEN_CONNECTIONS.dec()

    # ---- uvicorn's hooks

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # uvicorn's protocol, after this mixin
        if self.transport.is_closing():
            return
        if self.cycle is not self._seen_cycle:  # the next request was already parsed (h11)
            self._seen_cycle = self.cycle
        elif self.cycle is not None and self.cycle.response_complete \
                and not getattr(self, "pipeline", None):
            self._wait_for_headers()  # idle, or the next request's headers are incomplete

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """httptools' protocol starts the app for a request whose headers are complete: a shed
        request is answered here instead."""
        shedder = self.app_state.get(SHED_STATE)
        refusal = shedder.refusal(cycle.scope) if shedder is not None else None
        if refusal is None:
            cycle.scope[SHED_CHECKED] = True  # ShedMiddleware need not decide again
            super()._start_asgi_task(cycle, app)  # type: ignore[misc]  # httptools' protocol
            return
        self._answer(cycle, refusal)

    def on_message_complete(self) -> None:
        if self._discarding is not None and self.cycle is self._discarding:
            self._discarding = None  # from now on bytes are the next request's
        super().on_message_complete()  # type: ignore[misc]  # httptools' protocol

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request: the error body, then close."""
        self._stop_waiting()
        self.transport.write(raw_error(400, f"malformed HTTP request: {msg}", "bad_request"))
        self.transport.close()

    # ---- the guards

    def _wait_for_headers(self) -> None:
        self._stop_waiting()
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.guard.header_timeout_s,
                                                  self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._header_bytes:
            seconds = f"{self.guard.header_timeout_s:g}"
            self._refuse(408, f"the request headers did not arrive within {seconds}s",
                         "request_timeout", "header_timeout")
        else:  # nothing sent: a silent connection, or an idle keep-alive one
            metrics.CONNECTIONS_REFUSED_TOTAL.labels("header_timeout").inc()
            self.transport.close()

    def _answer(self, cycle: Any, refusal: Refusal) -> None:
        """Send `refusal` as the whole response of `cycle` (whose body the parser then
        discards), counted as the app's middleware counts a request; the connection stays open
        unless the request asked otherwise or waits for a `100 Continue` before its body."""
        started = time.perf_counter()
        identity = request_id(cycle.scope)
        keep_alive = cycle.keep_alive and not cycle.waiting_for_100_continue
        head = [f"HTTP/1.1 {refusal.status} {HTTPStatus(refusal.status).phrase}\r\n".encode("ascii")]
        for name, value in [*self.server_state.default_headers, *refusal.headers, id_header(identity)]:
            head += [name, b": ", value, b"\r\n"]
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        self.transport.write(b"".join([*head, refusal.body]))
        metrics.REQUESTS_TOTAL.labels(refusal.route, refusal.model, metrics.status_class(refusal.status)).inc()
        metrics.REQUEST_DURATION_SECONDS.labels(refusal.route, refusal.model).observe(
            time.perf_counter() - started)
        log_access(cycle.scope, refusal.status, started, identity, refusal.model)
        if not keep_alive:
            self.transport.close()
        if cycle.more_body:  # its body still to come (a pipelined request's was read whole)
            self._discarding = cycle
        self._seen_cycle = cycle  # the next request's headers are awaited (`on_response_complete`)
        self.on_response_complete()

    def _refuse(self, status: int, message: str, error_type: str, reason: str) -> None:
        self._stop_waiting()
        metrics.CONNECTIONS_REFUSED_TOTAL.labels(reason).inc()
        self.transport.write(raw_error(status, message, error_type))
        self.transport.close()


class GuardedProtocol(Guards, AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools' when installed, else h11's) with the guards."""


def guarded_protocol(settings: Settings, base: type[Any] | None = None) -> type[Any]:
    """`GuardedProtocol` with the limits of `settings` (one process: no import needed); on
    `base`, one of uvicorn's protocols, when given."""
    bases = (Guards, base) if base is not None else (GuardedProtocol,)
    return type("GuardedProtocol", bases, {"limits": ConnectionLimits.from_settings(settings)})


def uvicorn_options(settings: Settings, *, workers: bool = False) -> dict[str, Any]:
    """Keyword arguments of `uvicorn.Config` (or `uvicorn.run`) for `settings`; with `workers`
    the protocol is named by its import path and reads its limits from the environment."""
    return {**server_options(settings), "http": PROTOCOL if workers else guarded_protocol(settings)}
