"""The FastAPI application: `create_app(settings)` wires settings, models, routes and metrics.

The lifespan starts loading the models in the background (the app answers `/health/live` at
once and turns ready when they are loaded; one of several `--workers` processes instead waits
for them before it accepts connections) and, at shutdown, drains the batchers. Two ASGI
middlewares sit around the routes: one records `requests_total` and
`request_duration_seconds` by route template (never the raw path), one refuses bodies over
`max_body_bytes` with a 413. Routers declare full paths (no prefixes), so the matched route's
`path` is the template whichever way FastAPI includes routers.

Security and operations: the inference routes take JSON only (415) and need the bearer token
when `api_key` is set (`service.auth`); CORS is closed unless `cors_origins` lists origins;
with `metrics_port` the metrics are served on their own port (`service.metrics_server`) and
not on this app; with `fail_on_model_error` a model that fails to load makes the startup fail
(the process exits) instead of leaving the server live and not ready.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import metrics
from service.auth import require_api_key
from service.deadline import HEADER as TIMEOUT_HEADER
from service.errors import error_response, install_error_handlers
from service.media_type import require_json
from service.registry import (
    GeneratorFactory,
    Loader,
    ModelRegistry,
    RunningBatchFactory,
    onnx_generator,
    onnx_loader,
    onnx_running_batch,
)
from service.routes import attention, docs, generate, health, kserve, models, page
from service.routes import metrics as metrics_route
from service.settings import Settings

logger = logging.getLogger(__name__)

UNMATCHED_ROUTE = "unmatched"


class ModelLoadFailed(RuntimeError):
    """A model failed to load and `fail_on_model_error` asks the server not to start."""


def create_app(
    settings: Settings | None = None,
    *,
    loader: Loader | None = None,
    generator: GeneratorFactory | None = None,
    running_batch: RunningBatchFactory | None = None,
) -> FastAPI:
    """The app serving the models of `settings.models_dir`.

    `loader`, `generator` and `running_batch` default to onnxruntime (`service.runtime`,
    `service.generation`, `service.continuous`); tests pass fakes. With a fake `generator` and
    no `running_batch` there is no continuous batching (request-level batches only).
    """
    settings = settings or Settings()
    if running_batch is None and generator is None:
        running_batch = onnx_running_batch(settings)
    registry = ModelRegistry(
        settings, loader or onnx_loader(settings), generator or onnx_generator(settings), running_batch
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()
        if settings.fail_on_model_error:
            await _refuse_failed_models(registry)
        elif settings.workers > 1:
            # One of several processes on a shared socket: uvicorn accepts connections only after
            # the lifespan's startup, so a restarted worker takes none (and answers no 503) before
            # its models are loaded, while the others serve.
            await registry.wait_settled()
        try:
            yield
        finally:
            await registry.close(settings.graceful_timeout_s)

    app = FastAPI(
        title="attnserve",
        summary="Translation and summarization on onnxruntime, with dynamic batching",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None,  # served by `service.routes.docs`, behind the API key
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.registry = registry
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", TIMEOUT_HEADER],
        )
    app.add_middleware(RequestMetricsMiddleware)  # outermost: sees every status
    inference = [Depends(require_api_key), Depends(require_json)]
    for router in (generate.router, attention.router):
        app.include_router(router, dependencies=inference)
    # KServe v2: the protocol's own content types (JSON or the binary extension); `infer`
    # carries its own bearer-token dependency.
    for router in (models.router, health.router, kserve.router, page.router, docs.router):
        app.include_router(router)
    if settings.metrics_port is None:
        app.include_router(metrics_route.router)
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
    """Counts and times every HTTP request by route template, model and status class."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED_ROUTE
            model = str(scope.get("state", {}).get("model", ""))
            metrics.REQUESTS_TOTAL.labels(template, model, metrics.status_class(status)).inc()
            metrics.REQUEST_DURATION_SECONDS.labels(template, model).observe(
                time.perf_counter() - started
            )


class BodyLimitMiddleware:
    """413 with the error body for a request body over `max_body_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            response = error_response(413, self._message(), "payload_too_large")
            await response(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # HTTPException passes FastAPI's body parsing unchanged -> handler -> 413.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, receive_within_limit, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes"


def _content_length(scope: Scope) -> int | None:
    headers: Any = dict(scope.get("headers", []))
    value = headers.get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
