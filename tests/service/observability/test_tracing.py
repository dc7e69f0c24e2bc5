"""Traces: one server span per request continuing the client's `traceparent`, with the request's
route, status, id and model, and a span per stage of its `Server-Timing` inside it."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from service.api.app import create_app
from service.api.routes import models as models_route
from service.core.settings import Settings
from service.observability import tracing
from tests.service.conftest import AppFactory, serving
from tests.service.fakes import FAIL_CHAR, FakeLoader, FakeModel

pytestmark = pytest.mark.anyio

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter


@pytest.fixture
def traced_app(models_dir: Path, fake_model: FakeModel, exported: tuple[TracerProvider, InMemorySpanExporter]) -> Any:
    """An app over the fake models that traces into `exported`."""
    return create_app(Settings(models_dir=models_dir, batch_workers=1), loader=FakeLoader(),
                      generator=lambda runtime: fake_model.generate, tracer_provider=exported[0])


def by_name(spans: Any) -> dict[str, Any]:
    return {span.name: span for span in spans}


async def test_a_request_continues_the_clients_trace_with_its_stages(
        traced_app: Any, exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    _, exporter = exported
    async with serving(traced_app) as client:
        exporter.clear()  # the readiness polls' spans
        response = await client.post("/v1/translate", json={"text": "abc"}, headers={
            "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-ID": "traced-1"})
    assert response.status_code == 200
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"POST /v1/translate", "prepare", "queue", "inference"}
    server = spans["POST /v1/translate"]
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == PARENT_ID
    assert server.attributes["http.route"] == "/v1/translate"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["attnserve.request_id"] == "traced-1"
    assert server.attributes["attnserve.model"] == "translate-en-it"
    for name in ("prepare", "queue", "inference"):
        stage = spans[name]
        assert stage.parent.span_id == server.context.span_id
        assert stage.context.trace_id == server.context.trace_id
        assert server.start_time <= stage.start_time <= stage.end_time <= server.end_time
    assert spans["prepare"].end_time <= spans["inference"].start_time
    assert spans["inference"].attributes["attnserve.join_ms"] >= 0


async def test_a_request_without_a_traceparent_starts_a_trace_and_only_a_5xx_is_an_error(
        traced_app: Any, exported: tuple[TracerProvider, InMemorySpanExporter],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, exporter = exported

    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    async with serving(traced_app) as client:
        exporter.clear()
        invalid = await client.post("/v1/translate", json={"text": ""})
        missing = await client.get("/no/such/route")
        monkeypatch.setattr(models_route, "_card", bug)
        failed = await client.get("/v1/models")
    assert (invalid.status_code, missing.status_code, failed.status_code) == (422, 404, 500)
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == ["POST /v1/translate", "GET", "GET /v1/models"]  # no stages: never queued
    assert all(span.parent is None for span in spans)
    assert [span.attributes["http.response.status_code"] for span in spans] == [422, 404, 500]
    assert [span.status.status_code == StatusCode.ERROR for span in spans] == [False, False, True]
    assert spans[2].attributes["error.type"] == "RuntimeError"


async def test_a_grpc_call_continues_the_callers_trace_with_its_stages(
        models_dir: Path, fake_model: FakeModel, exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    """A gRPC call's server span (RPC conventions) and stages, as an HTTP request's; a client's
    mistake is no error of the span, a server's fault is."""
    grpc = pytest.importorskip("grpc")
    from service.api import grpc_messages as pb
    from service.api import open_inference

    provider, exporter = exported
    app = create_app(Settings(models_dir=models_dir, batch_workers=1, grpc_port=0), loader=FakeLoader(),
                     generator=lambda runtime: fake_model.generate, tracer_provider=provider)
    request = pb.ModelInferRequest(model_name="translate-en-it")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(open_inference.serialize_bytes(["abc"]))
    async with serving(app), grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel:
        infer = channel.unary_unary(f"/{pb.SERVICE}/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        exporter.clear()
        await infer(request, metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),
                                       ("x-request-id", "traced-2")))
        unknown = pb.ModelInferRequest(model_name="nope")
        with pytest.raises(grpc.aio.AioRpcError):
            await infer(unknown)
        failing = pb.ModelInferRequest()
        failing.CopyFrom(request)
        failing.raw_input_contents[0] = open_inference.serialize_bytes([f"ab{FAIL_CHAR}"])  # its batch raises
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(failing)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        app.state.registry.begin_draining()  # the models still serve; readiness does not
        ready = channel.unary_unary(f"/{pb.SERVICE}/ServerReady",
                                    request_serializer=pb.ServerReadyRequest.SerializeToString,
                                    response_deserializer=pb.ServerReadyResponse.FromString)
        assert not (await ready(pb.ServerReadyRequest())).ready
    spans = exporter.get_finished_spans()
    calls = [span for span in spans if span.kind == SpanKind.SERVER]
    assert [span.name for span in calls] == [f"{pb.SERVICE}/{m}"
                                             for m in ("ModelInfer", "ModelInfer", "ModelInfer", "ServerReady")]
    server = calls[0]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == PARENT_ID
    assert server.attributes["rpc.system"] == "grpc" and server.attributes["rpc.method"] == "ModelInfer"
    assert server.attributes["rpc.service"] == pb.SERVICE and server.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["attnserve.request_id"] == "traced-2"
    assert server.attributes["attnserve.model"] == "translate-en-it"
    stages = {span.name: span for span in spans if span.parent is not None
              and span.parent.span_id == server.context.span_id}
    assert set(stages) == {"prepare", "queue", "inference"}
    for stage in stages.values():
        assert server.start_time <= stage.start_time <= stage.end_time <= server.end_time
    assert calls[1].attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert calls[1].parent is None and calls[1].status.status_code != StatusCode.ERROR
    assert calls[2].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert calls[2].status.status_code == StatusCode.ERROR  # a server's fault is


