"""Results files: JSON, markdown table, PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.targets import evaluate

pytest.importorskip("matplotlib")


def _run(rate: float, p50: float) -> dict[str, float | int]:
    return {"sentences": 10, "target_tokens": 100, "elapsed_s": 1.0, "sentences_per_s": rate,
            "tokens_per_s": rate * 10, "latency_p50_s": p50, "latency_p95_s": p50 * 2,
            "latency_p99_s": p50 * 3, "errors": 0}


def _results() -> dict:
    task = {
        "task": "translate", "sentences": 10,
        "service": {"continuous": {"closed": {"c1": _run(5, 0.2), "c8": _run(30, 0.3)},
                                    "open": {**_run(20, 0.25), "offered_rate": 21.0}, "peak_rss_mb": 321.5},
                    "batching_off": {"closed": {"c1": _run(5, 0.2), "c8": _run(6, 1.2)}}},
        "in_process": {"variant": "fp32", "b1": _run(6, 0.15), "b8": _run(40, 0.2)},
        "naive": {"closed": {"c1": _run(2, 0.5)}, "peak_rss_mb": 700.0},
        "ctranslate2": {"int8_greedy_batch": _run(50, 0.2), "int8_greedy_single": _run(8, 0.12)},
        "agreement_fp32_vs_onnx_fp32": 0.9,
    }
    return {"name": "t", "label": "smoke", "servers": {"service_continuous": {"peak_rss_mb": 321.5}}, "command": "attnserve bench --quick", "tasks": {"tiny": task},
            "targets": [t.to_dict() for t in evaluate(task, top_concurrency=8)]}


def test_stats_rows_finds_every_run() -> None:
    names = [name for name, _ in report.stats_rows(_results()["tasks"]["tiny"])]
    assert "service / continuous / closed / c8" in names
    assert "service / continuous / open" in names
    assert "in_process / b8" in names
    assert "ctranslate2 / int8_greedy_single" in names
    assert len(names) == 10


def test_write_json_markdown_and_plot(tmp_path: Path) -> None:
    results = _results()
    paths = report.write(results, tmp_path / "out", "t")
    assert [p.name for p in paths] == ["t.json", "t.md", "t-tiny.png"]
    assert json.loads(paths[0].read_text(encoding="utf-8")) == results
    markdown = paths[1].read_text(encoding="utf-8")
    assert "| service / continuous / closed / c8 | 30 | 300 | 0.300 | 0.600 | 0.900 | 0 |" in markdown
    assert "| naive / closed / c1 |" in markdown
    assert "agreement_fp32_vs_onnx_fp32: 90.0%" in markdown
    # service c8 30/s vs CTranslate2 50/s: 0.6, missed; vs naive 2/s: 15x, met
    assert "| 0.600 | ≥ 1.00 | missed |" in markdown
    assert "| 15.000 | ≥ 5.00 | met |" in markdown
    assert "| service_continuous | 322 | - |" in markdown
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[2].stat().st_size > 10_000
