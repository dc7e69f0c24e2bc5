"""The step graph's passes (`share_input_shapes`: per-layer shape reads shared;
`select_before_projection`: each row's position taken before the output projection), and
`attnserve update-step-graphs`, which gives a repository's step graphs those passes in place."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.repository import step_graph_files, update_step_graphs
from export.step_graph import random_graph_inputs, select_before_projection, share_input_shapes
from service.repository.manifest import read_manifest, verify_files, write_manifest
from service.runtime import CPU, ModelRuntime

LAYER_INPUTS = ("past_key", "past_value", "cross_key", "cross_value")


def _unshared(graph: onnx.ModelProto) -> int:
    """Undo the pass: the k-th `Shape` of a layer input of layer 0 reads layer k's input of
    the same kind again, as the exporter wrote them; returns the nodes rewired."""
    seen: Counter[str] = Counter()
    rewired = 0
    for node in graph.graph.node:
        if node.op_type == "Shape" and node.input[0].endswith(".0") and node.input[0].split(".")[0] in LAYER_INPUTS:
            kind = node.input[0].split(".")[0]
            layer = seen[kind]
            seen[kind] += 1
            if layer:
                node.input[0] = f"{kind}.{layer}"
                rewired += 1
    return rewired


def _selected_after(graph: onnx.ModelProto) -> int:
    """Undo `select_before_projection`: the projection runs on the norm's (B, 1, D) output and a
    `Gather` after it takes `logits`, as the exporter wrote them; returns 1 if undone."""
    nodes = graph.graph.node
    select = next((node for node in nodes if node.name.endswith("_last_position")), None)
    if select is None:
        return 0
    for node in nodes:
        for i, name in enumerate(node.input):
            if name == select.output[0]:
                node.input[i] = select.input[0]
        for i, name in enumerate(node.output):
            if name == "logits":
                node.output[i] = "projected"
    nodes.remove(select)
    nodes.append(onnx.helper.make_node("Gather", ["projected", select.input[1]], ["logits"], name="select", axis=1))
    return 1


def _logits_producer(graph: onnx.ModelProto) -> str:
    return next(node.op_type for node in graph.graph.node if "logits" in node.output)


def _layer_shape_reads(graph: onnx.ModelProto) -> set[str]:
    inputs = {value.name for value in graph.graph.input}
    return {node.input[0] for node in graph.graph.node if node.op_type == "Shape" and node.input[0] in inputs}


def _optimized_nodes(graph: onnx.ModelProto, path: Path) -> int:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(graph.SerializeToString(), options, providers=[CPU])
    return len(onnx.load_model(str(path), load_external_data=False).graph.node)


def test_every_layer_reads_its_cache_shapes_from_one_input(trained_tiny, tmp_path: Path) -> None:
    """The exported step graph reads the shapes of layer 0's cache and cross keys/values only;
    onnxruntime then runs the index arithmetic once for all layers (fewer nodes after its
    optimizations) and the outputs are exactly those of the per-layer graph."""
    from export.step_graph import export_step_graph

    model = trained_tiny.load().eval()
    assert model.config.n_decoder_layers >= 2
    shared = export_step_graph(model)
    assert _layer_shape_reads(shared) <= {"input_ids", "source_mask", "past_key.0", "cross_key.0"}
    per_layer = onnx.ModelProto()
    per_layer.CopyFrom(shared)
    assert _unshared(per_layer) > 0
    assert any(name.endswith(".1") for name in _layer_shape_reads(per_layer))
    assert _optimized_nodes(shared, tmp_path / "shared.onnx") < _optimized_nodes(per_layer, tmp_path / "per-layer.onnx")
    # the pass is what the export applies: it rewires the per-layer graph back, and nothing more
    again = onnx.ModelProto()
    again.CopyFrom(per_layer)
    assert share_input_shapes(again) == _unshared(onnx.load_from_string(shared.SerializeToString()))
    assert again.SerializeToString() == shared.SerializeToString()
    sessions = [ort.InferenceSession(g.SerializeToString(), providers=[CPU]) for g in (shared, per_layer)]
    feed = random_graph_inputs(sessions[0], model.config.vocab_size)
    for a, b in zip(*(s.run(None, feed) for s in sessions), strict=True):
        np.testing.assert_array_equal(a, b)


def test_each_row_is_selected_before_the_output_projection(trained_tiny) -> None:
    """The exported step graph's projection writes `logits` itself, from each row's one
    position: the (B, V) logits are not copied out of a (B, 1, V) product. The pass turns a
    graph that selects after the projection into the exported one, with exactly its outputs,
    and leaves a float16 graph (its logits cast to float after the selection) as it is."""
    from export.step_graph import export_step_graph
    from export.variants import to_fp16

    model = trained_tiny.load().eval()
    selected = export_step_graph(model)
    assert _logits_producer(selected) == "MatMul"
    after = onnx.ModelProto()
    after.CopyFrom(selected)
    assert _selected_after(after) == 1
    assert _logits_producer(after) == "Gather"
    assert select_before_projection(selected) == 0  # the export has the pass already
    again = onnx.ModelProto()
    again.CopyFrom(after)
    assert select_before_projection(again) == 1
    assert again.SerializeToString() == selected.SerializeToString()
    sessions = [ort.InferenceSession(g.SerializeToString(), providers=[CPU]) for g in (selected, after)]
    feed = random_graph_inputs(sessions[0], model.config.vocab_size)
    for a, b in zip(*(s.run(None, feed) for s in sessions), strict=True):
        np.testing.assert_array_equal(a, b)
    half = to_fp16(after)
    unchanged = half.SerializeToString()
    assert select_before_projection(half) == 0
    assert half.SerializeToString() == unchanged


def _per_layer_copy(repository: Path, tmp_path: Path) -> Path:
    """A copy of `repository` whose step graphs read each layer's shapes from its own inputs
    and select each row's position after the output projection (as a repository exported
    before the passes), its manifest's hashes rewritten."""
    copy = tmp_path / repository.name
    shutil.copytree(repository, copy)
    for name in step_graph_files(read_manifest(copy)):
        graph = onnx.load_model(str(copy / name), load_external_data=False)
        assert _unshared(graph) > 0
        assert _selected_after(graph) == 1
        onnx.save_model(graph, str(copy / name))
    write_manifest(copy, read_manifest(copy))
    return copy


