"""The Prometheus metrics of `service.observability.metrics`: names, labels, exposition, promtool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.observability import metrics

# The design's list (DESIGN.md, "Metrics"): name -> (type, label names).
DESIGN = {
    "attnserve_requests_total": ("counter", {"route", "model", "status"}),
    "attnserve_request_duration_seconds": ("histogram", {"route", "model"}),
    "attnserve_queue_duration_seconds": ("histogram", {"model"}),
    "attnserve_inference_duration_seconds": ("histogram", {"model"}),
    "attnserve_time_per_output_token_seconds": ("histogram", {"model"}),
    "attnserve_queue_depth": ("gauge", {"model"}),
    "attnserve_admission_share": ("gauge", {"model"}),
    "attnserve_batch_size": ("histogram", {"model"}),
    "attnserve_batch_cache_bytes": ("gauge", {"model"}),
    "attnserve_input_tokens_total": ("counter", {"model"}),
    "attnserve_generated_tokens_total": ("counter", {"model"}),
    "attnserve_rejected_total": ("counter", {"model", "reason"}),
    "attnserve_cancelled_rows_total": ("counter", {"model", "stage"}),
    "attnserve_model_info": ("gauge", {"model", "task", "provider", "variant"}),
    "attnserve_model_load_seconds": ("gauge", {"model"}),
    "attnserve_connections_refused_total": ("counter", {"reason"}),
    "attnserve_open_connections": ("gauge", set()),
}


def _family_of(sample_name: str) -> str:
    """The design name a sample belongs to: `…_seconds_bucket` -> `…_seconds`."""
    for suffix in ("_bucket", "_count", "_sum"):
        if sample_name not in DESIGN and sample_name.removesuffix(suffix) in DESIGN:
            return sample_name.removesuffix(suffix)
    return sample_name


def _design_name(name: str, kind: str) -> str:
    """prometheus-client drops `_total` from a counter's family name; the design keeps it."""
    return name + "_total" if kind == "counter" else name


def _observe_everything(model: str) -> None:
    """One or more observations on every metric, for `model`."""
    metrics.REQUESTS_TOTAL.labels("/v1/translate", model, "2xx").inc(3)
    metrics.REQUEST_DURATION_SECONDS.labels("/v1/translate", model).observe(0.2)
    metrics.QUEUE_DURATION_SECONDS.labels(model).observe(0.004)
    metrics.INFERENCE_DURATION_SECONDS.labels(model).observe(0.15)
    metrics.TIME_PER_OUTPUT_TOKEN_SECONDS.labels(model).observe(0.003)
    metrics.QUEUE_DEPTH.labels(model).set(5)
    metrics.ADMISSION_SHARE.labels(model).set(0.5)
    for rows in (1, 3, 8):
        metrics.BATCH_SIZE.labels(model).observe(rows)
    metrics.BATCH_CACHE_BYTES.labels(model).set(4096)
    metrics.INPUT_TOKENS_TOTAL.labels(model).inc(7)
    metrics.GENERATED_TOKENS_TOTAL.labels(model).inc(9)
    metrics.REJECTED_TOTAL.labels(model, "queue_full").inc()
    metrics.CANCELLED_ROWS_TOTAL.labels(model, "decoding").inc()
    metrics.MODEL_INFO.labels(model, "translate", "CPUExecutionProvider", "int8").set(1)
    metrics.MODEL_LOAD_SECONDS.labels(model).set(1.5)
    metrics.CONNECTIONS_REFUSED_TOTAL.labels("header_timeout").inc()
    metrics.OPEN_CONNECTIONS.set(2)


def _samples_of(model: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The exposition's samples labelled with `model`, parsed back: (name, labels) -> value."""
    body, _ = metrics.render_latest()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.labels.get("model") == model
    }


def test_families_match_the_design_exactly() -> None:
    families = {_design_name(f.name, f.type): f.type for f in metrics.REGISTRY.collect()}
    assert families == {name: kind for name, (kind, _) in DESIGN.items()}


