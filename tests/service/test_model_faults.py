"""Broken model files on the real runtime: the server stays live, never ready, and says why.

Each fault is applied to a copy of the tiny repository: a missing file, a zero-byte file, a
file whose bytes changed (its sha256 no longer matches the manifest), and a corrupt graph whose
manifest hash was updated to match (so onnxruntime itself must refuse it). Nothing here is
ever unpickled: weights are safetensors and ONNX, checked against the manifest first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")

from service.api.app import create_app
from tests.service.conftest import serving, tiny_settings, wait_until_settled

pytestmark = pytest.mark.anyio


def _missing(path: Path) -> None:
    path.unlink()


def _zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


def _flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_with_matching_hash(path: Path) -> None:
    path.write_bytes(b"\x08\x07garbage that is not a protobuf model" * 50)
    manifest_path = path.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


FAULTS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "missing encoder": ("encoder.onnx", _missing, "encoder.onnx"),
    "zero-byte decoder": ("decoder.onnx", _zero_bytes, "decoder.onnx"),
    "hash mismatch": ("encoder.onnx", _flipped, "sha256"),
    "corrupt graph, matching hash": ("encoder.onnx", _corrupt_with_matching_hash,
                                     "encoder.onnx"),
    "missing tokenizer": ("tokenizer.model", _missing, "tokenizer.model"),
    "corrupt manifest": ("manifest.json", lambda p: p.write_text("{not json"), "manifest"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_broken_model_file_leaves_the_server_live_not_ready(
    tiny_model_repository: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    file_name, damage, named = FAULTS[fault]
    broken = tmp_path / "models" / "broken"
    shutil.copytree(tiny_model_repository, broken)
    damage(broken / file_name)
    caplog.set_level(logging.ERROR, logger="service.core.registry")
    app = create_app(tiny_settings(tmp_path / "models"))
    async with serving(app, wait_ready=False) as client:
        [card] = (await wait_until_settled(client, timeout_s=60)).values()
        live = await client.get("/health/live")
        ready = await client.get("/health/ready")
        request = await client.post("/v1/translate", json={"text": "abc"})
    assert card["state"] == "failed" and named in card["error"], card
    assert live.status_code == 200
    assert ready.status_code == 503 and "broken (failed)" in ready.json()["error"]
    # Without a readable manifest the model's task is unknown: no translate model (404).
    expected = (404, "model_not_found") if file_name == "manifest.json" else (503, "not_ready")
    assert (request.status_code, request.json()["error_type"]) == expected
    lines = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
    assert len(lines) == 1 and "broken" in lines[0] and named in lines[0]


def test_no_loader_unpickles() -> None:
    """The serving and export code never calls pickle, torch.load or numpy's allow_pickle."""
    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("service/**/*.py"), *root.glob("export/**/*.py"),
               root / "model" / "checkpoint.py"]
    banned = ("import pickle", "pickle.load", "torch.load(", "allow_pickle=True",
              "import dill", "cloudpickle")
    offenders = [f"{path.name}: {word}" for path in sources
                 for word in banned if word in path.read_text(encoding="utf-8")]
    assert sources and not offenders
