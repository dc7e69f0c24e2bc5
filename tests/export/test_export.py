"""Export -> onnxruntime -> parity with PyTorch, on the tiny model repository (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.parity import (
    ATTENTION_ATOL,
    KEY_VALUE_ATOL,
    LOGITS_ATOL,
    MIN_STEP_AGREEMENT,
    OutputMismatch,
    ParityError,
    check_parity,
)
from export.quality import within_bound
from export.repository import RepositoryTooLarge, _fit
from model.checkpoint import load_model
from model.transformer import Transformer
from service.repository import graph_io
from service.repository.manifest import read_manifest, verify_files, write_manifest
from service.runtime import CPU, ModelRuntime

BATCHES = {
    "batch 1": [[5, 9, 12, 3]],
    "batch 5, mixed lengths": [[5, 9, 12, 3], [7, 3], [4, 8, 15, 16, 19, 11, 6, 10, 3], [13, 13, 3], [18, 4, 6, 9, 3]],
}








def test_repository_layout_and_manifest(tiny_model_repository: Path) -> None:
    manifest = read_manifest(tiny_model_repository)
    verify_files(tiny_model_repository, manifest)
    assert set(manifest.files) == {
        "checkpoint.safetensors", "config.json", "tokenizer.model", "encoder.onnx", "decoder.onnx",
        "weights.bin", "int8/encoder.onnx", "int8/decoder.onnx", "int8/weights.bin",
        "decoder_step.onnx", "int8/decoder_step.onnx",
    }
    assert (manifest.task, manifest.opset, manifest.source_suffix) == ("translate", 18, "eos")
    assert manifest.special_ids == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert manifest.model_config["vocab_size"] == 20 and manifest.max_target_len == 16
    assert manifest.variants["fp32"].servable and manifest.variants["fp32"].quality == manifest.quality
    assert (manifest.variants["fp32"].step_decoder, manifest.variants["int8"].step_decoder) == (
        "decoder_step.onnx", "int8/decoder_step.onnx")
    assert manifest.quality is not None and manifest.quality["chrf"] > 90  # it reverses (1-2 word lines: BLEU 0)
    int8 = manifest.variants["int8"]
    assert int8.quality is not None and int8.servable == within_bound("translate", manifest.quality, int8.quality)
    parity = manifest.exporter["parity"]
    assert parity["max_abs_diff"]["logits"] <= LOGITS_ATOL and parity["greedy_rows_identical"] >= 2
    # the int8 step graph's greedy tokens against the fp32 step graph's, on the parity check's sources
    (agreement,) = manifest.exporter["step_graph_agreement"].values()
    assert manifest.exporter["step_graph_agreement"].keys() == {"int8"}
    assert agreement["rows"] == 4 and agreement["rows_identical"] >= MIN_STEP_AGREEMENT * agreement["rows"]
    assert parity["max_abs_diff"]["step_graph_logits"] <= LOGITS_ATOL  # the step graph was checked too


@pytest.mark.parametrize("graph", ["encoder", "decoder", "decoder_step"])
def test_graph_io_names_and_named_dynamic_axes(tiny_model_repository: Path, graph: str) -> None:
    manifest = read_manifest(tiny_model_repository)
    proto = onnx.load_model(str(tiny_model_repository / f"{graph}.onnx"), load_external_data=False)
    assert proto.opset_import[0].version == 18
    for kind, values in (("inputs", proto.graph.input), ("outputs", proto.graph.output)):
        expected = manifest.io[graph][kind]
        assert [v.name for v in values] == [e["name"] for e in expected]
        for value, entry in zip(values, expected, strict=True):
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            dynamic = [d for d in dims if isinstance(d, str)]
            assert dynamic == [a for a in entry["axes"] if a not in ("heads", "head_dim", "vocab", "one")], value.name
    assert [e["name"] for e in manifest.io["decoder"]["outputs"]] == graph_io.decoder_outputs(2)


@pytest.mark.parametrize("case", BATCHES)
def test_parity_with_and_without_cache(tiny_repository_model: Transformer, tiny_runtime: ModelRuntime, case: str) -> None:
    """Encoder outputs, teacher-forced logits/attention (past 0), step-by-step with the cache,
    and greedy tokens all match PyTorch."""
    report = check_parity(tiny_repository_model, tiny_runtime, BATCHES[case], max_new_tokens=12)
    assert report.greedy_rows == len(BATCHES[case]) + (1 if len(BATCHES[case]) > 1 else 0)
    assert report.max_abs_diff["logits"] <= LOGITS_ATOL
    assert max(report.max_abs_diff[k] for k in ("encoder_attention", "self_attention", "cross_attention")) <= ATTENTION_ATOL
    assert max(report.max_abs_diff[k] for k in ("cross_key_value", "present_key_value")) <= KEY_VALUE_ATOL


def test_a_different_model_fails_parity_with_a_typed_error(tiny_runtime: ModelRuntime, random_tiny: Transformer) -> None:
    with pytest.raises(OutputMismatch, match=r"encoder_attention\.0 \(batch 1\) differs from PyTorch by") as caught:
        check_parity(random_tiny, tiny_runtime, BATCHES["batch 5, mixed lengths"])
    assert isinstance(caught.value, ParityError) and caught.value.max_abs_diff > ATTENTION_ATOL


def test_a_step_graph_of_another_model_fails_parity(tiny_repository_model: Transformer, tiny_runtime: ModelRuntime,
                                                    random_tiny: Transformer) -> None:
    """The encoder and merged decoder agree with PyTorch; the step graph does not: caught."""
    import dataclasses

    from export.step_graph import export_step_graph

    other = ort.InferenceSession(export_step_graph(random_tiny).SerializeToString(), providers=[CPU])
    broken = dataclasses.replace(tiny_runtime, step=other)
    with pytest.raises(OutputMismatch, match=r"step graph logits \(step 0\)"):
        check_parity(tiny_repository_model, broken, BATCHES["batch 5, mixed lengths"])


def test_attention_output_shapes(tiny_runtime: ModelRuntime) -> None:
    sources = BATCHES["batch 5, mixed lengths"][:3]  # lengths 4, 2, 9
    state = tiny_runtime.encode(tiny_runtime.pad(sources), need_attention=True)
    batch, heads, source_len = 3, 4, 9
    assert state.attentions is not None and len(state.attentions) == 2
    assert all(a.shape == (batch, heads, source_len, source_len) for a in state.attentions)
    assert all(k.shape == (batch, heads, source_len, 16) for k in state.cross_keys + state.cross_values)
    first = tiny_runtime.decode(np.array([[2, 5]] * batch), state, need_attention=True)  # past 0, new 2
    step = tiny_runtime.decode(np.array([[7, 8, 9]] * batch), state, first.cache, need_attention=True)  # past 2, new 3
    assert step.logits.shape == (batch, 3, 20)
    assert step.self_attentions is not None and step.cross_attentions is not None
    assert all(a.shape == (batch, heads, 3, 5) for a in step.self_attentions)
    assert all(a.shape == (batch, heads, 3, source_len) for a in step.cross_attentions)
    assert all(k.shape == (batch, heads, 5, 16) for k in step.cache.keys + step.cache.values)
    np.testing.assert_allclose(step.self_attentions[0].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(step.cross_attentions[1][1, :, :, 2:].sum(), 0.0)  # row 1's source is 2 long


def test_smallest_sizes_match_pytorch(tiny_runtime: ModelRuntime, tiny_repository_model: Transformer) -> None:
    """Batch 1, a source of just EOS, past 0 then past 1: the sizes torch.export specialises."""
    import torch

    with torch.no_grad():
        start = tiny_repository_model.start_decoding(tiny_repository_model.encode(torch.tensor([[3]])))
        first = tiny_repository_model.decode(torch.tensor([[2]]), start)
        second = tiny_repository_model.decode(torch.tensor([[9]]), first.cache)
    state = tiny_runtime.encode(np.array([[3]]))
    step = tiny_runtime.decode(np.array([[2]]), state)
    np.testing.assert_allclose(step.logits, first.logits.numpy(), atol=LOGITS_ATOL)
    step = tiny_runtime.decode(np.array([[9]]), state, step.cache)
    np.testing.assert_allclose(step.logits, second.logits.numpy(), atol=LOGITS_ATOL)


def test_left_padded_past_equals_the_row_alone(tiny_runtime: ModelRuntime) -> None:
    """Rows with different past lengths share one call by left-padding (continuous batching)."""
    sources = [[5, 9, 12, 3], [7, 11, 3]]
    state = tiny_runtime.encode(tiny_runtime.pad(sources))
    prefixes = [[2, 12, 9, 5], [2, 11]]
    ids = np.array([prefixes[0], [0, 0, *prefixes[1]]])
    mask = ids != 0  # row 1 is left-padded by 2
    positions = np.array([[0, 1, 2, 3], [0, 0, 0, 1]])
    past = tiny_runtime.decode(ids, state, positions=positions, target_mask=mask)
    step = tiny_runtime.decode(np.array([[7], [4]]), state, past.cache, positions=np.array([[4], [2]]),
                          target_mask=np.concatenate([mask, [[True], [True]]], axis=1))
    for row in range(2):
        alone_state = tiny_runtime.encode(tiny_runtime.pad([sources[row]]))
        alone = tiny_runtime.decode(np.array([[*prefixes[row], [7, 4][row]]]), alone_state)
        np.testing.assert_allclose(step.logits[row, 0], alone.logits[0, -1], atol=LOGITS_ATOL)


def test_int8_variant_loads_and_runs(tiny_model_repository: Path, tiny_runtime: ModelRuntime, trained_tiny) -> None:
    from service.generation.search import generate

    int8 = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="int8")
    assert (int8.variant, int8.provider) == ("int8", CPU)
    sources = [s + [3] for s in trained_tiny.valid.sources[:12]]
    quantized, full = generate(int8, sources, 1, 12), generate(tiny_runtime, sources, 1, 12)
    assert sum(q.tokens == f.tokens for q, f in zip(quantized, full)) >= 10  # int8 mostly agrees with fp32


def test_cpu_takes_int8_only_when_servable(tiny_model_repository: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_model_repository, tmp_path / "copy"))
    manifest = read_manifest(copy)
    for servable, expected in ((True, "int8"), (False, "fp32")):
        manifest.variants["int8"].servable = servable
        write_manifest(copy, manifest)
        assert ModelRuntime.load(copy, ["CUDAExecutionProvider", CPU], threads=1).variant == expected


def test_unusable_providers_and_variants_are_load_errors(tiny_model_repository: Path) -> None:
    from service.runtime import ModelLoadError

    with pytest.raises(ModelLoadError, match="none of the providers"):
        ModelRuntime.load(tiny_model_repository, ["NoSuchExecutionProvider"])
    with pytest.raises(ModelLoadError, match="no variant 'fp16'"):
        ModelRuntime.load(tiny_model_repository, [CPU], variant="fp16")


def test_size_budget_drops_variants_never_fp32(tiny_model_repository: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_model_repository, tmp_path / "copy"))
    manifest = read_manifest(copy)
    size_mb = sum(p.stat().st_size for p in copy.rglob("*") if p.name != "manifest.json") / 2**20
    int8_mb = sum(p.stat().st_size for p in (copy / "int8").iterdir()) / 2**20
    _fit(copy, manifest, max_size_mb=size_mb - int8_mb / 2)
    assert "int8" not in manifest.variants and not (copy / "int8").exists()
    assert manifest.exporter["dropped_variants"]["int8"]["quality"] is not None
    write_manifest(copy, manifest)
    assert ModelRuntime.load(copy, [CPU], threads=1).variant == "fp32"
    with pytest.raises(RepositoryTooLarge):
        _fit(copy, manifest, max_size_mb=0.01)


def test_fp16_variant_keeps_float32_io(tiny_model_repository: Path, tiny_runtime, tmp_path: Path) -> None:
    """The fp16 conversion (meant for CUDA) keeps float32 graph inputs/outputs; it also runs on CPU."""
    from export.storage import load_graph, save_graphs
    from export.variants import to_fp16

    save_graphs(tmp_path, {"decoder.onnx": to_fp16(load_graph(tiny_model_repository / "decoder.onnx"))})
    session = ort.InferenceSession(str(tmp_path / "decoder.onnx"), providers=[CPU])
    assert {v.type for v in session.get_outputs()} == {"tensor(float)"}
    assert {v.type for v in session.get_inputs() if v.name.startswith(("past", "cross"))} == {"tensor(float)"}
    fp32 = tiny_runtime.decoder  # the bfloat16-stored weights, cast to float32 at load
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[2, 5, 9]]), "positions": np.array([[0, 1, 2]]),
             "source_mask": np.ones((1, 4), bool), "target_mask": np.ones((1, 3), bool)}
    for name in graph_io.past_names(2):
        feeds[name] = np.zeros((1, 4, 0, 16), np.float32)
    for name in graph_io.cross_names(2):
        feeds[name] = rng.standard_normal((1, 4, 4, 16)).astype(np.float32)
    np.testing.assert_allclose(session.run(["logits"], feeds)[0], fp32.run(["logits"], feeds)[0], atol=0.05)


def test_check_parity_command(tiny_model_repository: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attnserve.cli import main

    assert main(["check-parity", "--model-dir", str(tiny_model_repository), "--threads", "1",
                 "--max-new-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_abs_diff"]["logits"] <= report["tolerances"]["logits"]


def test_export_command_arguments() -> None:
    from attnserve.cli import build_parser

    args = build_parser().parse_args([
        "export", "--checkpoint", "runs/translate-en-it/best", "--task", "translate-en-it",
        "--out", "models/translate-en-it", "--data-dir", "data/translate-en-it", "--variants", "fp32", "int8", "fp16",
    ])
    assert (args.variants, args.quality_rows, args.max_size_mb) == (["fp32", "int8", "fp16"], 500, 60.0)


def test_re_export_of_a_repository_keeps_its_training_provenance(tiny_model_repository: Path, tmp_path: Path) -> None:
    from export.commands import _provenance

    copy = Path(shutil.copytree(tiny_model_repository, tmp_path / "copy"))
    manifest = read_manifest(copy)
    manifest.exporter["source"] = {"checkpoint": "runs/tiny/last", "step": 400}
    write_manifest(copy, manifest)
    assert _provenance(str(copy)) == {"checkpoint": "runs/tiny/last", "step": 400, "re_exported_from": str(copy)}
    (copy / "manifest.json").unlink()  # a plain checkpoint folder: its own hash
    assert set(_provenance(str(copy))) == {"checkpoint", "sha256"}


@pytest.mark.gpu
def test_fp16_on_cuda(trained_tiny, tiny_tokenizer: Path, tmp_path: Path) -> None:
    """fp16 variant on the CUDA execution provider: loads, and greedy tokens equal PyTorch's."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here")
    from export.repository import write_repository
    from model.decoding import greedy_decode, pad_batch
    from service.generation.search import generate

    out = tmp_path / "fp16"
    write_repository(trained_tiny.load(), tiny_tokenizer, out, task="translate", source_language="en",
                     target_language="en", variants=("fp32", "fp16"))
    tiny_runtime = ModelRuntime.load(out, ["CUDAExecutionProvider", CPU], variant="fp16")
    assert (tiny_runtime.provider, tiny_runtime.variant) == ("CUDAExecutionProvider", "fp16")
    sources = BATCHES["batch 5, mixed lengths"]
    expected = greedy_decode(load_model(out), pad_batch(sources, 0), 12)
    assert [g.tokens for g in generate(tiny_runtime, sources, 1, 12)] == [g.tokens for g in expected]
