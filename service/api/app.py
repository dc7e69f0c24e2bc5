"""The FastAPI application: `create_app(settings)` wires settings, models, routes and metrics.

The lifespan starts loading the models in the background (the app answers `/health/live` at
once and turns ready when they are loaded; one of several `--workers` processes instead waits
for them before it accepts connections) and, at shutdown, drains the batchers. ASGI
middlewares sit around the routes, outermost first: one records `requests_total` and
`request_duration_seconds` by route template (never the raw path), gives each request its id
(its `X-Request-ID` header, else a new one), sends it back on every answer and logs the
request's access line (`service.api.request_id`); with tracing on, one adds the request's id,
model and stages to its span (FastAPI's, `service.observability.tracing`); one refuses a generation
request every model of its task would refuse, before its body is read (`service.api.shed`);
one answers 408 when a
request's body has not arrived within `body_timeout_s`; one answers 429 beyond
`max_large_responses` concurrent `/v1/attention` requests, whose responses run to megabytes and
are held until the client has read them; one refuses bodies over `max_body_bytes` with a 413,
after reading the rest of the body (up to `DRAIN_BYTES`) so that a client that sends it all
before it reads -- most do -- gets the 413 rather than a reset connection. Routers declare full
paths (no prefixes), so the matched route's `path` is the template whichever way FastAPI
includes routers. The connection-level guards (header timeout, connection cap) are the
server's: `service.process.http`.

Security and operations: the inference routes take JSON only (415) and need the bearer token
when `api_key` is set (`service.api.auth`); CORS is closed unless `cors_origins` lists origins;
with `metrics_port` the metrics are served on their own port (`service.observability.metrics_server`) and
not on this app; with `grpc_port` the lifespan serves KServe v2 over gRPC too, beside the app
(`service.api.grpc_inference`); with `fail_on_model_error` a model that fails to load makes the startup fail
(the process exits) instead of leaving the server live and not ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.deadline import HEADER as TIMEOUT_HEADER
from service.api.errors import error_response, install_error_handlers
from service.api.request_id import CLIENT_GONE, id_header, log_access, request_id
from service.api.request_id import HEADER as REQUEST_ID_HEADER
from service.api.routes import (
    attention,
    docs,
    generate,
    health,
    kserve,
    libretranslate,
    models,
    openai,
    page,
    prometheus,
)
from service.api.routes.deps import Serving
from service.api.shed import SHED_STATE, Shedder, ShedMiddleware
from service.core.registry import (
    GeneratorFactory,
    Loader,
    ModelRegistry,
    RunningBatchFactory,
    onnx_generator,
    onnx_loader,
    onnx_running_batch,
)
from service.core.settings import Settings
from service.observability import logs, metrics, tracing
from service.observability.tracing import TracingMiddleware

logger = logging.getLogger(__name__)

UNMATCHED_ROUTE = "unmatched"
LARGE_RESPONSE_PATHS = frozenset({"/v1/attention"})
DRAIN_BYTES = 16 * 1024 * 1024  # read at most this much of a body refused for its size


class ModelLoadFailed(RuntimeError):
    """A model failed to load and `fail_on_model_error` asks the server not to start."""


def create_app(
    settings: Settings | None = None,
    *,
    loader: Loader | None = None,
    generator: GeneratorFactory | None = None,
    running_batch: RunningBatchFactory | None = None,
    tracer_provider: Any | None = None,
) -> FastAPI:
    """The app serving the models of `settings.models_dir`.

    `loader`, `generator` and `running_batch` default to onnxruntime (`service.runtime`,
    `service.generation.search`, `service.batching.running_batch`); tests pass fakes. With a fake `generator` and
    no `running_batch` there is no continuous batching (request-level batches only).
    `tracer_provider` (an OpenTelemetry one) defaults to the OTLP exporter of `settings.otlp_endpoint`
    (`service.observability.tracing`); without either the app traces nothing.
    """
    settings = settings or Settings()
    if running_batch is None and generator is None:
        running_batch = onnx_running_batch(settings)
    registry = ModelRegistry(
        settings, loader or onnx_loader(settings), generator or onnx_generator(settings), running_batch
    )

    shedder = Shedder(registry, settings)
    tracer_provider = tracer_provider or tracing.tracer_provider(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        registry.start()
        if settings.fail_on_model_error:
            await _refuse_failed_models(registry)
        elif settings.workers > 1:
            # One of several processes on a shared socket: uvicorn accepts connections only after
            # the lifespan's startup, so a restarted worker takes none (and answers no 503) before
            # its models are loaded, while the others serve.
            await registry.wait_settled()
        grpc_server = None
        if settings.grpc_port is not None:
            from service.api import grpc_inference  # the grpc extra

            grpc_server = await grpc_inference.start(registry, settings, tracer_provider)
            app.state.grpc_port = grpc_server.port
        try:
            yield {SHED_STATE: shedder}  # the server's protocol sheds with it (service.api.shed)
        finally:
            if grpc_server is not None:  # new calls refused; those in flight finish first
                registry.begin_draining()  # health watches end
                await grpc_server.stop(settings.drain_timeout_s)
            await registry.close(settings.drain_timeout_s)
            if tracer_provider is not None:
                tracer_provider.shutdown()  # the spans not yet sent go now

    app = FastAPI(
        title="attnserve",
        summary="Translation and summarization on onnxruntime, with dynamic batching",
        version="0.1.0",
        lifespan=lifespan,
        telemetry=tracing.telemetry_config(tracer_provider),  # the request spans, with tracing on
        openapi_url=None,  # served by `service.api.routes.docs`, behind the API key
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.serving = Serving(registry, settings)  # what the inference routes depend on
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(ConcurrencyLimitMiddleware, paths=LARGE_RESPONSE_PATHS,
                       limit=settings.max_large_responses, retry_after_s=settings.retry_after_s)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", TIMEOUT_HEADER, REQUEST_ID_HEADER],
            expose_headers=[REQUEST_ID_HEADER, "Server-Timing"],
        )
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.body_timeout_s)
    app.add_middleware(ShedMiddleware, shedder=shedder)
    if tracer_provider is not None:
        app.add_middleware(TracingMiddleware, provider=tracer_provider)  # names FastAPI's span
    app.add_middleware(RequestMetricsMiddleware)  # outermost: sees every status, ids every answer
    logs.ACCESS.disabled = not settings.access_log
    # the inference routes check the bearer token and (but KServe v2's, JSON or binary) the
    # body's type in their one dependency (`service.api.routes.deps`)
    for router in (generate.router, attention.router, models.router, health.router, kserve.router,
                   libretranslate.router, openai.router, page.router, docs.router):
        app.include_router(router)
    if settings.metrics_port is None:
        app.include_router(prometheus.router)
    return app


async def _refuse_failed_models(registry: ModelRegistry) -> None:
    """Wait for the models to load; raise `ModelLoadFailed` if any failed (or none exist)."""
    failed = await registry.wait_settled()
    if not registry.entries:
        message = f"no models found in {registry.settings.models_dir}"
    elif failed:
        message = "; ".join(f"model {e.name} failed to load: {e.error}" for e in failed)
    else:
        return
    logger.critical("refusing to start (fail_on_model_error): %s", message)
    raise ModelLoadFailed(message)


class RequestMetricsMiddleware:
    """Counts and times every HTTP request by route template, model and status class (a request
    answered with nothing counts as 500); gives it its id, sent back on its answer and carried by
    the records logged meanwhile, and logs its access line (`service.api.request_id`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        identity = request_id(scope)
        scope.setdefault("state", {})["request_id"] = identity
        header = id_header(identity)
        status: int | None = None
        token = logs.REQUEST_ID.set(identity)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            failed = True
            if status is None:  # the app's error handler answers it, outside the middlewares
                status = 500
            raise
        finally:
            if not failed:  # else the error handler's record, made after this, still names the request
                logs.REQUEST_ID.reset(token)
            log_access(scope, CLIENT_GONE if status is None else status, started, identity)
            status = 500 if status is None else status
            state = scope.get("state", {})
            # the matched route's template; a request shed before routing names its route
            template = getattr(scope.get("route"), "path", None) or state.get("route") or UNMATCHED_ROUTE
            model = str(state.get("model", ""))
            metrics.REQUESTS_TOTAL.labels(template, model, metrics.status_class(status)).inc()
            metrics.REQUEST_DURATION_SECONDS.labels(template, model).observe(
                time.perf_counter() - started
            )


class BodyLimitMiddleware:
    """413 with the error body for a request body over `max_body_bytes` (declared or streamed).

    The rest of the body is read first, up to `DRAIN_BYTES` (a client that sends its whole
    body before reading the answer would otherwise see the connection reset, not the 413);
    past that, or when the client waits for `100 Continue`, the 413 closes the connection.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            headers = dict(scope.get("headers", []))
            drained = (headers.get(b"expect", b"").lower() != b"100-continue"
                       and declared <= DRAIN_BYTES and await _drain(receive, DRAIN_BYTES))
            response = error_response(413, self._message(), "payload_too_large",
                                      None if drained else {"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    drained = not message.get("more_body", False) or await _drain(
                        receive, DRAIN_BYTES - received)
                    # HTTPException passes FastAPI's body parsing unchanged -> handler -> 413.
                    raise HTTPException(413, self._message(),
                                        None if drained else {"Connection": "close"})
            return message

        await self.app(scope, receive_within_limit, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes"


async def _drain(receive: Receive, limit: int) -> bool:
    """Read and drop the rest of a request body; False when it goes past `limit` bytes, its
    deadline passes or the client leaves first."""
    read = 0
    while read <= limit:
        try:
            message = await receive()
        except HTTPException:  # the body's deadline passed (BodyTimeoutMiddleware)
            return False
        if message["type"] != "http.request":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return read <= limit
    return False


class BodyTimeoutMiddleware:
    """408 (`Connection: close`) when a request's body has not fully arrived within
    `timeout_s` of the request's start; counted in `connections_refused_total{reason=
    "body_timeout"}`. Once the body is complete, `receive` is passed through untimed (it then
    waits for the client's disconnect)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        complete = False

        async def receive_in_time() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                metrics.CONNECTIONS_REFUSED_TOTAL.labels("body_timeout").inc()
                raise HTTPException(
                    408, f"the request body did not arrive within {self.timeout_s:g}s",
                    {"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, receive_in_time, send)


class ConcurrencyLimitMiddleware:
    """At most `limit` requests to `paths` at once, each counted until its response is sent;
    one more gets 429 with `Retry-After` (`rejected_total{reason="large_responses"}`)."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], limit: int,
                 retry_after_s: int) -> None:
        self.app = app
        self.paths = paths
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            metrics.REJECTED_TOTAL.labels("", "large_responses").inc()
            response = error_response(
                429, f"more than {self.limit} large responses at once; retry later",
                "overloaded", {"Retry-After": str(self.retry_after_s)})
            await response(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def _content_length(scope: Scope) -> int | None:
    headers: Any = dict(scope.get("headers", []))
    value = headers.get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
