"""The in-process ONNX runs: batching and length sorting keep each sentence's output."""

from __future__ import annotations

import random

import pytest

from bench.in_process import (
    ENGINES,
    InProcessSettings,
    markdown,
    parse_settings,
    run_batches,
    run_grid,
    run_settings,
    settings_grid,
    turns,
)
from bench.stats import RunStats, summarise
from service.generation.search import generate


@pytest.mark.parametrize("batch_size", [1, 3, 64])
@pytest.mark.parametrize("sort_by_length", [False, True])
def test_run_batches_keeps_workload_order(tiny_runtime, batch_size: int, sort_by_length: bool) -> None:
    rng = random.Random(0)
    sources = [[rng.randrange(4, 20) for _ in range(rng.randrange(3, 9))] + [tiny_runtime.eos_id]
               for _ in range(7)]
    stats, outputs = run_batches(tiny_runtime, sources, batch_size, sort_by_length=sort_by_length)
    one_by_one = [generate(tiny_runtime, [s], 1, tiny_runtime.max_target_len)[0] for s in sources]
    assert [o.tokens for o in outputs] == [o.tokens for o in one_by_one]
    assert stats.sentences == 7
    assert stats.target_tokens == sum(len(o.tokens) for o in one_by_one)
    assert stats.latency_p50_s is not None and stats.latency_p50_s <= stats.elapsed_s + 1e-4  # elapsed_s is rounded


def test_run_batches_rejects_empty_batches(tiny_runtime) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        run_batches(tiny_runtime, [[tiny_runtime.eos_id]], 0)


