"""bench.protocols on the tiny model: one server, each protocol's closed loop in turns, every
sentence answered, results written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("grpc")
from bench import protocols


def test_every_protocol_answers_every_sentence_in_turns(tiny_bench_dirs: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "out"
    assert protocols.main(["--models", str(models), "--data-dir", str(data), "--model", "tiny-reverse",
                           "--sentences", "8", "--concurrency", "1", "3", "--repeats", "2",
                           "--out", str(out)]) == 0
    results = json.loads((out / "protocols.json").read_text())
    runs = results["runs"]
    assert sorted((r["concurrency"], r["turn"], r["arm"]) for r in runs) == sorted(
        (c, t, a) for c in (1, 3) for t in (0, 1) for a in protocols.ARMS)
    for run in runs:
        assert run["sentences"] == 8 and run["errors"] == 0, run["error_samples"]
        assert run["event_loop_ms_per_request"] >= 0 and run["load_generator_ms_per_request"] > 0
    # the first arm rotates from turn to turn
    firsts = [next(r["arm"] for r in runs if r["concurrency"] == 3 and r["turn"] == t) for t in (0, 1)]
    assert firsts == list(protocols.ARMS[:2])
    table = (out / "protocols.md").read_text()
    assert all(f"| 3 | {arm} |" in table for arm in protocols.ARMS)


def test_the_grpc_request_is_the_rest_requests_sentence() -> None:
    from service.api import grpc_messages as pb
    from service.api import open_inference

    message = pb.ModelInferRequest.FromString(protocols.infer_message("ciao è", "m"))
    assert message.model_name == "m" and [i.name for i in message.inputs] == ["text"]
    assert open_inference.deserialize_bytes(message.raw_input_contents[0]) == ["ciao è".encode()]
    assert protocols.infer_body("ciao")["inputs"][0]["data"] == ["ciao"]
