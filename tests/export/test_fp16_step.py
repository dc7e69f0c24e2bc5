"""The fp16 variant's step graph (`decoder_step.fp16.onnx`): float16 caches and cross keys/values
in its inputs and outputs (the type CUDA's GroupQueryAttention takes), float32 logits, the fp32
weights shared; on the CPU it decodes the fp32 step graph's tokens. `add_step_graph` gives a
repository exported without it the same file, changing no other file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from export.parity import StepDisagreement, slot_batch_decode
from export.storage import WEIGHTS_FILE
from model.checkpoint import load_model
from model.decoding import greedy_decode, pad_batch
from service.repository.manifest import read_manifest, verify_files, write_manifest
from service.runtime import CPU, ModelRuntime

STEP_FP16 = "decoder_step.fp16.onnx"


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    return [s + [3] for s in trained_tiny.valid.sources[:16]]


def _types(session: ort.InferenceSession) -> dict[str, str]:
    return {v.name: v.type for v in [*session.get_inputs(), *session.get_outputs()]}


def test_the_fp16_variant_has_a_step_graph_with_float16_caches(tiny_fp16_repository: Path,
                                                               tiny_model_repository: Path) -> None:
    manifest = read_manifest(tiny_fp16_repository)
    verify_files(tiny_fp16_repository, manifest)
    assert manifest.variants["fp16"].step_decoder == STEP_FP16
    assert STEP_FP16 in manifest.files
    session = ort.InferenceSession(str(tiny_fp16_repository / STEP_FP16), providers=[CPU])
    types = _types(session)
    caches = {n: t for n, t in types.items() if n.startswith(("past_", "present_", "cross_"))}
    # past, present, cross and present cross keys and values of each layer
    assert len(caches) == 8 * manifest.config.n_decoder_layers
    assert set(caches.values()) == {"tensor(float16)"}
    assert (types["logits"], types["input_ids"], types["source_mask"]) == ("tensor(float)", "tensor(int64)",
                                                                          "tensor(bool)")
    graph = onnx.load_model(str(tiny_fp16_repository / STEP_FP16), load_external_data=False)
    assert any(n.op_type == "Cast" and n.input[0].endswith(".bf16") for n in graph.graph.node)
    # its weights are the fp32 graphs' bfloat16 numbers: weights.bin holds nothing more
    assert (tiny_fp16_repository / WEIGHTS_FILE).stat().st_size == (tiny_model_repository / WEIGHTS_FILE).stat().st_size
    agreement = manifest.exporter["step_graph_agreement"]["fp16"]
    assert agreement["reference"] == "fp32 step graph"
    assert agreement["rows_identical"] >= agreement["rows"] - 1 >= 1


def test_the_fp16_step_graph_decodes_what_pytorch_and_the_fp32_step_graph_decode(
        tiny_fp16_repository: Path, sources) -> None:
    """Greedy tokens in running batches on the CPU: float16 arithmetic may move a close call
    (rarely), so most rows, not all, are asked to agree."""
    fp32 = ModelRuntime.load(tiny_fp16_repository, [CPU], threads=1, variant="fp32")
    fp16 = ModelRuntime.load(tiny_fp16_repository, [CPU], threads=1, variant="fp16", step_graph=True)
    assert fp16.step is not None and _types(fp16.step)["past_key.0"] == "tensor(float16)"
    expected = slot_batch_decode(fp32, sources, 12)
    pytorch = [(g.tokens, g.finish_reason) for g in greedy_decode(load_model(tiny_fp16_repository),
                                                                  pad_batch(sources, 0), 12)]
    assert expected == pytorch
    actual = slot_batch_decode(fp16, sources, 12, group=5)  # three batches, rows of mixed lengths
    assert sum(a == e for a, e in zip(actual, expected, strict=True)) >= len(sources) - 1


def test_the_cpu_serves_the_fp16_step_graph_by_default(tiny_fp16_repository: Path) -> None:
    """Its attention has a float16 kernel on the CPU too (`STEP_CACHE_TYPES`)."""
    runtime = ModelRuntime.load(tiny_fp16_repository, [CPU], threads=1, variant="fp16")
    assert runtime.step is not None
    runtime.warmup()
    assert ModelRuntime.load(tiny_fp16_repository, [CPU], threads=1, variant="fp16", step_graph=False).step is None


# -- adding the step graph to a repository exported without it ------------------------------

def _without_fp16_step(repository: Path, tmp_path: Path) -> Path:
    """A copy of `repository` as an export without the fp16 step graph left it."""
    copy = Path(shutil.copytree(repository, tmp_path / "copy"))
    (copy / STEP_FP16).unlink()
    manifest = read_manifest(copy)
    manifest.variants["fp16"].step_decoder = ""
    del manifest.exporter["step_graph_agreement"]
    write_manifest(copy, manifest)
    return copy


def _hashes(repository: Path) -> dict[str, str]:
    return read_manifest(repository).files


def test_add_step_graph_writes_the_exports_file_and_changes_no_other(tiny_fp16_repository: Path,
                                                                     tmp_path: Path, capsys) -> None:
    from attnserve.cli import main

    copy = _without_fp16_step(tiny_fp16_repository, tmp_path)
    before = _hashes(copy)
    assert main(["add-step-graph", "--model-dir", str(copy), "--threads", "1", "--max-new-tokens", "12"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step_decoder"] == STEP_FP16
    assert report["step_graph_agreement"]["rows_identical"] >= report["step_graph_agreement"]["rows"] - 1
    manifest = read_manifest(copy)
    verify_files(copy, manifest)
    assert manifest.variants["fp16"].step_decoder == STEP_FP16
    after = _hashes(copy)
    assert {k: v for k, v in after.items() if k != STEP_FP16} == before  # weights.bin included
    assert (copy / STEP_FP16).read_bytes() == (tiny_fp16_repository / STEP_FP16).read_bytes()
    assert ModelRuntime.load(copy, [CPU], threads=1, variant="fp16").step is not None
    # a variant that has one is refused, the repository unchanged
    assert main(["add-step-graph", "--model-dir", str(copy)]) == 2
    assert _hashes(copy) == after


def test_a_step_graph_that_disagrees_leaves_the_repository_as_it_was(tiny_fp16_repository: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import export.repository
    from export.repository import add_step_graph

    copy = _without_fp16_step(tiny_fp16_repository, tmp_path)
    files = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*"))
    contents = {name: (copy / name).read_bytes() for name in files if (copy / name).is_file()}

    def disagree(*args, **kwargs):
        raise StepDisagreement("the fp16 step graph decodes the fp32 step graph's tokens on 0 of 4 rows")

    monkeypatch.setattr(export.repository, "step_agreement", disagree)
    with pytest.raises(StepDisagreement):
        add_step_graph(copy, threads=1)
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*")) == files
    assert {name: (copy / name).read_bytes() for name in contents} == contents
    verify_files(copy, read_manifest(copy))
