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
    status = beam_mix.main(["--models", str(models), "--data-dir", str(data), "--model", "tiny-reverse",
                            "--out", str(out), "--sentences", "20", "--concurrency", "4", "--slices", "2",
                            "--slice-s", "2", "--beam-share", "0.3", "--load", "0.3"])
    assert status == 0
    results = json.loads((out / "beam_mix.json").read_text(encoding="utf-8"))
    runs = results["runs"]
    assert all(run["errors"] == 0 for run in runs.values())
    # the same greedy arrivals in both runs; the beam requests only in the mixed one
    assert runs["greedy_only"]["sentences"] == runs["mixed_greedy"]["sentences"] > 0
    assert runs["mixed_beam"]["sentences"] > 0
    assert results["greedy_p95_ratio"] == runs["mixed_greedy"]["latency_p95_s"] / runs["greedy_only"]["latency_p95_s"]
    assert results["status"] in {"met", "missed"} and len(results["slices"]) == 2
    assert "Greedy p95 mixed / greedy only" in (out / "beam_mix.md").read_text(encoding="utf-8")
