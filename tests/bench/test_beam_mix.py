"""The beam-mix benchmark on the tiny model: the same greedy arrivals with and without beam requests."""

from __future__ import annotations

import json
from pathlib import Path

from bench import beam_mix


def test_beam_requests_are_seeded_and_near_their_share() -> None:
    first = beam_mix.beam_requests(2000, 0.1, seed=3)
    assert first == beam_mix.beam_requests(2000, 0.1, seed=3)
    assert first != beam_mix.beam_requests(2000, 0.1, seed=4)
    assert 150 < sum(first) < 250


def test_beam_mix_measures_greedy_latency_with_and_without_beam(tiny_bench_dirs: tuple[Path, Path],
                                                                tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "out"
    checkout = Path(__file__).resolve().parents[2]  # this repository as its own baseline
    status = beam_mix.main(["--models", str(models), "--data-dir", str(data), "--model", "tiny-reverse",
                            "--out", str(out), "--sentences", "20", "--concurrency", "4", "--slices", "2",
                            "--slice-s", "2", "--beam-share", "0.3", "--load", "0.3", "--beam-size", "3",
                            "--baseline", str(checkout), "--flags=--max-join-wait-ms 30"])
    assert status == 0
    results = json.loads((out / "beam_mix.json").read_text(encoding="utf-8"))
    for summary in (results, results["baseline"]):
        runs = summary["runs"]
        assert all(run["errors"] == 0 for run in runs.values())
        # the same greedy arrivals in every arm; the beam requests only in the mixed one, and
        # as three greedy requests each in the as_greedy one
        assert runs["greedy_only"]["sentences"] == runs["mixed_greedy"]["sentences"] > 0
        assert runs["as_greedy_greedy"]["sentences"] == runs["greedy_only"]["sentences"]
        assert runs["mixed_beam"]["sentences"] > 0
        assert runs["as_greedy_extra"]["sentences"] == 3 * runs["mixed_beam"]["sentences"]
        only = runs["greedy_only"]["latency_p95_s"]
        assert summary["greedy_p95_ratio"] == runs["mixed_greedy"]["latency_p95_s"] / only
        assert summary["as_greedy_p95_ratio"] == runs["as_greedy_greedy"]["latency_p95_s"] / only
        assert summary["status"] in {"met", "missed"}
        for run in runs.values():  # each stage's p95 from the answers' Server-Timing
            stages = run["server_timing_p95_ms"]
            assert {"prepare", "queue", "inference", "total", "client"} <= set(stages)
            assert stages["inference"] <= stages["total"] <= stages["client"]
    assert len(results["slices"]) == 2 and len(results["slices"][0]) == 6  # 2 servers x 3 arms
    assert results["baseline"]["commit"]
    text = (out / "beam_mix.md").read_text(encoding="utf-8")
    assert "greedy p95 mixed / greedy only" in text and "baseline checkout" in text
    assert "| server | run | queue | join | inference | total | client |" in text
    assert results["config"]["flags"] == ["--max-join-wait-ms", "30"] and "this checkout, `--max-join-wait-ms 30`" in text
