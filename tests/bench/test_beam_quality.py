"""bench.beam_quality on the tiny model: beam search through the running batch and in
request-level batches, scored on the same sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import beam_quality


def test_beam_quality_scores_both_decodings(tiny_bench_dirs: tuple[Path, Path], tiny_model_repository: Path,
                                            tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    shutil.copy(tiny_model_repository.parent / "data" / "test.tgt", data / "tiny-reverse" / "test.tgt")
    out = tmp_path / "out"
    assert beam_quality.main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--out", str(out),
                              "--sentences", "12", "--beam", "3", "--variant", "fp32", "--rows", "7",
                              "--group", "2", "--batch", "5"]) == 0
    results = json.loads((out / "beam_quality.json").read_text(encoding="utf-8"))
    runs = results["runs"]
    assert list(runs) == ["request-level batches", "running batch"]
    # fp32: a row's tokens do not depend on its neighbours, so both decodings agree
    assert results["identical"] == 1.0 and runs["running batch"]["bleu"] == runs["request-level batches"]["bleu"]
    assert runs["running batch"]["chrf"] > 0 and results["config"]["sentences"] == 12
    assert "Identical outputs: 1.000" in (out / "beam_quality.md").read_text(encoding="utf-8")


def test_the_running_batch_holds_at_most_its_rows(tiny_runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.batching.slot_batch import SlotBatch

    sizes: list[int] = []
    step = SlotBatch.generate_token

    def counted(self: SlotBatch) -> list:
        sizes.append(len(self))  # slots decoding in this step
        return step(self)

    monkeypatch.setattr(SlotBatch, "generate_token", counted)
    sources = [[5, 6, 7, 3], [8, 9, 3], [4, 5, 3], [6, 3], [7, 8, 9, 10, 3]]
    outputs = beam_quality.running_batch(tiny_runtime, sources, 2, 4, 2)
    assert max(sizes) == 4 and len(outputs) == 5 and all(outputs)
