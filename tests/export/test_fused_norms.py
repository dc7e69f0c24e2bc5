"""`export.fused_norms`: each residual Add and its LayerNormalization as one
SkipLayerNormalization, in the float step graphs of a repository when asked."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import onnx
import pytest

import export.repository
from export.fused_norms import fuse_skip_layer_norms
from export.repository import update_step_graphs
from export.storage import load_graph
from service.batching.slot_batch import generate_running
from service.repository.manifest import read_manifest, verify_files
from service.runtime import CPU, ModelRuntime

SOURCES = [[5, 6, 7, 3], [8, 9, 10, 11, 12, 3], [13, 3]]


def _tokens(repository: Path) -> list[list[int]]:
    runtime = ModelRuntime.load(repository, [CPU], threads=1, variant="fp32")
    return [result.tokens for _, result in generate_running(runtime, list(enumerate(SOURCES)), rows=4)]


def test_every_add_and_norm_pair_fuses_and_the_sum_goes_on(tiny_model_repository: Path) -> None:
    """Every LayerNormalization of the tiny step graph reads an Add's sum: each pair becomes one
    node, the sums the residual stream still reads come out as the fused node's fourth output,
    and a second pass finds nothing."""
    step = read_manifest(tiny_model_repository).variants["fp32"].step_decoder
    graph = load_graph(tiny_model_repository / step)
    before = Counter(node.op_type for node in graph.graph.node)
    fused = fuse_skip_layer_norms(graph)
    after = Counter(node.op_type for node in graph.graph.node)
    assert fused == before["LayerNormalization"] == after["SkipLayerNormalization"] > 0
    assert after["LayerNormalization"] == 0 and after["Add"] == before["Add"] - fused
    readers = {name for node in graph.graph.node for name in node.input}
    skips = [node for node in graph.graph.node if node.op_type == "SkipLayerNormalization"]
    assert all(node.output[3] in readers for node in skips if node.output[3])
    assert sum(bool(node.output[3]) for node in skips) == fused - 1  # the last norm's sum goes nowhere
    onnx.checker.check_model(graph)
    assert fuse_skip_layer_norms(graph) == 0


def test_update_step_graphs_fuses_the_float_graphs_norms_only_when_asked(tiny_model_repository: Path,
                                                                          tmp_path: Path, capsys) -> None:
    """`update-step-graphs --fuse-layer-norms` changes the fp32 step graph alone (checked within
    the tolerance, the same tokens in a running batch); the int8 graph keeps its norms; a second
    run does nothing."""
    from attnserve.cli import main

    copy = tmp_path / tiny_model_repository.name
    shutil.copytree(tiny_model_repository, copy)
    manifest = read_manifest(copy)
    step = manifest.variants["fp32"].step_decoder
    contents = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    before = _tokens(copy)
    assert main(["update-step-graphs", "--model-dir", str(copy), "--fuse-layer-norms"]) == 0
    assert json.loads(capsys.readouterr().out)["updated"] == [step]
    verify_files(copy, read_manifest(copy))
    after = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert {name for name in after if after[name] != contents.get(name)} == {step, "manifest.json"}
    ops = Counter(n.op_type for n in onnx.load_model(str(copy / step), load_external_data=False).graph.node)
    assert ops["SkipLayerNormalization"] > 0 and ops["LayerNormalization"] == 0
    int8 = manifest.variants["int8"].step_decoder
    assert "SkipLayerNormalization" not in {n.op_type for n in onnx.load_model(str(copy / int8),
                                                                                load_external_data=False).graph.node}
    assert _tokens(copy) == before
    assert update_step_graphs(copy, layer_norms=True) == []


def test_a_fused_graph_past_the_tolerance_leaves_the_repository_as_it_was(tiny_model_repository: Path,
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / tiny_model_repository.name
    shutil.copytree(tiny_model_repository, copy)
    contents = {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    monkeypatch.setitem(export.repository.NORM_TOLERANCE, onnx.TensorProto.FLOAT, 1e-15)
    with pytest.raises(RuntimeError, match="moved by more than 1e-15"):
        update_step_graphs(copy, layer_norms=True)
    assert {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == contents
