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
from service.observability.timing import RequestTiming

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
                stage_spans(self.tracer, span, timing, offset_ns)


def stage_spans(tracer: Any, parent: Any, timing: RequestTiming, offset_ns: int) -> None:
    """A child span of `parent` for each stage of `timing` with a place in time (`prepare`,
    `queue`, `inference` with `attnserve.join_ms`); `offset_ns` turns `perf_counter` into the
    epoch."""
    from opentelemetry import trace

    context = trace.set_span_in_context(parent)
    for name, start, end in timing.intervals():
        stage = tracer.start_span(name, context=context, start_time=int(start * 1e9) + offset_ns)
        if name == "inference":
            stage.set_attribute("attnserve.join_ms", round(timing.join_s * 1000, 3))
        stage.end(end_time=int(end * 1e9) + offset_ns)


# gRPC codes a server span marks as errors (OpenTelemetry's RPC conventions).
GRPC_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL",
                                "UNAVAILABLE", "DATA_LOSS"})


class CallTracer:
    """A server span per gRPC call (`service.api.grpc_inference`), as FastAPI makes one per HTTP
    request: named `<service>/<method>`, continuing the caller's W3C `traceparent` (from the
    call's metadata), with OpenTelemetry's RPC attributes (`rpc.system` "grpc", `rpc.service`,
    `rpc.method`, `rpc.grpc.status_code`; an error for a server fault), our request id and
    model, and the stages' child spans."""

    def __init__(self, provider: Any) -> None:
        self.tracer = provider.get_tracer("attnserve")

    def start(self, path: str, metadata: dict[str, Any]) -> Any:
        """The span of the call to `path` (`/<service>/<method>`), started now."""
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        service, _, method = path.strip("/").partition("/")
        carrier = {key: value for key, value in metadata.items() if isinstance(value, str)}
        return self.tracer.start_span(
            path.strip("/"), context=propagate.extract(carrier), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})

    def end(self, span: Any, code: Any, request_id: str, model: str,
            timing: RequestTiming | None) -> None:
        """End `span` with the call's gRPC `code` (a `grpc.StatusCode`), id, model and stages."""
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_attribute("attnserve.request_id", request_id)
        if model:
            span.set_attribute("attnserve.model", model)
        if code.name in GRPC_SERVER_ERRORS:
            span.set_status(Status(StatusCode.ERROR, code.name))
        if timing is not None:
            stage_spans(self.tracer, span, timing, time.time_ns() - time.perf_counter_ns())
        span.end()
