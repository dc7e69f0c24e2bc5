"""Traces over OpenTelemetry: with `otlp_endpoint` (`--otlp-endpoint`, the `otel` extra) the server
sends one span per HTTP request to an OTLP/HTTP collector.

The request's span is FastAPI's own (`FastAPI(telemetry=...)`, `telemetry_config`): kind SERVER,
named `<method> <route template>`, continuing the client's W3C `traceparent`, with the HTTP
semantic conventions' attributes (`http.request.method`, `url.path`, `http.route`,
`http.response.status_code`; a 5xx or an exception marks it an error). `TracingMiddleware` adds
what is ours: `attnserve.request_id` (its `X-Request-ID`, `service.api.request_id`) and, on an
inference route, `attnserve.model`, and for a generation request a child span per stage of its
`Server-Timing` (`service.observability.timing`): `prepare`, `queue` (from the rows' queueing, as
long as the longest wait) and `inference` (with the `join` time as `attnserve.join_ms`). Spans
leave in batches from a background thread (`BatchSpanProcessor`). Without an endpoint FastAPI's
telemetry is off and the app has no tracing middleware; opentelemetry's SDK is imported only when
tracing is on.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from fastapi.telemetry import TelemetryConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.core.settings import Settings

EXTRA_HINT = "pip install 'attnserve[otel]'"


def available() -> bool:
    """Whether the `otel` extra (the SDK and its OTLP/HTTP exporter) is installed."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"))


def tracer_provider(settings: Settings) -> Any | None:
    """The tracer provider that exports to `settings.otlp_endpoint` (None without one); raises
    RuntimeError naming the extra when it is not installed."""
    if not settings.otlp_endpoint:
        return None
    if not available():
        raise RuntimeError(f"--otlp-endpoint needs the otel extra: {EXTRA_HINT}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": settings.otlp_service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    return provider


def telemetry_config(provider: Any | None) -> TelemetryConfig:
    """FastAPI's telemetry settings: its request spans on `provider` (no metrics, logs or spans of
    its own operations: Prometheus and our logs have those), or none without one."""
    if provider is None:
        return {"tracing": False, "metrics": False, "logs": False}
    return {"tracer_provider": provider, "tracing": True, "metrics": False, "logs": False,
            "operation_spans": False}


class TracingMiddleware:
    """Our attributes on the request's span (FastAPI's, the current one) and its stages' spans
    (the module's docstring)."""

    def __init__(self, app: ASGIApp, provider: Any) -> None:
        from opentelemetry import trace

        self.app = app
        self.trace = trace
        self.tracer = provider.get_tracer("attnserve")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        span = self.trace.get_current_span() if scope["type"] == "http" else None
        if span is None or not span.is_recording():
            await self.app(scope, receive, send)
            return
        offset_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> the epoch, for the stages

        async def send_and_name(message: Message) -> None:
            if message["type"] == "http.response.start":  # before FastAPI ends the span with the body
                state = scope.get("state", {})
                for key, name in (("request_id", "attnserve.request_id"), ("model", "attnserve.model")):
                    if state.get(key):
                        span.set_attribute(name, str(state[key]))
            await send(message)

        try:
            await self.app(scope, receive, send_and_name)
        finally:
            timing = scope.get("state", {}).get("timing")
            if timing is not None:
                parent = self.trace.set_span_in_context(span)
                for name, start, end in timing.intervals():
                    stage = self.tracer.start_span(name, context=parent, start_time=int(start * 1e9) + offset_ns)
                    if name == "inference":
                        stage.set_attribute("attnserve.join_ms", round(timing.join_s * 1000, 3))
                    stage.end(end_time=int(end * 1e9) + offset_ns)
