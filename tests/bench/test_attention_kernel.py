"""bench.attention_kernel at small shapes: the plain loops compute GroupQueryAttention's
attention and write the same cache column, and both are timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.attention_kernel import GQA, LOOP, compiler, main

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler to build bench/attention_loop.c")


def test_loops_match_group_query_attention_and_both_are_timed(tmp_path: Path) -> None:
    assert main(["--shapes", "1x1x4", "3x5x8", "2x8x8", "--calls", "5", "--rounds", "2", "--out", str(tmp_path)]) == 0
    shapes = json.loads((tmp_path / "attention_kernel.json").read_text(encoding="utf-8"))["shapes"]
    assert [(s["rows"], s["length"], s["capacity"]) for s in shapes] == [(1, 1, 4), (3, 5, 8), (2, 8, 8)]
    for shape in shapes:
        # the new key/value quantized into the same column, and the same attention over it
        assert shape["same_cache"], shape
        assert shape["max_difference"] < 1e-4, shape
        assert shape["us"][GQA] > 0 and shape["us"][LOOP] > 0
        assert shape["ratio"] == pytest.approx(shape["us"][GQA] / shape["us"][LOOP])
    assert "| 3 | 5 | 8 |" in (tmp_path / "attention_kernel.md").read_text(encoding="utf-8")
