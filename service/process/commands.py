"""Subcommands of `attnserve` provided by `service/`: serve, and generate (a text file through a
model in-process: `service.process.offline`)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.core.registry import ModelRegistry
    from service.core.settings import Settings

logger = logging.getLogger(__name__)

# Flags of `serve` that override a `Settings` field of the same name (None = not given).
_SETTING_FLAGS = (
    "host", "port", "models_dir", "providers", "threads", "variant", "batch_workers", "max_batch_size",
    "max_batch_tokens", "max_wait_ms", "max_queue_size", "continuous_batching", "length_routing",
    "max_join_wait_ms", "max_beam_wait_ms", "max_join_age", "shortlist_rows", "shortlist_share", "greedy_scores", "spinning", "cpu_memory_arena", "step_graph", "lone_step", "gpu_memory_limit_mb",
    "request_timeout_s",
    "graceful_timeout_s", "shutdown_delay_s", "workers", "metrics_port", "cors_origins",
    "fail_on_model_error", "header_timeout_s", "body_timeout_s", "max_connections",
    "max_large_responses", "public_metadata", "access_log", "otlp_endpoint", "otlp_service_name",
    "grpc_port", "model_control",
)


def register(subcommands: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to the `attnserve` parser."""
    _register_serve(subcommands)
    _register_generate(subcommands)


LINES_PER_PART = 20_000  # `generate` reads and decodes a file this many lines at a time


