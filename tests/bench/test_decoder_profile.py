"""bench.decoder_profile on the tiny model: operator times of a decoder step, written to a file."""

from __future__ import annotations

import json
from pathlib import Path

from bench.decoder_profile import main


def test_profile_lists_the_decoder_operators(tiny_model_repository: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert main(["--model", str(tiny_model_repository), "--out", str(out), "--variant", "fp32",
                 "--batch", "4", "--past", "3", "--source-len", "5", "--steps", "3"]) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["variant"] == "fp32" and result["step_ms"] > 0
    assert "MatMul" in result["ops"] or "FusedMatMul" in result["ops"]
    assert abs(sum(op["share"] for op in result["ops"].values()) - 1) < 0.01
    nodes = list(result["nodes"].values())
    assert nodes and all(node["op"] in result["ops"] for node in nodes)
    assert [node["ms_per_step"] for node in nodes] == sorted((node["ms_per_step"] for node in nodes), reverse=True)
    # no node takes longer than all the nodes of its operator type together
    assert all(node["ms_per_step"] <= result["ops"][node["op"]]["ms_per_step"] for node in nodes)
