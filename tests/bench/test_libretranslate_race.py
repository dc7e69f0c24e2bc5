"""bench.libretranslate_race without LibreTranslate: the argos-translate package it builds gives
our greedy outputs from the pieces alone, as argos-translate passes them, and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import libretranslate_race

ctranslate2 = pytest.importorskip("ctranslate2")


def test_the_package_translates_pieces_without_eos_as_our_model(tiny_model_repository: Path, tiny_runtime,
                                                                tmp_path: Path) -> None:
    from service.generation.search import generate

    packages = libretranslate_race.argos_package(tiny_model_repository, tmp_path / "packages")
    (package,) = packages.iterdir()
    metadata = json.loads((package / "metadata.json").read_text())
    assert (metadata["from_code"], metadata["to_code"], metadata["type"]) == ("en", "it", "translate")
    assert (package / "sentencepiece.model").read_bytes() == (tiny_model_repository / "tokenizer.model").read_bytes()
    tokenizer = tiny_runtime.tokenizer
    texts = [t for t in (tiny_model_repository.parent / "data" / "test.src").read_text().split("\n") if t][:12]
    sources = [tokenizer.encode(t) + [tiny_runtime.eos_id] for t in texts]
    ours = [tokenizer.pieces(r.tokens) for r in generate(tiny_runtime, sources, 1, tiny_runtime.max_target_len)]
    translator = ctranslate2.Translator(str(package / "model"), device="cpu", compute_type="float32")
    pieces = [tokenizer.pieces(s[:-1]) for s in sources]  # argos-translate adds no EOS
    theirs = [r.hypotheses[0] for r in translator.translate_batch(pieces, beam_size=1)]
    assert theirs == ours


def test_the_report_gives_the_grid_the_turns_and_the_ratios() -> None:
    def run(concurrency: int, rate: float, p50: float, **fields: object) -> dict[str, object]:
        return {"concurrency": concurrency, "sentences_per_s": rate, "latency_p50_s": p50,
                "latency_p95_s": 2 * p50, "errors": 0, **fields}

    results = {
        "repeats": 2, "sentences": 10, "identical": {"sentences": 10, "exact": 7, "first_letter_blind": 9},
        "grid": [run(64, 100.0, 0.5, inter_threads=1, intra_threads=0, threads=4)],
        "turns": [run(64, r, p, turn=t, side=s, setting=[1, 0, 4] if s == "LibreTranslate" else "defaults")
                  for t, (s, r, p) in enumerate([("LibreTranslate", 100.0, 0.5), ("attnserve", 300.0, 0.2),
                                                 ("LibreTranslate", 120.0, 0.5), ("attnserve", 330.0, 0.2)])],
    }
    report = libretranslate_race.markdown(results)
    assert "| 64 | 1 x 0 | 4 | 100.0 | 500.00 | 0 |" in report
    assert "| 64 | attnserve | defaults | 315.0 (300.0-330.0) |" in report
    assert "sentences/s **2.86**, p50 **0.40**" in report
    assert "7 of 10 (9 ignoring" in report
