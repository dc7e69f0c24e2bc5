"""A self-attention's query, key and value as one int8 product packed into its kernel
(`export.fused_projections`), as the int8 export applies it and as `attnserve update-step-graphs`
gives it to a repository exported before it."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import export.variants
from export.fused_projections import fuse_float_projections, fuse_shared_projections
from export.repository import update_step_graphs
from export.step_graph import random_graph_inputs
from export.storage import add_graphs, load_graph
from export.variants import convert, convert_step
from service.batching.slot_batch import generate_running
from service.repository.manifest import read_manifest, verify_files, write_manifest
from service.runtime import CPU, ModelRuntime

INT8_GRAPHS = ("encoder.onnx", "decoder.onnx", "decoder_step.onnx")


def _unfused(graph: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch, step: bool) -> onnx.ModelProto:
    """The fp32 `graph` quantized as the int8 export did before the pass: each projection alone."""
    with monkeypatch.context() as patch:
        patch.setattr(export.variants, "fuse_shared_projections", lambda graph: 0)
        return (convert_step if step else convert)(graph, "int8")


def _ops(graph: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in graph.graph.node)


def _outputs(graph: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(graph.SerializeToString(), providers=[CPU])
    return session.run(None, feed)


@pytest.mark.parametrize("name", INT8_GRAPHS)
def test_one_product_per_self_attention_gives_the_same_outputs(tiny_model_repository: Path, name: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """In the step graph each layer's query, key and value become one integer product that its
    self-attention takes packed; the encoder and the merged decoder, whose projections go on
    apart, stay as they are unless asked to `split` (the encoder's cross keys/values of every
    decoder layer then one product too). Every output is exactly the unfused graph's."""
    config = read_manifest(tiny_model_repository).config
    step = name == "decoder_step.onnx"
    unfused = _unfused(load_graph(tiny_model_repository / name), monkeypatch, step=step)
    fused = onnx.ModelProto()
    fused.CopyFrom(unfused)
    groups = fuse_shared_projections(fused)
    assert groups == (config.n_decoder_layers if step else 0)
    if not step:
        assert fused.SerializeToString() == unfused.SerializeToString()
        groups = fuse_shared_projections(fused, split=True)
        assert groups == (config.n_encoder_layers + 1 if name == "encoder.onnx" else config.n_decoder_layers)
        assert _ops(fused)["Split"] - _ops(unfused)["Split"] == groups
    # a group of n products becomes one: 3 -> 1 per self-attention, 2 per decoder layer -> 1
    fewer = 2 * config.n_decoder_layers
    if name == "encoder.onnx":
        fewer = 2 * config.n_encoder_layers + 2 * config.n_decoder_layers - 1
    assert _ops(unfused)["MatMulInteger"] - _ops(fused)["MatMulInteger"] == fewer
    attention = [node for node in fused.graph.node if node.op_type == "GroupQueryAttention"]
    packed = [node for node in attention if node.input[1] == "" and node.input[2] == ""]
    assert len(packed) == (config.n_decoder_layers if step else 0)
    onnx.checker.check_model(fused)
    session = ort.InferenceSession(unfused.SerializeToString(), providers=[CPU])
    feed = random_graph_inputs(session, config.vocab_size)
    for a, b in zip(_outputs(fused, feed), session.run(None, feed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert fuse_shared_projections(fused, split=True) == 0  # nothing left to fuse


def test_the_export_applies_it(tiny_model_repository: Path) -> None:
    """The int8 step graph a new export writes has each self-attention's projections packed."""
    config = read_manifest(tiny_model_repository).config
    graph = onnx.load_model(str(tiny_model_repository / "int8" / "decoder_step.onnx"), load_external_data=False)
    attention = [node for node in graph.graph.node if node.op_type == "GroupQueryAttention"]
    packed = [node for node in attention if node.input[1] == "" and node.input[2] == ""]
    assert len(packed) == config.n_decoder_layers
    readers = Counter(node.input[0] for node in graph.graph.node if node.op_type == "MatMulInteger")
    assert max(readers.values()) == 1


def _older_copy(repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of `repository` whose int8 step graph is quantized as before the pass (each
    projection alone), its manifest's hashes rewritten."""
    copy = tmp_path / repository.name
    shutil.copytree(repository, copy)
    unfused = _unfused(load_graph(repository / "decoder_step.onnx"), monkeypatch, step=True)
    add_graphs(copy / "int8", {"decoder_step.onnx": unfused})
    write_manifest(copy, read_manifest(copy))
    return copy


def _tokens(repository: Path, sources: list[list[int]]) -> list[list[int]]:
    runtime = ModelRuntime.load(repository, [CPU], threads=1, variant="int8")
    return [result.tokens for _, result in generate_running(runtime, list(enumerate(sources)), rows=4)]


def test_update_step_graphs_gives_an_older_repository_the_exports_graph(
        tiny_model_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from attnserve.cli import main

    copy = _older_copy(tiny_model_repository, tmp_path, monkeypatch)
    step = "int8/decoder_step.onnx"
    assert (copy / step).read_bytes() != (tiny_model_repository / step).read_bytes()
    sources = [[5, 6, 7, 3], [8, 9, 10, 11, 12, 3], [13, 3]]
    before = _tokens(copy, sources)
    others = {name: (copy / name).read_bytes() for name in read_manifest(copy).files
              if name not in (step, "int8/weights.bin")}
    size = (copy / "int8" / "weights.bin").stat().st_size
    assert main(["update-step-graphs", "--model-dir", str(copy)]) == 0
    assert json.loads(capsys.readouterr().out)["updated"] == [step]
    verify_files(copy, read_manifest(copy))
    new, exported = (onnx.load_model(str(root / step)) for root in (copy, tiny_model_repository))
    assert new.SerializeToString() == exported.SerializeToString()  # the graph a new export writes
    assert (copy / "int8" / "weights.bin").stat().st_size > size  # the fused weights appended
    assert {name: (copy / name).read_bytes() for name in others} == others
    assert _tokens(copy, sources) == before
    assert update_step_graphs(copy) == []  # a second run has nothing to do


def test_a_fusion_that_changes_the_outputs_leaves_the_repository_as_it_was(
        tiny_model_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A fusion whose product differs from the projections it replaces (one weight scale off) is
    refused: the command exits 2 with one line and every file, weights.bin included, is as it was."""
    import export.repository
    from attnserve.cli import main

    copy = _older_copy(tiny_model_repository, tmp_path, monkeypatch)
    contents = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}

    def off_by_a_scale(graph: onnx.ModelProto) -> int:
        fused = fuse_shared_projections(graph)
        for tensor in graph.graph.initializer:
            if tensor.name.endswith("_fused_weight_scale"):
                values = onnx.numpy_helper.to_array(tensor).copy()
                values[0] *= 2
                tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
        return fused

    monkeypatch.setattr(export.repository, "fuse_shared_projections", off_by_a_scale)
    assert main(["update-step-graphs", "--model-dir", str(copy)]) == 2
    assert "changed with the graph passes" in caplog.text
    assert {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == contents
    verify_files(copy, read_manifest(copy))


def test_a_float_step_graphs_self_attentions_take_one_packed_product(tiny_model_repository: Path) -> None:
    """`fuse_float_projections` on the fp32 step graph: each self-attention's three products (and
    bias adds) become one over weights and biases concatenated in the graph (casts of the
    repository's initializers, which onnxruntime folds at load), taken packed; on the CPU every
    output is the unpacked graph's to the last bit. The merged decoder has no such attention and
    is left as it is."""
    config = read_manifest(tiny_model_repository).config
    unpacked = load_graph(tiny_model_repository / "decoder_step.onnx")
    packed = onnx.ModelProto()
    packed.CopyFrom(unpacked)
    assert fuse_float_projections(packed) == config.n_decoder_layers
    assert _ops(unpacked)["MatMul"] - _ops(packed)["MatMul"] == 2 * config.n_decoder_layers
    attention = [node for node in packed.graph.node if node.op_type == "GroupQueryAttention"]
    assert sum(node.input[1] == node.input[2] == "" for node in attention) == config.n_decoder_layers
    assert {t.name for t in packed.graph.initializer} == {t.name for t in unpacked.graph.initializer}
    onnx.checker.check_model(packed)
    session = ort.InferenceSession(unpacked.SerializeToString(), providers=[CPU])
    feed = random_graph_inputs(session, config.vocab_size)
    for a, b in zip(_outputs(packed, feed), session.run(None, feed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert fuse_float_projections(packed) == 0  # nothing left to pack
    merged = load_graph(tiny_model_repository / "decoder.onnx")
    before = merged.SerializeToString()
    assert fuse_float_projections(merged) == 0 and merged.SerializeToString() == before


def test_update_step_graphs_packs_the_float_graphs_only_when_asked(tiny_model_repository: Path,
                                                                    tmp_path: Path, capsys) -> None:
    """`update-step-graphs --pack-float-projections` gives the fp32 step graph packed projections
    (the graph file alone changes: no weights are written; its outputs exact on random inputs, the
    same tokens in a running batch); without the flag the float graphs stay as they are."""
    from attnserve.cli import main

    copy = tmp_path / tiny_model_repository.name
    shutil.copytree(tiny_model_repository, copy)
    assert update_step_graphs(copy) == []  # the export's passes only: nothing to do
    step = read_manifest(copy).variants["fp32"].step_decoder
    contents = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    sources = [[5, 6, 7, 3], [8, 9, 10, 11, 12, 3], [13, 3]]
    runtime = ModelRuntime.load(copy, [CPU], threads=1, variant="fp32")
    before = [result.tokens for _, result in generate_running(runtime, list(enumerate(sources)), rows=4)]
    assert main(["update-step-graphs", "--model-dir", str(copy), "--pack-float-projections"]) == 0
    assert json.loads(capsys.readouterr().out)["updated"] == [step]
    verify_files(copy, read_manifest(copy))
    after = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert {name for name in after if after[name] != contents.get(name)} == {step, "manifest.json"}
    graph = onnx.load_model(str(copy / step), load_external_data=False)
    attention = [node for node in graph.graph.node if node.op_type == "GroupQueryAttention"]
    layers = read_manifest(copy).config.n_decoder_layers
    assert sum(node.input[1] == node.input[2] == "" for node in attention) == layers  # the self-attentions
    runtime = ModelRuntime.load(copy, [CPU], threads=1, variant="fp32")
    assert [result.tokens for _, result in generate_running(runtime, list(enumerate(sources)), rows=4)] == before
    assert update_step_graphs(copy, float_projections=True) == []  # a second run has nothing to do