def test_the_grid_covers_the_cores_with_both_engines() -> None:
    grid = settings_grid((32, 64), cores=2)
    assert {(s.replicas, s.threads) for s in grid} == {(1, 2), (2, 1)}
    assert {(s.engine, s.size) for s in grid} == {(e, n) for e in ENGINES for n in (32, 64)}
    assert {(s.engine, s.size, s.join_at) for s in grid if s.join_at > 1} == {
        (e, n, n // 4) for e in ENGINES if e != "batches" for n in (32, 64)}
    assert (2, 2) in {(s.replicas, s.threads) for s in settings_grid((32,), cores=4)}
    with pytest.raises(ValueError, match="engine"):
        InProcessSettings("beams", 32)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("replicas", [1, 3])
def test_every_setting_gives_each_sentence_its_own_output(tiny_runtime, engine: str, replicas: int) -> None:
    rng = random.Random(1)
    sources = [[rng.randrange(4, 20) for _ in range(rng.randrange(3, 9))] + [tiny_runtime.eos_id]
               for _ in range(11)]
    stats, outputs = run_settings(tiny_runtime, sources, InProcessSettings(engine, 4, replicas))
    one_by_one = [generate(tiny_runtime, [s], 1, tiny_runtime.max_target_len)[0] for s in sources]
    assert [o.tokens for o in outputs] == [o.tokens for o in one_by_one]
    assert stats.sentences == 11 and stats.target_tokens == sum(len(o.tokens) for o in one_by_one)
    assert stats.latency_p95_s is not None and stats.latency_p95_s <= stats.elapsed_s + 1e-4


@pytest.mark.parametrize(("engine", "sorted_feed"), [("running", False), ("running-sorted", True)])
def test_a_running_batch_takes_sources_in_workload_order_or_shortest_first(
        tiny_runtime, monkeypatch: pytest.MonkeyPatch, engine: str, sorted_feed: bool) -> None:
    from bench import in_process

    taken: list[int] = []
    real = in_process.generate_running

    def recording(runtime, feed, *args, **kwargs):  # type: ignore[no-untyped-def]
        def read():  # type: ignore[no-untyped-def]
            for owner, source in feed:
                taken.append(owner)
                yield owner, source
        return real(runtime, read(), *args, **kwargs)

    monkeypatch.setattr(in_process, "generate_running", recording)
    lengths = [6, 2, 9, 4, 2, 7]
    sources = [[5] * (n - 1) + [tiny_runtime.eos_id] for n in lengths]
    run_settings(tiny_runtime, sources, InProcessSettings(engine, 2))
    expected = sorted(range(len(sources)), key=lambda i: lengths[i]) if sorted_feed else list(range(len(sources)))
    assert taken == expected


def test_run_grid_reports_every_point_and_the_best(tiny_model_repository) -> None:
    sources = [[5, 6, 7, 3], [8, 9, 3], [4, 4, 4, 4, 4, 3]]
    grid = settings_grid((2,), cores=2)
    result = run_grid(tiny_model_repository, sources, grid)
    assert [p["settings"] for p in result["points"]] == [s.to_dict() for s in grid]
    assert result["best"]["sentences_per_s"] == max(p["sentences_per_s"] for p in result["points"])


def test_parse_settings_reads_engine_size_replicas_threads_and_join_at() -> None:
    assert parse_settings("running:64:2:1") == InProcessSettings("running", 64, 2, 1)
    assert parse_settings("running-sorted:64:2:1:16") == InProcessSettings("running-sorted", 64, 2, 1, join_at=16)
    for bad in ("running:64:2", "running:a:2:1", "beams:64:2:1", "batches:32:2:1:8", "running:8:2:1:9",
                "running:64:2:1:0", "running:64:2:1:16:1"):
        with pytest.raises(ValueError):
            parse_settings(bad)


@pytest.mark.parametrize("join_at", [1, 3])
def test_a_running_batch_takes_newcomers_once_join_at_slots_are_free(
        tiny_runtime, monkeypatch: pytest.MonkeyPatch, join_at: int) -> None:
    """Every join after the first fills at least `join_at` free slots (the feed's last sources
    excepted); the outputs are the same as one by one."""
    from service.batching.slot_batch import SlotBatch

    groups: list[int] = []
    real = SlotBatch.concatenate

    def recording(self, sources, *args, **kwargs):  # type: ignore[no-untyped-def]
        groups.append(len(sources))
        return real(self, sources, *args, **kwargs)

    monkeypatch.setattr(SlotBatch, "concatenate", recording)
    rng = random.Random(2)
    sources = [[rng.randrange(4, 20) for _ in range(rng.randrange(3, 9))] + [tiny_runtime.eos_id]
               for _ in range(23)]
    _, outputs = run_settings(tiny_runtime, sources, InProcessSettings("running", 4, 1, 1, join_at=join_at))
    one_by_one = [generate(tiny_runtime, [s], 1, tiny_runtime.max_target_len)[0] for s in sources]
    assert [o.tokens for o in outputs] == [o.tokens for o in one_by_one]
    assert groups[0] == 4 and sum(groups) == len(sources)
    if join_at == 1:
        assert min(groups[1:]) < 3  # rows leaving one at a time let newcomers in one at a time
    else:
        assert min(groups[1:-1]) >= join_at


def test_turns_alternate_and_give_the_best_point_over_ctranslate2(tiny_model_repository) -> None:
    sources = [[5, 6, 7, 3], [8, 9, 3]]
    points = [InProcessSettings("running", 2, 1, 1), InProcessSettings("batches", 2, 1, 1)]
    rates = iter([100.0, 50.0])  # CTranslate2's sentences/s in turn 1, then turn 2

    def reference() -> RunStats:
        return summarise([0.1], 1, 2 / next(rates), sentences=2)

    result = turns(tiny_model_repository, sources, points, 2, reference)
    assert list(result["sentences_per_s"]) == ["running:2:1:1", "batches:2:1:1", "CTranslate2"]
    assert result["sentences_per_s"]["CTranslate2"] == [100.0, 50.0]
    ours = [max(result["sentences_per_s"][p][t] for p in ("running:2:1:1", "batches:2:1:1")) for t in range(2)]
    assert result["ratio_per_turn"] == [round(ours[0] / 100, 3), round(ours[1] / 50, 3)]
    assert "**" in markdown({**result, "command": "x"})
    assert turns(tiny_model_repository, sources, [InProcessSettings("running", 2, 1, 1, join_at=2)], 1)[
        "sentences_per_s"].keys() == {"running:2:1:1:2"}


def test_turns_run_the_points_on_another_repository_in_the_same_turns(tiny_model_repository) -> None:
    """`against`: the same points on a second repository, in each turn beside the first's; the
    ratio over CTranslate2 takes the first repository's best point only."""
    sources = [[5, 6, 7, 3], [8, 9, 3]]
    points = [InProcessSettings("running", 2, 1, 1)]
    rates = iter([1e9, 1e9])  # a CTranslate2 faster than any point

    def reference() -> RunStats:
        return summarise([0.1], 1, 2 / next(rates), sentences=2)

    result = turns(tiny_model_repository, sources, points, 2, reference, against=tiny_model_repository)
    assert list(result["sentences_per_s"]) == ["running:2:1:1", "running:2:1:1 against", "CTranslate2"]
    assert all(len(values) == 2 and min(values) > 0 for values in result["sentences_per_s"].values())
    ours = result["sentences_per_s"]["running:2:1:1"]
    assert result["ratio_per_turn"] == [round(o / 1e9, 3) for o in ours]
