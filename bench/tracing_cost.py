"""What tracing (`--otlp-endpoint`) costs per request: a FastAPI app with the server's tracing
(FastAPI's request span, `TracingMiddleware`'s attributes and stage spans) against the same app
without it, in alternating rounds.

    python -m bench.tracing_cost --out bench/results/tracing/tracing_cost.json

The app's one route answers at once with a `RequestTiming` of a generation request in its state
(so each traced request makes the server span and its three stage spans, as a translation does),
called as ASGI without a server; the spans go to opentelemetry's `BatchSpanProcessor` and an
exporter that encodes each batch as the OTLP/HTTP exporter does and drops it, so the figure is
the SDK's work in the request and in its export thread, without the network. `--sampled` sets the
share of traces kept (the `traceidratio` sampler: the rest cost a non-recording span each). The
report gives the process CPU microseconds per request of each arm (median of the rounds) and
their difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from bench import machine
from service.observability.timing import RequestTiming
from service.observability.tracing import TracingMiddleware, telemetry_config

SCOPE = {"type": "http", "http_version": "1.1", "scheme": "http", "method": "POST", "path": "/v1/translate",
         "raw_path": b"/v1/translate", "query_string": b"", "root_path": "",
         "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 5000),
         "server": ("127.0.0.1", 8000)}


def app(traced_provider: Any | None) -> Any:
    """A FastAPI app whose one route answers at once, leaving a generation request's state; with
    `traced_provider`, traced as the server traces."""
    answering = FastAPI(telemetry=telemetry_config(traced_provider))

    @answering.post("/v1/translate")
    async def translate(request: Request) -> dict[str, str]:
        now = time.perf_counter()
        timing = RequestTiming(now - 0.010)
        timing.queued(now - 0.0095)
        timing.admitted(now - 0.009, now - 0.0095)
        timing.joined(0.002)
        timing.finished_at(now - 0.0005)
        request.state.timing, request.state.request_id, request.state.model = timing, "0" * 32, "translate-en-it"
        return {}

    if traced_provider is not None:
        answering.add_middleware(TracingMiddleware, provider=traced_provider)
    return answering


def provider(sampled: float, queue: int) -> Any:
    """A tracer provider keeping `sampled` of the traces, encoding them in batches for nowhere (a
    queue of `queue` spans: none dropped)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    class Dropping(SpanExporter):
        """Encodes each batch as the OTLP/HTTP exporter does, then drops it."""

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    traced = TracerProvider(sampler=TraceIdRatioBased(sampled))
    traced.add_span_processor(BatchSpanProcessor(Dropping(), max_queue_size=queue))
    return traced


async def cpu_us(app: Any, requests: int, flush: Any = None) -> float:
    """Process CPU microseconds per request of `app`, over `requests` requests and `flush()` (the
    export of their spans), when given."""
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    started = time.process_time()
    for _ in range(requests):
        await app({**SCOPE, "state": {}}, receive, send)
    if flush is not None:
        flush()
    return (time.process_time() - started) / requests * 1e6


def measure(requests: int, rounds: int, sampled: float) -> dict[str, Any]:
    """Both arms in alternating rounds: CPU microseconds per request of each, per round."""
    traced_provider = provider(sampled, 8 * requests)
    arms = {"without tracing": app(None), "with tracing": app(traced_provider)}
    flushes = {"without tracing": None, "with tracing": traced_provider.force_flush}
    rounds_us: dict[str, list[float]] = {name: [] for name in arms}

    async def run() -> None:
        for name, arm in arms.items():  # warm-up
            await cpu_us(arm, max(requests // 10, 1), flushes[name])
        for turn in range(rounds):
            for name in (list(arms) if turn % 2 == 0 else list(arms)[::-1]):
                rounds_us[name].append(await cpu_us(arms[name], requests, flushes[name]))

    asyncio.run(run())
    traced_provider.shutdown()
    medians = {name: statistics.median(values) for name, values in rounds_us.items()}
    return {"sampled": sampled, "us_per_request": medians,
            "added_us": medians["with tracing"] - medians["without tracing"], "rounds_us": rounds_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sampled", type=float, nargs="*", default=[1.0, 0.1])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = {"command": shlex.join(["python", "-m", "bench.tracing_cost", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine.describe(), "requests": args.requests, "rounds": args.rounds,
              "runs": [measure(args.requests, args.rounds, share) for share in args.sampled]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for run in result["runs"]:
        print(f"sampled {run['sampled']:g}: {run['us_per_request']['without tracing']:.1f} -> "
              f"{run['us_per_request']['with tracing']:.1f} us CPU per request (+{run['added_us']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