async def test_without_an_endpoint_nothing_is_traced(make_app: AppFactory) -> None:
    app = make_app()
    assert tracing.tracer_provider(app.state.settings) is None
    assert not any(m.cls is tracing.TracingMiddleware for m in app.user_middleware)


def test_an_endpoint_makes_an_otlp_provider() -> None:
    provider = tracing.tracer_provider(Settings(otlp_endpoint="http://127.0.0.1:9/v1/traces",
                                                otlp_service_name="translator"))
    try:
        assert isinstance(provider, TracerProvider)
        assert provider.resource.attributes["service.name"] == "translator"
    finally:
        provider.shutdown()


async def test_spans_reach_an_otlp_collector_over_http(models_dir: Path, fake_model: FakeModel) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        settings = Settings(models_dir=models_dir, batch_workers=1, otlp_service_name="translator",
                            otlp_endpoint=f"http://127.0.0.1:{collector.server_address[1]}/v1/traces")
        app = create_app(settings, loader=FakeLoader(), generator=lambda runtime: fake_model.generate)
        async with serving(app) as client:
            response = await client.post("/v1/translate", json={"text": "abc"})
        # the lifespan's end shut the provider down: its batch of spans was sent
    finally:
        collector.shutdown()
    assert response.status_code == 200
    spans = {}
    for body in received:
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope_spans in resource_spans.scope_spans:
                spans.update({span.name: service for span in scope_spans.spans})
    assert {"POST /v1/translate", "prepare", "queue", "inference"} <= set(spans)
    assert set(spans.values()) == {"translator"}


def test_serve_without_the_extra_refuses_an_endpoint_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from attnserve import cli

    monkeypatch.setattr(tracing, "available", lambda: False)
    assert cli.main(["serve", "--otlp-endpoint", "http://127.0.0.1:9/v1/traces", "--port", "1"]) == 2
    assert "--otlp-endpoint needs the otel extra: pip install 'attnserve[otel]'" in caplog.text
