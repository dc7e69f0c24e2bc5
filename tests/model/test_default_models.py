"""The committed default models (slow): sensible outputs on known Debian texts, and their
quality on 200 committed test rows within 2 points of what `evaluation-200.json` reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from model.checkpoint import load_model
from model.evaluation import evaluate, generate_texts
from model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "default_models"
TOLERANCE = 2.0  # points, BLEU / chrF / ROUGE
# The metric each model's report is checked on, per task.
METRICS = {"translate-en-it": ("bleu", "chrf"), "summarize-en": ("rougeL",)}

pytestmark = pytest.mark.slow


def _load(name: str):
    path = ROOT / "models" / name
    if not (path / "checkpoint.safetensors").exists():
        pytest.skip(f"models/{name} is not here")
    torch.set_num_threads(2)
    return load_model(path).eval(), Tokenizer.from_file(path / "tokenizer.model"), path


@pytest.mark.parametrize("name", sorted(METRICS))
def test_quality_on_200_test_rows_matches_the_report(name: str) -> None:
    model, tokenizer, path = _load(name)
    reported = json.loads((path / "evaluation-200.json").read_text())["results"]["greedy"]
    measured = evaluate(model, tokenizer, name, FIXTURES / name, "test", beam_sizes=[1])["results"]["greedy"]
    for metric in METRICS[name]:
        assert abs(measured[metric] - reported[metric]) <= TOLERANCE, (metric, measured, reported)


def test_translation_of_known_debian_synopses() -> None:
    model, tokenizer, _ = _load("translate-en-it")
    outputs = generate_texts(model, tokenizer, [
        "This package contains the documentation.",
        "Python 3 bindings for the library",
        "command-line tool to convert images",
    ])
    assert "documentazione" in outputs[0].lower(), outputs
    assert "python 3" in outputs[1].lower() and "libreria" in outputs[1].lower(), outputs
    assert "immagini" in outputs[2].lower(), outputs


def test_summary_of_a_known_debian_description() -> None:
    model, tokenizer, _ = _load("summarize-en")
    [summary] = generate_texts(model, tokenizer, [
        ("This package contains the documentation for the GNU C library in HTML format. "
         "It covers the functions, macros and headers of the library, with examples."),
    ])
    words = summary.lower().split()
    assert 1 <= len(words) <= 15, summary
    assert "documentation" in words or "library" in words, summary
