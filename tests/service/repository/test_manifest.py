"""The manifest: round trip, hash check, and the runtime refusing a repository that fails it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from service.repository.manifest import (
    EmptyFile,
    HashMismatch,
    Manifest,
    ManifestError,
    MissingFile,
    Variant,
    read_manifest,
    verify_files,
    write_manifest,
)


def _manifest() -> Manifest:
    return Manifest(
        name="m", task="translate", source_language="en", target_language="it",
        model_config={"vocab_size": 20}, special_ids={"pad": 0, "unk": 1, "bos": 2, "eos": 3},
        max_source_len=16, max_target_len=16, opset=18, io={"encoder": {"inputs": [], "outputs": []}},
        variants={"fp32": Variant("encoder.onnx", "decoder.onnx", "fp32", ["CPUExecutionProvider"], True)},
    )


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A fake repository: the files the manifest refers to, with arbitrary bytes."""
    for name in ("encoder.onnx", "decoder.onnx", "tokenizer.model", "checkpoint.safetensors", "int8/weights.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode() * 10)
    write_manifest(tmp_path, _manifest())
    return tmp_path


def test_round_trip_and_every_file_hashed(repository: Path) -> None:
    manifest = read_manifest(repository)
    assert manifest == Manifest.from_dict(json.loads((repository / "manifest.json").read_text()))
    assert sorted(manifest.files) == ["checkpoint.safetensors", "decoder.onnx", "encoder.onnx",
                                      "int8/weights.bin", "tokenizer.model"]
    assert manifest.variants["fp32"].servable and manifest.source_suffix == "eos"
    verify_files(repository, manifest)


def test_tampered_file_fails_the_hash_check(repository: Path) -> None:
    with (repository / "int8/weights.bin").open("r+b") as f:
        f.write(b"X")
    with pytest.raises(HashMismatch, match="int8/weights.bin") as caught:
        verify_files(repository, read_manifest(repository))
    assert caught.value.path == "int8/weights.bin" and caught.value.expected != caught.value.actual


def test_missing_and_empty_files(repository: Path) -> None:
    (repository / "decoder.onnx").write_bytes(b"")
    with pytest.raises(EmptyFile, match="decoder.onnx"):
        verify_files(repository, read_manifest(repository))
    (repository / "decoder.onnx").unlink()
    with pytest.raises(MissingFile, match="decoder.onnx"):
        verify_files(repository, read_manifest(repository))


@pytest.mark.parametrize("path", ["../outside.onnx", "/etc/passwd"])
def test_paths_must_stay_inside_the_repository(repository: Path, path: str) -> None:
    manifest = read_manifest(repository)
    manifest.variants["fp32"].encoder = path
    with pytest.raises(ManifestError, match="not a path inside"):
        verify_files(repository, manifest)


def test_malformed_manifests(repository: Path) -> None:
    path = repository / "manifest.json"
    values = json.loads(path.read_text())
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(repository)
    path.write_text(json.dumps(dict(values, task="classify")))
    with pytest.raises(ManifestError, match="task"):
        read_manifest(repository)
    path.write_text(json.dumps({k: v for k, v in values.items() if k != "variants"}))
    with pytest.raises(ManifestError, match="malformed"):
        read_manifest(repository)
    path.unlink()
    with pytest.raises(ManifestError, match="no manifest"):
        read_manifest(repository)


VOCAB_FILES = {"source": "source.spm", "target": "target.spm", "vocab": "vocab.json"}


def test_a_manifest_without_a_tokenizer_kind_names_one_sentencepiece_model(repository: Path) -> None:
    path = repository / "manifest.json"
    values = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in values.items() if not k.startswith("tokenizer_")}))
    manifest = read_manifest(repository)
    assert (manifest.tokenizer_kind, manifest.tokenizer_paths()) == ("sentencepiece", ["tokenizer.model"])
    verify_files(repository, manifest)


def test_a_vocabulary_tokenizer_lists_and_hashes_its_three_files(repository: Path) -> None:
    (repository / "tokenizer.model").unlink()
    for name in VOCAB_FILES.values():
        (repository / name).write_bytes(name.encode() * 10)
    manifest = _manifest()
    manifest.tokenizer, manifest.tokenizer_kind, manifest.tokenizer_files = "", "sentencepiece_vocab", VOCAB_FILES
    write_manifest(repository, manifest)
    read = read_manifest(repository)
    assert sorted(read.tokenizer_paths()) == sorted(VOCAB_FILES.values())
    verify_files(repository, read)
    (repository / "target.spm").unlink()
    with pytest.raises(MissingFile, match="target.spm"):
        verify_files(repository, read)
    read.files.pop("target.spm")
    with pytest.raises(ManifestError, match="target.spm not covered"):
        verify_files(repository, read)


@pytest.mark.parametrize(("kind", "files", "message"), [
    ("wordpiece", {}, "tokenizer_kind must be one of"),
    ("sentencepiece_vocab", {"source": "source.spm", "vocab": "vocab.json"}, "must name"),
    ("sentencepiece", VOCAB_FILES, "must name"),
])
def test_a_tokenizer_kind_needs_its_files(repository: Path, kind: str, files: dict[str, str], message: str) -> None:
    path = repository / "manifest.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), tokenizer_kind=kind, tokenizer_files=files)))
    with pytest.raises(ManifestError, match=message):
        read_manifest(repository)


# -- the runtime refuses what the check refuses (real tiny repository) --------------------------


@pytest.fixture
def repository_copy(tiny_model_repository: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_repository, tmp_path / "copy"))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("path", "damage", "message"),
    [
        ("weights.bin", _flip_a_byte, "weights.bin: sha256"),
        ("int8/decoder.onnx", lambda p: p.write_bytes(b""), "int8/decoder.onnx: zero bytes"),
        ("tokenizer.model", Path.unlink, "tokenizer.model: listed in manifest.json but missing"),
        ("manifest.json", lambda p: p.write_text("{"), "not valid JSON"),
    ],
    ids=["tampered", "zero-byte", "missing", "bad-manifest"],
)
def test_runtime_refuses_a_damaged_repository(repository_copy: Path, path: str, damage, message: str) -> None:
    from service.runtime import ModelError, ModelLoadError, ModelRuntime

    damage(repository_copy / path)
    with pytest.raises(ModelLoadError, match=message) as caught:
        ModelRuntime.load(repository_copy, ["CPUExecutionProvider"])
    assert isinstance(caught.value, ModelError)
    assert isinstance(caught.value.__cause__, ManifestError)


def test_runtime_loads_the_intact_copy(repository_copy: Path) -> None:
    from service.runtime import ModelRuntime

    runtime = ModelRuntime.load(repository_copy, ["CPUExecutionProvider"], threads=1)
    assert runtime.provider == "CPUExecutionProvider" and runtime.name == "tiny-reverse"
