"""`bench.profile_summary`: inclusive shares from a raw sampling profile."""

from __future__ import annotations

from bench.profile_summary import main, self_shares, shares, thread_shares


def test_a_function_counts_once_per_sample_however_deep_it_recurs() -> None:
    lines = [
        "run (a.py:1);f (a.py:2);f (a.py:3);g (b.py:4) 3",
        "run (a.py:1);g (b.py:4) 1",
        "",
    ]
    total, found = shares(lines, ("run", "f", "g", "h"))
    assert total == 4
    assert found == {"run": 1.0, "f": 0.75, "g": 1.0, "h": 0.0}


def test_threads_share_the_samples_by_name() -> None:
    lines = ["thread (11): MainThread;run (a.py:1) 1",
             "thread (12): batch-0;step (b.py:2) 2",
             "thread (12): batch-0;join (b.py:3) 1", ""]
    assert thread_shares(lines) == {"batch-0": 0.75, "MainThread": 0.25}
    assert thread_shares(["run (a.py:1) 4"]) == {}  # recorded without --threads


def test_one_threads_samples_alone_and_where_they_end(tmp_path) -> None:
    lines = ["thread (11): MainThread;run (a.py:1);handle (a.py:2);encode (t.py:3) 3",
             "thread (11): MainThread;run (a.py:1) 1",
             "thread (12): batch-0;step (b.py:2) 4", ""]
    assert shares(lines, ("run", "handle", "step"), thread="MainThread") == (4, {"run": 1.0, "handle": 0.75, "step": 0.0})
    assert self_shares(lines, "MainThread") == {"encode": 0.75, "run": 0.25}
    assert self_shares(lines) == {"step": 0.5, "encode": 0.375, "run": 0.125}
    raw, out = tmp_path / "p.raw", tmp_path / "p.json"
    raw.write_text("\n".join(lines))
    assert main([str(raw), "--thread", "MainThread", "--functions", "event-loop", "--out", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert report["samples"] == 4 and report["thread"] == "MainThread" and "thread_share" not in report
    assert report["self_share"] == {"encode": 0.75, "run": 0.25} and "prepare" in report["inclusive_share"]
