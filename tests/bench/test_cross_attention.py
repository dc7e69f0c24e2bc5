"""bench.cross_attention at small sizes: the three formulations give the same attention, the
keys and values read grow with the width, each width is timed."""

from __future__ import annotations

import json
from pathlib import Path

from bench.cross_attention import CONTRIB, OWN_LENGTH, PRODUCTS, main


def test_cross_attention_times_both_formulations_by_width(tmp_path: Path) -> None:
    out = tmp_path / "cross.json"
    assert main(["--out", str(out), "--rows", "3", "--heads", "2", "--head-dim", "8",
                 "--widths", "4", "16", "--calls", "20"]) == 0
    widths = json.loads(out.read_text(encoding="utf-8"))["widths"]
    assert [w["width"] for w in widths] == [4, 16]
    assert widths[1]["keys_values_bytes"] == 4 * widths[0]["keys_values_bytes"] == 2 * 3 * 2 * 16 * 8 * 4
    for row in widths:
        # the same attention: the masked softmax over each row's own length, three ways
        assert row["max_difference"][CONTRIB] < 1e-4 and row["max_difference"][OWN_LENGTH] < 1e-4
        assert all(row["ms"][name] > 0 for name in (PRODUCTS, CONTRIB, OWN_LENGTH))


def test_cross_attention_takes_the_rows_lengths_from_test_sentences(
    tiny_bench_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "cross.json"
    assert main(["--out", str(out), "--rows", "4", "--heads", "2", "--head-dim", "8", "--calls", "10",
                 "--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--batches", "2"]) == 0
    widths = json.loads(out.read_text(encoding="utf-8"))["widths"]
    assert len(widths) == 2
    for row in widths:
        assert row["width"] % 32 == 0 and 0 < row["mean_source_length"] <= row["width"]
        assert row["max_difference"][OWN_LENGTH] < 1e-4
