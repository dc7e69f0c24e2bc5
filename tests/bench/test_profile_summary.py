"""`bench.profile_summary`: inclusive shares from a raw sampling profile."""

from __future__ import annotations

from bench.profile_summary import shares


def test_a_function_counts_once_per_sample_however_deep_it_recurs() -> None:
    lines = [
        "run (a.py:1);f (a.py:2);f (a.py:3);g (b.py:4) 3",
        "run (a.py:1);g (b.py:4) 1",
        "",
    ]
    total, found = shares(lines, ("run", "f", "g", "h"))
    assert total == 4
    assert found == {"run": 1.0, "f": 0.75, "g": 1.0, "h": 0.0}
