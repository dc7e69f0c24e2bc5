"""bench.tracing_cost at a few requests: both arms timed, tracing adds CPU, a lower sampled share
adds less."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tracing_cost import main

pytest.importorskip("opentelemetry.sdk")


def test_tracing_cost_times_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert main(["--requests", "300", "--rounds", "2", "--sampled", "1", "0", "--out", str(out)]) == 0
    full, none = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert (full["sampled"], none["sampled"]) == (1.0, 0.0)
    for run in (full, none):
        assert len(run["rounds_us"]["with tracing"]) == len(run["rounds_us"]["without tracing"]) == 2
    # four recorded and encoded spans a request cost more than non-recording ones
    assert full["added_us"] > none["added_us"]