def test_update_step_graphs_gives_an_older_repository_the_exports_graphs(tiny_model_repository: Path,
                                                                        tmp_path: Path, capsys) -> None:
    from attnserve.cli import main

    copy = _per_layer_copy(tiny_model_repository, tmp_path)
    files = step_graph_files(read_manifest(copy))
    assert set(files) == {"decoder_step.onnx", "int8/decoder_step.onnx"}
    others = {name: (copy / name).read_bytes() for name in read_manifest(copy).files if name not in files}
    assert main(["update-step-graphs", "--model-dir", str(copy)]) == 0
    assert json.loads(capsys.readouterr().out)["updated"] == files
    verify_files(copy, read_manifest(copy))
    for name in files:  # the same bytes a new export writes
        assert (copy / name).read_bytes() == (tiny_model_repository / name).read_bytes()
    assert {name: (copy / name).read_bytes() for name in others} == others  # weights included
    assert ModelRuntime.load(copy, [CPU], threads=1, variant="int8").step is not None
    assert update_step_graphs(copy) == []  # a second run has nothing to do


def test_a_pass_that_changes_the_outputs_leaves_the_repository_as_it_was(tiny_model_repository: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A pass that changes what a graph computes, or one onnxruntime cannot run (the command then
    exits 2 with one line), leaves every file as it was."""
    import export.repository
    from attnserve.cli import main

    copy = _per_layer_copy(tiny_model_repository, tmp_path)
    contents = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}

    def sigmoid(graph: onnx.ModelProto) -> int:  # a pass that runs but changes what the graph computes
        changed = [node for node in graph.graph.node if node.op_type == "Relu"]
        for node in changed:
            node.op_type = "Sigmoid"
        return len(changed)

    def wrong_width(graph: onnx.ModelProto) -> int:  # cross-attention told the cache's width: onnxruntime fails
        shapes = [node for node in graph.graph.node if node.op_type == "Shape" and node.input[0] == "cross_key.0"]
        for node in shapes:
            node.input[0] = "past_key.0"
        return len(shapes)

    monkeypatch.setattr(export.repository, "share_input_shapes", sigmoid)
    with pytest.raises(RuntimeError, match="changed"):
        update_step_graphs(copy)
    monkeypatch.setattr(export.repository, "share_input_shapes", wrong_width)
    assert main(["update-step-graphs", "--model-dir", str(copy)]) == 2
    assert "fails on random inputs" in caplog.text
    assert {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == contents
    verify_files(copy, read_manifest(copy))