def test_label_names_match_the_design() -> None:
    model = "test-labels-model"
    _observe_everything(model)
    labels: dict[str, set[str]] = {}
    for name, sample_labels in _samples_of(model):
        if name.endswith("_created"):
            continue
        labels.setdefault(_family_of(name), set()).update(
            key for key, _ in sample_labels if key != "le"
        )
    assert labels == {name: names for name, (_, names) in DESIGN.items() if "model" in names}
    server_level = {_design_name(f.name, f.type): {k for s in f.samples for k in s.labels}
                    for f in metrics.REGISTRY.collect()
                    if _design_name(f.name, f.type) in DESIGN
                    and "model" not in DESIGN[_design_name(f.name, f.type)][1]}
    assert server_level == {name: names for name, (_, names) in DESIGN.items()
                            if "model" not in names}


def test_metric_names_cover_every_sample_name() -> None:
    _observe_everything("test-names-model")
    names = metrics.metric_names()
    assert set(DESIGN) <= names
    assert {name for name, _ in _samples_of("test-names-model")} <= names
    assert all(name.startswith("attnserve_") for name in names)


@pytest.mark.parametrize(
    ("code", "label"), [(200, "2xx"), (404, "4xx"), (429, "4xx"), (503, "5xx")]
)
def test_status_class(code: int, label: str) -> None:
    assert metrics.status_class(code) == label


def test_exposition_has_the_observed_values() -> None:
    model = "test-values-model"
    _observe_everything(model)
    samples = _samples_of(model)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset({"model": model, **labels}.items()))]

    route = "/v1/translate"
    assert value("attnserve_requests_total", route=route, status="2xx") == 3
    assert value("attnserve_request_duration_seconds_count", route=route) == 1
    assert value("attnserve_request_duration_seconds_sum", route=route) == pytest.approx(0.2)
    assert value("attnserve_request_duration_seconds_bucket", route=route, le="0.25") == 1
    assert value("attnserve_request_duration_seconds_bucket", route=route, le="0.1") == 0
    assert value("attnserve_queue_duration_seconds_bucket", le="0.005") == 1
    assert value("attnserve_inference_duration_seconds_sum") == pytest.approx(0.15)
    assert value("attnserve_time_per_output_token_seconds_count") == 1
    assert value("attnserve_queue_depth") == 5
    assert value("attnserve_batch_size_bucket", le="1.0") == 1
    assert value("attnserve_batch_size_bucket", le="4.0") == 2
    assert value("attnserve_batch_size_bucket", le="8.0") == 3
    assert value("attnserve_batch_size_bucket", le="+Inf") == 3
    assert value("attnserve_batch_size_sum") == 12
    assert value("attnserve_input_tokens_total") == 7
    assert value("attnserve_generated_tokens_total") == 9
    assert value("attnserve_rejected_total", reason="queue_full") == 1
    info = {"task": "translate", "provider": "CPUExecutionProvider", "variant": "int8"}
    assert value("attnserve_model_info", **info) == 1
    assert value("attnserve_model_load_seconds") == 1.5


def test_batch_size_buckets() -> None:
    model = "test-buckets-model"
    metrics.BATCH_SIZE.labels(model).observe(1)
    bounds = [
        dict(labels)["le"]
        for name, labels in _samples_of(model)
        if name == "attnserve_batch_size_bucket"
    ]
    assert sorted(bounds, key=float) == [
        "1.0",
        "2.0",
        "4.0",
        "8.0",
        "16.0",
        "32.0",
        "64.0",
        "128.0",
        "+Inf",
    ]


def test_render_latest_is_the_classic_text_format() -> None:
    body, content_type = metrics.render_latest()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE attnserve_request_duration_seconds histogram" in body


def test_promtool_accepts_the_exposition() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian/Ubuntu package `prometheus`)")
    _observe_everything("test-promtool-model")
    body, _ = metrics.render_latest()
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_forget_dead_processes_takes_only_the_dead_ones_live_gauges(tmp_path: Path) -> None:
    from service.observability.metrics import forget_dead_processes

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead, alive = int(finished.stdout), os.getpid()
    names = [f"gauge_livesum_{dead}.db", f"gauge_livemax_{dead}.db", f"counter_{dead}.db",
             f"gauge_livesum_{alive}.db", f"gauge_all_{dead}.db"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert forget_dead_processes(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"counter_{dead}.db", f"gauge_livesum_{alive}.db", f"gauge_all_{dead}.db"])  # counts stay
