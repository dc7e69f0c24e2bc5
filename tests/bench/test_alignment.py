"""The alignment benchmark: the gold set's shape, a run over the tiny model, and (slow) the
default method against the baseline on the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.alignment import GOLD_DIR, attend, candidates, evaluate, markdown, read_gold, run, split
from service.generation.alignment import BASELINE, DEFAULT

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "alignment" / "alignment.json"
DEFAULT_MODEL = ROOT / "models" / "translate-en-it"


def test_the_gold_set_has_at_least_100_pairs_of_test_lines_with_links_in_range() -> None:
    gold = read_gold()  # checks every link against the words of its pair
    assert len(gold) >= 100
    assert all(pair.links for pair in gold)
    test_src = (ROOT / "tests/fixtures/default_models/translate-en-it/test.src").read_text(
        encoding="utf-8").splitlines()
    lines = [int(n) for n in (GOLD_DIR / "lines.txt").read_text(encoding="utf-8").split()]
    assert [pair.source for pair in gold] == [test_src[n] for n in lines]


def write_gold(directory: Path, sources: list[str], targets: list[str], links: list[str]) -> Path:
    directory.mkdir()
    for name, lines in (("source.txt", sources), ("target.txt", targets), ("gold.talp", links)):
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


def test_a_gold_set_is_checked(tmp_path: Path) -> None:
    uneven = write_gold(tmp_path / "uneven", ["a b"], ["b a", "c"], ["0-1"])
    with pytest.raises(ValueError, match="1 sources, 2 targets, 1 link lines"):
        read_gold(uneven)
    outside = write_gold(tmp_path / "outside", ["a b"], ["b a"], ["0-1 2-0"])
    with pytest.raises(ValueError, match=r"line 1: links \[\(2, 0\)\] outside 2x2 words"):
        read_gold(outside)


def test_every_candidate_is_tried_with_the_baseline_and_default_among_them() -> None:
    names = [m.name for m in candidates(n_layers=3, n_heads=4)]
    assert len(names) == len(set(names))
    assert BASELINE.name.replace("L-1", "L2") in names and DEFAULT.name in names


def test_a_run_over_the_tiny_model(tiny_model_repository: Path, tmp_path: Path) -> None:
    """The tiny model reverses pieces: word i of n goes to word n - 1 - i."""
    sources = ["abc de", "fgh", "ij klm", "ab cd ef", "hi", "jk lm"]
    targets = ["ed cba", "hgf", "mlk ji", "fe dc ba", "ih", "ml kj"]
    links = ["0-1 1-0", "0-0", "0-1 1-0", "0-2 1-1 2-0", "0-0", "0-1 1-0"]
    gold = write_gold(tmp_path / "gold", sources, targets, links)
    report = run(tiny_model_repository, gold, threads=1)
    assert report["gold"] == {"pairs": 6, "dev": 3, "test": 3, "sure_links": 11}
    assert set(report["results"]) == {"baseline", "chosen", "default"}
    for result in report["results"].values():
        assert {"dev", "test", "all"} <= set(result)
    chosen = report["results"]["chosen"]
    assert chosen["method"] == report["chosen_on_dev"]
    assert chosen["dev"]["f1"] == max(r["f1"] for r in report["dev_ranking"])
    assert report["results"]["default"]["all"]["f1"] == 1.0  # the reversal, exactly
    page = markdown(report, "python -m bench.alignment")
    assert "Command: `python -m bench.alignment`" in page
    assert f"| default `{DEFAULT.name}` | test |" in page


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_MODEL.is_dir() or not RESULTS.is_file(),
                    reason="needs models/translate-en-it and bench/results/alignment")
def test_the_default_method_beats_the_last_layer_argmax_on_the_gold_set() -> None:
    """As measured (bench/results/alignment), within a small tolerance, on every split."""
    from bench.in_process import load_runtime

    measured = json.loads(RESULTS.read_text(encoding="utf-8"))["results"]
    tolerance = 0.02
    pairs = split(attend(load_runtime(DEFAULT_MODEL, threads=1), read_gold()))
    for half, subset in pairs.items():
        default, baseline = evaluate(subset, DEFAULT).f1, evaluate(subset, BASELINE).f1
        assert default >= measured["default"][half]["f1"] - tolerance, half
        margin = measured["default"][half]["f1"] - measured["baseline"][half]["f1"]
        assert default - baseline >= margin - tolerance, half
        assert default - baseline >= 0.1, half
