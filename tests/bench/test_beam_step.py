"""bench.beam_step on the tiny model: the mixed and as_greedy arms carry the same rows of work,
and the report holds each turn of both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import beam_step


def test_the_arms_carry_the_same_rows() -> None:
    sources = [[5, 3], [6, 7, 3], [8, 3]]
    beam = [False, True, False]
    mixed = beam_step.arm_work(sources, beam, 4, "mixed")
    as_greedy = beam_step.arm_work(sources, beam, 4, "as_greedy")
    assert mixed == ([[5, 3], [6, 7, 3], [8, 3]], [1, 4, 1])
    assert as_greedy == ([[5, 3]] + [[6, 7, 3]] * 4 + [[8, 3]], [1] * 6)
    assert sum(mixed[1]) == sum(as_greedy[1])
    with pytest.raises(ValueError, match="arm"):
        beam_step.arm_work(sources, beam, 4, "greedy_only")


def test_replay_holds_at_most_its_rows_and_decodes_every_source(tiny_runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.batching.slot_batch import SlotBatch

    sizes: list[int] = []
    finished: list[int] = []
    step = SlotBatch.generate_token

    def counted(self: SlotBatch) -> list:
        sizes.append(len(self))
        done = step(self)
        finished.extend(owner for owner, _ in done)
        return done

    monkeypatch.setattr(SlotBatch, "generate_token", counted)
    sources = [[5, 6, 7, 3], [8, 9, 3], [4, 5, 3], [6, 3], [7, 8, 9, 10, 3]]
    seconds, steps = beam_step.replay(tiny_runtime, sources, [1, 3, 1, 3, 1], rows=4)
    assert seconds > 0 and steps == len(sizes) and max(sizes) == 4
    assert sorted(finished) == list(range(5))  # a beam row's slots leave with one result
    finished.clear()
    beam_step.replay(tiny_runtime, sources[:2], [5, 1], rows=4)  # more beams than rows: alone, then the next
    assert sorted(finished) == [0, 1]


def test_beam_step_writes_both_arms(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "out"
    assert beam_step.main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
                           "--sentences", "10", "--beam-share", "0.5", "--beam-size", "2", "--rows", "6",
                           "--turns", "2"]) == 0
    result = json.loads((out / "beam_step.json").read_text(encoding="utf-8"))
    assert set(result["arms"]) == {"mixed", "as_greedy"}
    assert all(len(runs) == 2 and all(r["steps"] > 0 for r in runs) for runs in result["arms"].values())
    assert len(result["ratios"]) == 2
    assert "mixed / as_greedy" in (out / "beam_step.md").read_text(encoding="utf-8")