def _register_generate(subcommands: argparse._SubParsersAction) -> None:
    """`attnserve generate`: a text file through a model in-process, one output line per line."""
    p = subcommands.add_parser(
        "generate",
        help="translate (or summarize) a text file in-process, one output line per input line",
        description="Decode every line of a text file with a model folder, without a server: a "
        "translation model's lines are cut into sentences as the server cuts them and joined back; "
        "all the rows decode in running batches fed shortest first, one per replica thread. With "
        "--temperature the outputs are sampled (back-translation); --seed makes them repeatable.",
    )
    p.add_argument("--model", required=True, help="a model folder (e.g. models/translate-en-it)")
    p.add_argument("--input", default="-", help="text file, one text per line (default -: standard input)")
    p.add_argument("--output", default="-", help="where the outputs go, one per line (default -: standard output)")
    p.add_argument("--beam-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, help="default: the model's target length")
    p.add_argument("--temperature", type=float, help="above 0: sample each token at this temperature")
    p.add_argument("--top-k", type=int, help="with --temperature: draw from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling")
    p.add_argument("--seed", type=int, help="with --temperature: the same seed gives the same outputs")
    p.add_argument("--rows", type=int, default=64, help="rows of each running batch (default 64)")
    p.add_argument("--replicas", type=int, default=0,
                   help="threads decoding side by side, each with its own batch (default 0: one per core)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per call (default 1)")
    p.add_argument("--providers", default="CPUExecutionProvider",
                   help="onnxruntime execution providers, comma-separated (default CPUExecutionProvider)")
    p.add_argument("--variant", help="force a model variant (fp32, fp16, int8)")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import os
    import sys

    from service.api.decode_options import sampling
    from service.core.errors import InvalidInput
    from service.process.offline import batched, generate_lines
    from service.runtime import ModelRuntime

    try:
        sampled = sampling(args.temperature, args.top_k, args.top_p, args.seed, args.beam_size, where="--")
    except InvalidInput as error:
        logger.error("%s", error.message.replace("_", "-"))
        return 2
    if args.beam_size < 1 or args.rows < 1 or args.replicas < 0 or args.threads < 0:
        logger.error("--beam-size and --rows must be >= 1, --replicas and --threads >= 0")
        return 2
    replicas = args.replicas or os.cpu_count() or 1
    runtime = ModelRuntime.load(args.model, args.providers.split(","), threads=args.threads, variant=args.variant)
    source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")  # noqa: SIM115
    target = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    first_row = 0
    try:
        for part in batched((line.rstrip("\r\n") for line in source), LINES_PER_PART):
            outputs, rows = generate_lines(runtime, part, args.beam_size, args.max_new_tokens, sampled,
                                           args.rows, replicas, first_row)
            first_row += rows
            target.writelines(output.replace("\r", " ").replace("\n", " ") + "\n" for output in outputs)
            target.flush()
    except InvalidInput as error:
        logger.error("%s", error.message)
        return 2
    finally:
        if source is not sys.stdin:
            source.close()
        if target is not sys.stdout:
            target.close()
    return 0


def _register_serve(subcommands: argparse._SubParsersAction) -> None:
    """`attnserve serve`: the HTTP server over the model repository."""
    p = subcommands.add_parser(
        "serve",
        help="serve the models of a model repository over HTTP",
        description="Serve every model folder of a model repository (translate, summarize) "
        "with continuous and dynamic batching on onnxruntime. Every option can also be set with an "
        "ATTNSERVE_<NAME> environment variable (e.g. ATTNSERVE_MAX_BATCH_SIZE); flags win.",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8000)")
    p.add_argument("--models", dest="models_dir", help="model repository (default ./models)")
    p.add_argument("--providers", help="onnxruntime execution providers, comma-separated, "
                   "in order of preference (default CUDAExecutionProvider,CPUExecutionProvider)")
    p.add_argument("--threads", type=int,
                   help="intra-op threads per session (default 0: the cores divided among the batch workers "
                   "of all the server processes)")
    p.add_argument("--batch-workers", type=int,
                   help="threads per model, each running its own batches (default 0: on the CPU 2 with "
                   "continuous batching, 3 without; 1 on CUDA)")
    p.add_argument("--variant", help="force a model variant (fp32, fp16, int8)")
    p.add_argument("--spinning", action=argparse.BooleanOptionalAction,
                   help="let onnxruntime's idle threads spin between calls (default off: they "
                   "sleep, leaving the cores to the HTTP event loop)")
    p.add_argument("--step-graph", action=argparse.BooleanOptionalAction,
                   help="continuous batching on the step graph (default: wherever its attention has a "
                   "kernel on the provider; --no-step-graph: on the merged decoder)")
    p.add_argument("--lone-step", action=argparse.BooleanOptionalAction,
                   help="decode a request alone in its running batch in the lone slot: the step graph and "
                   "the encoder at fixed dimensions, replayed as CUDA graphs (default: on CUDA)")
    p.add_argument("--gpu-memory-limit-mb", type=int,
                   help="cap of onnxruntime's CUDA memory arena per session (encoder, decoder, step "
                   "graph of each model), in MiB (default 0: no cap)")
    p.add_argument("--cpu-memory-arena", action=argparse.BooleanOptionalAction,
                   help="let onnxruntime keep its largest batch's CPU buffers (default off: "
                   "lower RSS, a few %% slower)")
    p.add_argument("--length-routing", action=argparse.BooleanOptionalAction,
                   help="with several batch workers, send a request to the one whose rows have "
                   "the closest source length among the nearly least loaded (default on; "
                   "--no-length-routing: the least loaded)")
    p.add_argument("--max-batch-size", type=int, help="rows per batch (default 0: 64 on the CPU, 256 on CUDA)")
    p.add_argument("--max-batch-tokens", type=int,
                   help="padded source tokens x beams per batch (default 0: 8192 on the CPU, 32768 on CUDA)")
    p.add_argument("--max-wait-ms", type=float, help="longest wait for a batch (default 5)")
    p.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction,
                   help="greedy requests join the running batch between decoder steps "
                   "(default on; --no-continuous-batching: request-level batches only)")
    p.add_argument("--max-join-wait-ms", type=float,
                   help="continuous batching: longest wait to join the running batch in a "
                   "group of a quarter of --max-batch-size (default 100)")
    p.add_argument("--max-beam-wait-ms", type=float,
                   help="continuous batching: longest a beam-search request gives way to greedy "
                   "requests while the running batch holds more than a quarter of "
                   "--max-batch-size rows (default 0: never)")
    p.add_argument("--max-join-age", type=int,
                   help="continuous batching: rows join only while the running batch's oldest row "
                   "has run at most this many decoder steps (default 24; 0: any)")
    p.add_argument("--shortlist-rows", type=int,
                   help="continuous batching: steps of at most this many rows compute only the "
                   "vocabulary shortlist's logits, for models that ship one (default 0: never; 1: a row decoding alone, "
                   "faster for lone requests, slower under a moderate load)")
    p.add_argument("--shortlist-share", type=float,
                   help="continuous batching: the shortlist is used while it holds at most this share of "
                   "the vocabulary (default 0.25)")
    p.add_argument("--greedy-scores", action=argparse.BooleanOptionalAction,
                   help="sum each greedy result's log-probability (not returned by the API; a "
                   "log-softmax over the vocabulary every step; default off)")
    p.add_argument("--max-queue-size", type=int,
                   help="rows waiting per model before 429 (default 256)")
    p.add_argument("--request-timeout-s", type=float, help="deadline per request (default 60)")
    p.add_argument("--graceful-timeout-s", type=float,
                   help="how long SIGTERM waits for in-flight requests (default: the request "
                   "timeout; never less)")
    p.add_argument("--shutdown-delay-s", type=float,
                   help="after SIGTERM keep accepting requests this long, readiness 503, "
                   "so load balancers stop routing first (default 0)")
    p.add_argument("--workers", type=int,
                   help="server processes sharing the port, each restarted if it dies; every "
                   "one loads every model (default 1)")
    p.add_argument("--metrics-port", type=int,
                   help="serve /metrics on this port instead of the main one (workers=1)")
    p.add_argument("--grpc-port", type=int,
                   help="serve KServe v2 over gRPC on this port too, for tritonclient[grpc] (needs the "
                   "grpc extra; default: no gRPC)")
    p.add_argument("--cors-origins",
                   help="origins allowed by CORS, comma-separated (default: none, closed)")
    p.add_argument("--header-timeout-s", type=float,
                   help="a request's headers must arrive within this, else 408 (default 10)")
    p.add_argument("--body-timeout-s", type=float,
                   help="a request's body must arrive within this of its headers, else 408 "
                   "(default 30)")
    p.add_argument("--max-connections", type=int,
                   help="open connections per process; more are answered 503 (default 1000)")
    p.add_argument("--max-large-responses", type=int,
                   help="concurrent /v1/attention requests; more get 429 (default 4)")
    p.add_argument("--public-metadata", action="store_const", const=True,
                   help="with an API key, leave the docs and the model listing open")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction,
                   help="log one line per HTTP request, with its X-Request-ID, on the attnserve.access "
                   "logger at INFO (default on)")
    p.add_argument("--otlp-endpoint",
                   help="send a trace span per request (and its stages) to this OTLP/HTTP collector, "
                   "e.g. http://localhost:4318/v1/traces (needs the otel extra; default: no tracing)")
    p.add_argument("--otlp-service-name", help="the traces' service.name (default attnserve)")
    p.add_argument("--model-control", action="store_const", const=True,
                   help="let clients load, reload and unload models while serving (KServe v2's model "
                   "repository routes, /v2/repository/...; with the API key when one is set; workers=1)")
    p.add_argument("--fail-on-model-error", action="store_const", const=True,
                   help="exit (non-zero status) when a model fails to load, instead of staying "
                   "live and not ready")
    p.set_defaults(func=_serve)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of `serve`: the environment's (ATTNSERVE_*), overridden by the flags given."""
    from service.core.settings import Settings

    return Settings(**{name: getattr(args, name) for name in _SETTING_FLAGS if getattr(args, name, None) is not None})


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except ValidationError as error:
        logger.error("invalid settings: %s", error)
        return 2
    from service.observability import tracing

    if settings.otlp_endpoint and not tracing.available():
        logger.error("--otlp-endpoint needs the otel extra: %s", tracing.EXTRA_HINT)
        return 2
    if settings.grpc_port is not None and not _grpc_available():
        logger.error("--grpc-port needs the grpc extra: %s", GRPC_EXTRA_HINT)
        return 2
    if settings.workers > 1:
        from service.process.workers import run_workers

        logger.info("serving %s on http://%s:%d with %d workers", settings.models_dir,
                    settings.host, settings.port, settings.workers)
        return run_workers(settings)
    # one process: the app's modules load here (the supervisor of `--workers` never imports them)
    import uvicorn  # lazy: only the serve extra has it

    from service.api.app import create_app
    from service.process.http import uvicorn_options

    if settings.metrics_port is not None:
        from service.observability.metrics_server import start_metrics_server

        start_metrics_server(settings.metrics_port, settings.host)
    app = create_app(settings)
    # one process owns the models and the batcher (see service/observability/metrics.py)
    config = uvicorn.Config(app, workers=1, **uvicorn_options(settings))
    server = _draining_server(config, app.state.registry, settings.shutdown_delay_s)
    # uvicorn re-raises the signal that stopped it once it has drained; with this handler
    # in place a drained SIGTERM (or Ctrl-C) ends the process with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _after_drain)
    logger.info("serving %s on http://%s:%d", settings.models_dir, settings.host, settings.port)
    server.run()
    if not server.started:
        logger.error("the server did not start")
        return 1
    logger.info("drained and stopped")
    return 0


GRPC_EXTRA_HINT = "pip install 'attnserve[grpc]'"


def _grpc_available() -> bool:
    """Whether the `grpc` extra (grpcio and protobuf) is installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("grpc", "google.protobuf"))


def _draining_server(config: Any, registry: ModelRegistry, delay_s: float) -> Any:
    """A uvicorn server whose shutdown signal turns readiness to 503 first.

    With `delay_s` > 0 the server keeps accepting for that long before uvicorn's graceful
    shutdown starts (a second signal does not wait).
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not registry.draining
            registry.begin_draining()
            if first and delay_s > 0:
                logger.info("shutting down in %.1fs", delay_s)
                stop = threading.Timer(delay_s, super().handle_exit, (sig, frame))
                stop.daemon = True
                stop.start()
                return
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def _after_drain(sig: int, frame: FrameType | None) -> None:
    """Handler restored by uvicorn after a graceful shutdown: nothing left to do."""
