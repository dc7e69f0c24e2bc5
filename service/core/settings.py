"""The service's settings: one pydantic-settings object, from `ATTNSERVE_*` variables and flags.

Flags of `attnserve serve` are passed as keyword arguments and win over the environment,
which wins over the defaults here. A list (`ATTNSERVE_PROVIDERS`) is written comma-separated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.core import limits

DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
CPU_PROVIDER = "CPUExecutionProvider"
# Rows and padded source tokens per batch by default: a GPU's step costs its kernel launches
# more than its rows, so it batches 4x the CPU's
BATCH_ROWS = {CPU_PROVIDER: 64, "CUDAExecutionProvider": 256}
BATCH_TOKENS = {CPU_PROVIDER: 8192, "CUDAExecutionProvider": 32768}
# Defaults on the CPU (chosen by bench/results/levers-workers): request-level batches leave the
# model idle while their longest row ends, and a third worker fills that time; a running batch
# (continuous batching) takes newcomers itself, and a worker per core gives it the lower latency.
CPU_BATCH_WORKERS = 3  # request-level batching
CPU_BATCH_WORKERS_CONTINUOUS = 2
# A step computes the vocabulary shortlist only while it holds at most this share of the
# vocabulary (bench/results/shortlist/served: a longer one costs what it saves).
SHORTLIST_SHARE = 0.25


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Settings(BaseSettings):
    """Where the models are, how onnxruntime runs them, and the batching and input limits."""

    model_config = SettingsConfigDict(env_prefix="ATTNSERVE_", frozen=True, extra="ignore")

    # Network (used by `attnserve serve`).
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    # Models and onnxruntime.
    models_dir: Path = Path("models")
    providers: Annotated[tuple[str, ...], NoDecode] = DEFAULT_PROVIDERS
    threads: int = Field(
        default=0, ge=0,
        description="intra-op threads per session; 0 = the cores shared among the batch workers "
        "of all the server processes",
    )
    variant: str | None = Field(default=None, description="force fp32, fp16 or int8")
    spinning: bool = Field(
        default=False, description="onnxruntime's idle intra-op threads spin (else they sleep "
        "and leave the cores to the event loop)",
    )
    step_graph: bool | None = Field(
        default=None, description="continuous batching on the step graph: unset = where the provider "
        "serves it by default (`STEP_GRAPH_BY_DEFAULT`: the CPU and CUDA), true = wherever its attention has a kernel, "
        "false = on the merged decoder",
    )
    lone_step: bool | None = Field(
        default=None, description="a request alone in its running batch decodes in the lone slot (the step "
        "graph and the encoder at fixed dimensions, replayed as CUDA graphs on CUDA): unset = on CUDA, true = wherever "
        "the slots live on a device, false = never",
    )
    gpu_memory_limit_mb: int = Field(
        default=0, ge=0, description="cap of onnxruntime's CUDA memory arena per session (a model's "
        "encoder, decoder and step graph each), in MiB; 0 = no cap",
    )
    cpu_memory_arena: bool = Field(
        default=False, description="onnxruntime keeps its largest batch's CPU buffers (faster "
        "by a few %, but the RSS stays at its peak)",
    )

    # Batching: greedy rows join a running batch between decoder steps (continuous), beam
    # rows (and all rows without it) form request-level batches (dynamic).
    continuous_batching: bool = Field(
        default=True, description="greedy rows join the running batch between decoder steps"
    )
    batch_workers: int = Field(
        default=0, ge=0, le=16,
        description="threads per model, each running its own batches (and running batch); "
        "0 = on the CPU 2 with continuous batching and 3 without (bench/results/levers-workers), "
        "1 on CUDA",
    )
    length_routing: bool = Field(
        default=True, description="batch workers settle into bands of source length: a request "
        "goes to the closest among those within an eighth of max_batch_size of the least loaded",
    )
    max_batch_size: int = Field(
        default=0, ge=0, description="rows (texts) per batch; 0 = 64 on the CPU, 256 on CUDA "
        "(bench/results/gpu)",
    )
    max_batch_tokens: int = Field(
        default=0, ge=0, description="padded tokens x beams per batch; 0 = 8192 on the CPU, 32768 on CUDA",
    )
    max_wait_ms: float = Field(default=5.0, ge=0, description="longest wait to fill a batch")
    max_join_wait_ms: float = Field(
        default=100.0, ge=0,
        description="continuous: longest wait to join the running batch in a group",
    )
    max_beam_wait_ms: float = Field(
        default=0.0, ge=0, description="continuous: while the running batch holds more than "
        "a quarter of max_batch_size rows (a beam-search row's beams counted), a beam-search "
        "request gives way to the greedy requests queued behind it for at most this long (or "
        "half its time to its deadline), then joins (0, the default: it never gives way; "
        "bench/README.md, \"Beam rows giving way\")",
    )
    max_join_age: int = Field(
        default=24, ge=0, description="continuous: rows join a running batch of a quarter of "
        "max_batch_size rows only while its oldest row has run at most this many decoder steps "
        "(scaled inversely with the batch's rows), since every row's cache is as long as the "
        "oldest row's (0 = any age)",
    )
    shortlist_rows: int = Field(
        default=0, ge=0, description="continuous, on the CPU: a decoder step of at most this "
        "many rows computes only the logits of the batch's vocabulary shortlist (while it holds "
        "at most `shortlist_share` of the vocabulary), when the model's repository has one "
        "(`attnserve add-shortlist`); an approximation, off by default (0: always the whole "
        "vocabulary; 1, a row decoding alone: a lone request's choice, slower under a moderate load)",
    )
    shortlist_share: float = Field(
        default=SHORTLIST_SHARE, gt=0, le=1, description="continuous: the largest share of the vocabulary "
        "a step's shortlist may hold to be used (a longer one costs what it saves)",
    )
    greedy_scores: bool = Field(
        default=False, description="sum every greedy result's log-probability (it costs a "
        "log-softmax over the vocabulary every step; rows asking for `return_scores` are scored "
        "either way)",
    )
    max_queue_size: int = Field(default=256, ge=1, description="rows waiting, per model")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After of a 429")

    # Input limits (at most the hard caps of `service.api.schemas`).
    max_texts: int = Field(default=16, ge=1, le=limits.MAX_TEXTS)
    max_text_chars: int = Field(default=2000, ge=1, le=limits.MAX_TEXT_CHARS)
    max_document_chars: int = Field(
        default=20_000, ge=1, le=limits.MAX_TEXT_CHARS,
        description="characters per text on translation models, which split long texts into "
        "sentences (other tasks: max_text_chars)",
    )
    max_segments: int = Field(
        default=128, ge=1, le=limits.MAX_SEGMENTS,
        description="rows one translation request may make, its texts split into sentences "
        "(and at most the queue of one batch worker)",
    )
    max_input_tokens: int | None = Field(
        default=None, ge=1, description="source tokens per text; None = the model's limit"
    )
    default_max_new_tokens: int | None = Field(
        default=None, ge=1, le=limits.MAX_NEW_TOKENS, description="None = the model's limit"
    )
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="larger: 413")

    # Attention maps (`POST /v1/attention`): a response holds layers x heads x queries x keys
    # numbers per kind, so both axes and the total are capped (422 beyond).
    attention_max_source_tokens: int = Field(
        default=128, ge=1, description="source tokens (without EOS) of /v1/attention"
    )
    attention_max_target_tokens: int = Field(
        default=128, ge=1, description="target tokens (given or generated, without EOS)"
    )
    attention_max_cells: int = Field(
        default=1_000_000, ge=1, description="weights in one /v1/attention response, all kinds"
    )

    # Deadlines and shutdown.
    request_timeout_s: float = Field(
        default=60.0, gt=0,
        description="per request: the default and the cap of its X-Request-Timeout-Ms header",
    )
    graceful_timeout_s: float | None = Field(
        default=None, ge=0, description="drain after SIGTERM; at least request_timeout_s, which "
        "a request admitted just before may still take; None = request_timeout_s",
    )
    shutdown_delay_s: float = Field(
        default=0.0, ge=0, description="after SIGTERM, keep accepting (readiness 503) this long"
    )

    # Slow and many clients (`service.process.http`, `service.api.app`).
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="a connection's request headers must arrive within this "
        "(from its opening or its previous response); else 408 and closed",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="a request's body must arrive within this of its "
        "headers; else 408 and closed",
    )
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, description="larger headers: 431")
    max_connections: int = Field(
        default=1000, ge=1, description="open connections per process; more are answered 503 "
        "and closed",
    )
    keep_alive_timeout_s: float = Field(
        default=5.0, gt=0, description="an idle keep-alive connection is closed after this"
    )
    max_large_responses: int = Field(
        default=4, ge=1, description="concurrent /v1/attention requests (their responses run to "
        "megabytes, held until a slow client has read them); more get 429",
    )

    # Security and operations.
    api_key: SecretStr | None = Field(
        default=None, description="bearer token the inference routes require; None = open"
    )
    public_metadata: bool = Field(
        default=False, description="with api_key: the docs, the OpenAPI document and the model "
        "listing stay open (else they need the token too)",
    )
    cors_origins: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="origins allowed by CORS, comma-separated; empty = closed"
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve /metrics on this port instead of the main one",
    )
    grpc_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve KServe v2 over gRPC on this port too (tritonclient[grpc]; needs the grpc "
        "extra; 0: any free port); None = no gRPC",
    )
    otlp_endpoint: str | None = Field(
        default=None, description="send a trace span per request to this OTLP/HTTP collector URL "
        "(e.g. http://localhost:4318/v1/traces; needs the otel extra); None = no tracing",
    )
    otlp_service_name: str = Field(default="attnserve", description="the traces' service.name")
    access_log: bool = Field(
        default=True, description="one line per HTTP request on the attnserve.access logger (INFO)",
    )
    fail_on_model_error: bool = Field(
        default=False, description="refuse to start when a model fails to load (else live, "
        "not ready)",
    )
    workers: int = Field(
        default=1, ge=1, le=64, description="server processes on one socket, restarted if killed"
    )
    model_control: bool = Field(
        default=False, description="clients may load, reload and unload models while serving "
        "(KServe v2's model repository routes; with the API key when one is set; workers=1)",
    )

    @field_validator("providers", "cors_origins", mode="before")
    @classmethod
    def _split_providers(cls, value: object) -> object:
        """`"CUDAExecutionProvider, CPUExecutionProvider"` -> a tuple of names (origins too)."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        """`ATTNSERVE_API_KEY=` (empty) leaves the routes open rather than accepting ""."""
        return None if value == "" else value

    @field_validator("providers")
    @classmethod
    def _providers_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one execution provider is needed")
        return value

    @property
    def drain_timeout_s(self) -> float:
        """How long a shutdown waits for in-flight work: `graceful_timeout_s`, or
        `request_timeout_s` when not set."""
        if self.graceful_timeout_s is None:
            return self.request_timeout_s
        return self.graceful_timeout_s

    def batch_workers_on(self, provider: str) -> int:
        """Batch workers per model on `provider` (`batch_workers`, or its default)."""
        if self.batch_workers:
            return self.batch_workers
        if provider != CPU_PROVIDER:
            return 1
        return CPU_BATCH_WORKERS_CONTINUOUS if self.continuous_batching else CPU_BATCH_WORKERS

    def max_batch_size_on(self, provider: str) -> int:
        """Rows per batch on `provider` (`max_batch_size`, or its default)."""
        return self.max_batch_size or BATCH_ROWS.get(provider, BATCH_ROWS[CPU_PROVIDER])

    def max_batch_tokens_on(self, provider: str) -> int:
        """Padded tokens x beams per batch on `provider` (`max_batch_tokens`, or its default)."""
        return self.max_batch_tokens or BATCH_TOKENS.get(provider, BATCH_TOKENS[CPU_PROVIDER])

    def session_threads(self) -> int:
        """Intra-op threads per onnxruntime session: `threads`, or the cores shared among the
        CPU batch workers of all the server processes (`workers`), so that each worker's decoder
        call runs on its own cores."""
        return self.threads or max(1, cpu_cores() // (self.batch_workers_on(CPU_PROVIDER) * self.workers))

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.max_texts > self.max_queue_size:
            raise ValueError("max_texts must not exceed max_queue_size")
        if self.metrics_port is not None and self.workers > 1:
            raise ValueError("metrics_port needs workers=1 (each worker has its own metrics)")
        if self.model_control and self.workers > 1:
            raise ValueError("model_control needs workers=1 (a load would reach one worker only)")
        if self.grpc_port and self.grpc_port in (self.port, self.metrics_port):
            raise ValueError("grpc_port must differ from port and metrics_port")
        if self.graceful_timeout_s is not None and self.graceful_timeout_s < self.request_timeout_s:
            raise ValueError("graceful_timeout_s must be at least request_timeout_s: a request "
                             "admitted just before the shutdown may take that long")
        return self
