"""`attnserve bench` end to end on the tiny repository: every system, every results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ctranslate2")
pytest.importorskip("matplotlib")


def test_bench_runs_every_system(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from attnserve.cli import main

    models, data = tiny_bench_dirs
    out = tmp_path / "results"
    status = main(["--log-level", "WARNING", "bench", "--models", str(models), "--data-dir", str(data),
                   "--out", str(out), "--name", "tiny", "--sentences", "6", "--concurrency", "1", "3",
                   "--duration-s", "60", "--open-duration-s", "1", "--open-repeats", "2", "--open-slices", "2", "--batch-sizes", "1", "4",
                   "--single-sentences", "3", "--naive-requests", "3", "--threads", "1", "--service-workers", "3",
                   "--service-processes", "2"])
    assert status == 0
    results = json.loads((out / "tiny.json").read_text(encoding="utf-8"))
    task = results["tasks"]["tiny-reverse"]
    assert task["sentences"] == 6
    for mode in ("continuous", "dynamic", "batching_off"):
        closed = task["service"][mode]["closed"]
        assert set(closed) == {"c1", "c3"}
        assert all(run["sentences"] == 6 and run["errors"] == 0 and run["target_tokens"] > 0
                   for run in closed.values())
        assert task["service"][mode]["open"]["offered_rate"] > 0
        assert task["service"][mode]["peak_rss_mb"] > 50
    assert task["service"]["continuous_w3"]["closed"]["c3"]["sentences"] == 6  # our knobs' grid
    assert results["servers"]["service_continuous_w3"]["peak_rss_mb"] > 50
    assert task["service"]["continuous_p2"]["closed"]["c3"]["sentences"] == 6  # two server processes
    assert results["servers"]["service_continuous_p2"]["peak_rss_mb"] > 2 * 50  # each loads the model
    turns = task["service_open_turns"]  # two turns, each at its own rate; the lower ratio's runs kept
    assert len(turns) == 2 and all(turn["offered_rate"] > 0 for turn in turns)
    kept = min(turns, key=lambda turn: turn["p95_ratio"])
    assert task["service"]["continuous"]["open"]["latency_p95_s"] == kept["continuous_p95_s"]
    assert task["service"]["dynamic"]["open"]["offered_rate"] == kept["offered_rate"]
    for mode in ("continuous", "dynamic"):  # each turn's open loops alternate in two slices, pooled
        open_run = task["service"][mode]["open"]
        assert len(open_run["slice_p95_s"]) == 2 and open_run["latency_p95_s"] >= min(open_run["slice_p95_s"])
    assert all(turn["slices"] == 2 and 0 <= turn["slices_continuous_lower"] <= 2 for turn in turns)
    assert task["naive"]["closed"]["c1"]["sentences"] == 3 and task["naive"]["closed"]["c1"]["errors"] == 0
    assert task["in_process"]["b4"]["sentences"] == 6
    assert task["in_process"]["b4_length_sorted"]["target_tokens"] == task["in_process"]["b4"]["target_tokens"]
    from bench import in_process
    points = task["in_process"]["grid"]  # our in-process grid (sizes under 32: the largest, 4); its best is compared
    assert [p["settings"] for p in points] == [s.to_dict() for s in in_process.settings_grid((4,))]
    assert all(p["sentences"] == 6 for p in points)
    assert task["in_process"]["best"] == max(points, key=lambda p: p["sentences_per_s"])
    assert "in_process_vs_ctranslate2_int8" in {t["name"] for t in results["targets"]}
    variant = task["in_process"]["variant"]
    assert results["servers"]["service_continuous"]["variants"] == {
        "tiny-reverse": f"{variant} on CPUExecutionProvider"}
    assert task["ctranslate2"]["int8_greedy_single"]["sentences"] == 3
    from bench.ctranslate2_runs import settings_grid
    grid = task["ctranslate2"]["int8_greedy_grid"]  # every point of the tuning grid; the best is the baseline
    assert [p["settings"] for p in grid] == [s.to_dict() for s in settings_grid()]
    assert all(p["sentences"] == 6 for p in grid)
    assert task["ctranslate2"]["int8_greedy_batch"] == max(grid, key=lambda p: p["sentences_per_s"])
    assert task["ctranslate2"]["int8_greedy_single"]["latency_p50_s"] == min(
        p["latency_p50_s"] for p in task["ctranslate2"]["int8_greedy_single_grid"])
    assert task["ctranslate2"]["fp32_greedy_batch"]["settings"] == task["ctranslate2"]["int8_greedy_batch"]["settings"]
    assert task["agreement_fp32_vs_onnx_fp32"] == 1.0  # same weights, same greedy tokens
    # every HTTP and in-process path generated the same number of tokens for the same inputs
    tokens = {task["in_process"]["b1"]["target_tokens"], task["service"]["continuous"]["closed"]["c1"]["target_tokens"],
              task["ctranslate2"]["fp32_greedy_batch"]["target_tokens"]}
    assert len(tokens) == 1
    assert {t["name"] for t in results["targets"]} >= {"vs_ctranslate2_int8", "server_rss", "roofline_int8"}
    line = task["roofline"]  # FLOPs per sentence, the machine's GEMM ceilings, each system's share
    assert line["flops_per_sentence"] > 0 and line["int8"]["peak_gflops"] > 0 and line["fp32"]["peak_gflops"] > 0
    assert 0 < line["service_fraction_int8"] < 1 and 0 < line["ctranslate2_fraction_int8"] < 1
    report = (out / "tiny.md").read_text(encoding="utf-8")
    assert "## tiny-reverse (6 inputs of the test set)" in report
    assert "Open loops in 2 turns" in report
    assert "Roofline:" in report
    assert "CTranslate2 int8 greedy `translate_batch` over its tuning grid" in report
    assert (out / "tiny-tiny-reverse.png").stat().st_size > 10_000


def test_a_failing_system_keeps_the_others(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import harness

    models, data = tiny_bench_dirs

    def broken(*args: object) -> None:
        raise RuntimeError("port in use")

    monkeypatch.setattr(harness, "run_service", broken)
    config = harness.BenchConfig(models_dir=models, data_dir=data, out_dir=tmp_path / "out",
                                 name="partial", sentences=4, batch_sizes=[2], threads=1,
                                 systems=("service", "in_process"))
    results, paths = harness.run(config)
    assert results["failures"] == {"service": "RuntimeError: port in use"}
    assert results["tasks"]["tiny-reverse"]["in_process"]["b2"]["sentences"] == 4
    assert "ctranslate2" not in results["tasks"]["tiny-reverse"]
    assert paths[1] == tmp_path / "out" / "partial.md"
    assert "- service: RuntimeError: port in use" in paths[1].read_text(encoding="utf-8")
    assert {t["status"] for t in results["targets"]} == {"not measured"}
