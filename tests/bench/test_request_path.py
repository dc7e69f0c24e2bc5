"""`bench.request_path`: the app and a bare FastAPI route called through ASGI in-process, every
request answered, the main thread's CPU per request reported for both."""

from __future__ import annotations

import json
from pathlib import Path

from bench import request_path


def test_the_app_and_the_floor_answer_every_request(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "request_path.json"
    assert request_path.main(["--models", str(models), "--data-dir", str(data), "--model", "tiny-reverse",
                              "--requests", "40", "--concurrency", "4", "--turns", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m bench.request_path --models ")
    for name in ("app", "floor"):
        (run,) = report["runs"][name]
        assert run["statuses"] == {"200": 40}  # each request answered, none refused
        assert report[f"{name}_main_ms_per_request"] == run["main_ms_per_request"] > 0
        assert run["wall_ms_per_request"] > 0
    assert report["app_tokenizer_ms_per_request"] > 0 and report["tokenizer_alone_ms_per_request"] > 0
    assert report["app_tokenizer_ms_per_request"] < report["app_main_ms_per_request"]
