"""Traces over OpenTelemetry: with `otlp_endpoint` (`--otlp-endpoint`, the `otel` extra) the server
sends one span per HTTP request to an OTLP/HTTP collector.

The request's span (kind SERVER, named `<method> <route template>`) continues the client's trace
when the request carries a W3C `traceparent` (and `tracestate`), else starts one. It carries
`http.request.method`, `url.path`, `http.route`, `http.response.status_code`,
`attnserve.request_id` (its `X-Request-ID`, `service.api.request_id`) and, on an inference
route, `attnserve.model`; a 5xx or an exception marks it an error. A generation request's span has
a child span per stage of its `Server-Timing` (`service.observability.timing`): `prepare`, `queue`
(from the rows' queueing, as long as the longest wait) and `inference` (with the `join` time as
`attnserve.join_ms`). Spans leave in batches from a background thread (`BatchSpanProcessor`); without
an endpoint the app has no tracing middleware at all. opentelemetry is imported only here and only
when tracing is on: the server without the extra runs as before.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.core.settings import Settings

EXTRA_HINT = "pip install 'attnserve[otel]'"
_TRACE_HEADERS = (b"traceparent", b"tracestate")


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


class TracingMiddleware:
    """One span per HTTP request, and its stages' spans (the module's docstring)."""

    def __init__(self, app: ASGIApp, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self.trace = trace
        self.tracer = provider.get_tracer("attnserve")
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope.get("headers", ()) if name in _TRACE_HEADERS}
        offset_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> the epoch, for the stages
        method = scope.get("method", "")
        span = self.tracer.start_span(method, context=self.propagator.extract(carrier),
                                      kind=self.trace.SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": scope.get("path", "")})
        status: int | None = None

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        except Exception as error:
            span.record_exception(error)
            status = status or 500  # the app's error handler answers it, outside the middlewares
            raise
        finally:
            self._finish(span, scope, status, offset_ns)

    def _finish(self, span: Any, scope: Scope, status: int | None, offset_ns: int) -> None:
        state = scope.get("state", {})
        route = getattr(scope.get("route"), "path", None) or state.get("route")
        if route:
            span.update_name(f"{scope.get('method', '')} {route}")
            span.set_attribute("http.route", route)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
        for key, name in (("request_id", "attnserve.request_id"), ("model", "attnserve.model")):
            if state.get(key):
                span.set_attribute(name, str(state[key]))
        timing = state.get("timing")
        if timing is not None:
            parent = self.trace.set_span_in_context(span)
            for name, start, end in timing.intervals():
                stage = self.tracer.start_span(name, context=parent, start_time=int(start * 1e9) + offset_ns)
                if name == "inference":
                    stage.set_attribute("attnserve.join_ms", round(timing.join_s * 1000, 3))
                stage.end(end_time=int(end * 1e9) + offset_ns)
        span.end()
