"""bench.tracing_cost at a few requests: both arms timed, tracing adds CPU, a lower sampled share
adds less."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench.tracing_cost import SCOPE, app, main

pytest.importorskip("opentelemetry.sdk")


def test_the_apps_answer_and_the_traced_one_makes_the_servers_spans() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    traced = TracerProvider()
    traced.add_span_processor(SimpleSpanProcessor(exporter))
    for provider in (None, traced):
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict[str, Any], sent: list[dict[str, Any]] = sent) -> None:
            sent.append(message)

        asyncio.run(app(provider)({**SCOPE, "state": {}}, receive, send))
        assert sent[0]["status"] == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/translate", "prepare", "queue", "inference"}
    assert spans["POST /v1/translate"].attributes["attnserve.request_id"] == "0" * 32


def test_tracing_cost_times_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert main(["--requests", "300", "--rounds", "2", "--sampled", "1", "0", "--out", str(out)]) == 0
    full, none = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert (full["sampled"], none["sampled"]) == (1.0, 0.0)
    for run in (full, none):
        assert len(run["rounds_us"]["with tracing"]) == len(run["rounds_us"]["without tracing"]) == 2
    # four recorded and encoded spans a request cost more than non-recording ones
    assert full["added_us"] > none["added_us"]
