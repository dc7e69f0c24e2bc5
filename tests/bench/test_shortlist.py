"""bench.shortlist on the tiny model: the coverage grid, BLEU of both vocabularies on the same
schedule, single step calls and speed turns in alternating order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.shortlist import FULL, SHORT, main


def test_shortlist_bench_measures_coverage_bleu_calls_and_alternating_turns(
        tiny_bench_dirs: tuple[Path, Path], tiny_model_repository: Path, tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    folder = data / "tiny-reverse"
    source = tiny_model_repository.parent / "data"
    for split in ("train", "test"):  # the test pairs serve as training pairs too
        for side in ("src", "tgt"):
            shutil.copy(source / f"test.{side}", folder / f"{split}.{side}")
    out = tmp_path / "shortlist"
    assert main(["--model", str(models / "tiny-reverse"), "--data-dir", str(folder), "--out", str(out),
                 "--scores", "dice", "-k", "1", "2", "-n", "0", "--chosen-k", "2", "--chosen-n", "0",
                 "--bleu-sentences", "20", "--speed-sentences", "20", "--rows", "4", "--group", "2",
                 "--turns", "2", "--calls", "3"]) == 0
    results = json.loads((out / "shortlist.json").read_text(encoding="utf-8"))
    grid = results["coverage"]["grid"]
    assert [(row["k"], row["n"]) for row in grid] == [(1, 0), (2, 0)]
    assert grid[0]["token_coverage"] <= grid[1]["token_coverage"]  # more candidates hold more
    assert grid[0]["mean_shortlist"] <= grid[1]["mean_shortlist"]
    bleu = results["bleu"]
    assert set(bleu[FULL]) == set(bleu[SHORT]) == {"bleu", "chrf"} and 0 <= bleu["identical"] <= 1
    calls = results["calls"]["variants"]
    columns = [v["columns"] for v in calls.values()]
    assert columns[0] == columns[1] > columns[3] > 0  # the step graph, every id, then a few random ids
    turns = results["speed"]["turns"]
    assert [t["variant"] for t in turns] == [FULL, SHORT, SHORT, FULL]
    assert all(t["steps"] > 0 and t["replay_s"] >= t["step_s"] > 0 for t in turns)
    assert all("mean_shortlist" in t for t in turns if t["variant"] == SHORT)
    assert (out / "shortlist.npz").is_file() and (out / "shortlist.md").read_text(encoding="utf-8").startswith("#")
