"""The graph variants of `bench.step_variants` on the tiny model: what each rewrite changes in
the int8 graphs, that the rewritten repository loads and decodes, the attention timing, and the
benchmark's report."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

from bench.step_variants import (
    ATTENTION_CACHES,
    attention_us,
    float_self_cache,
    fuse_skip_layer_norms,
    main,
    variant_repository,
)
from export.kv_cache import add_int8_cache
from service.batching.slot_batch import generate_running
from service.repository.manifest import read_manifest, verify_files
from service.runtime import CPU, ModelRuntime


def _int8(directory: Path) -> list[onnx.ModelProto]:
    """The int8 variant's encoder and step graph."""
    entry = read_manifest(directory).variants["int8"]
    assert entry.step_decoder
    return [onnx.load_model(str(directory / name)) for name in (entry.encoder, entry.step_decoder)]


def _decoded(directory: Path, sources: list[list[int]]) -> dict[int, list[int]]:
    runtime = ModelRuntime.load(directory, [CPU], threads=1, variant="int8")
    return {i: result.tokens for i, result in generate_running(runtime, list(enumerate(sources)), rows=8)}


def _sources(directory: Path, data: Path) -> list[list[int]]:
    runtime = ModelRuntime.load(directory, [CPU], threads=1, variant="int8")
    texts = (data / "test.src").read_text(encoding="utf-8").splitlines()
    return [ids + [runtime.eos_id] for ids in runtime.tokenizer.encode_batch(texts)]


def test_fused_layer_norms_leave_no_add_before_a_layer_norm_and_decode_the_reversals(
        tiny_model_repository: Path, tmp_path: Path) -> None:
    fused = variant_repository(tiny_model_repository, "skip-layer-norm", tmp_path / "fused")
    verify_files(fused, read_manifest(fused))  # hashed anew
    for before, after in zip(_int8(tiny_model_repository), _int8(fused), strict=True):
        assert "SkipLayerNormalization" not in {n.op_type for n in before.graph.node}
        fused_nodes = [n for n in after.graph.node if n.op_type == "SkipLayerNormalization"]
        assert fused_nodes and len(after.graph.node) < len(before.graph.node)
        producers = {output: n.op_type for n in after.graph.node for output in n.output}
        assert not any(producers.get(n.input[0]) == "Add" for n in after.graph.node if n.op_type == "LayerNormalization")
        with pytest.raises(ValueError, match="no Add followed by a LayerNormalization"):
            fuse_skip_layer_norms(after)  # a variant must differ from the graph it rewrites
    sources = _sources(tiny_model_repository, tiny_model_repository.parent / "data")
    expected, actual = _decoded(tiny_model_repository, sources), _decoded(fused, sources)
    reversal = {i: source[:-1][::-1] for i, source in enumerate(sources)}
    assert sum(actual[i] == reversal[i] for i in reversal) >= sum(expected[i] == reversal[i] for i in reversal) - 2


def test_the_float_self_cache_keeps_the_cross_keys_and_values_int8(tiny_repository_and_data: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    shipped, data = tiny_repository_and_data
    with pytest.raises(ValueError, match="int8 cache"):
        float_self_cache(_int8(shipped)[1])  # the float cache already
    assert add_int8_cache(shipped, data, calibration_rows=50, threads=1) is not None
    variant = variant_repository(shipped, "float-self-cache", tmp_path / "float-self")
    step = _int8(variant)[1]
    types = {v.name: v.type.tensor_type.elem_type for v in [*step.graph.input, *step.graph.output]}
    layers = read_manifest(variant).config.n_decoder_layers
    for i in range(layers):
        assert types[f"past_key.{i}"] == types[f"present_value.{i}"] == TensorProto.FLOAT
        assert types[f"cross_key.{i}"] == types[f"present_cross_value.{i}"] == TensorProto.INT8
    attention = [n for n in step.graph.node if n.op_type == "GroupQueryAttention"]
    self_nodes = [n for n in attention if n.input[3].startswith("past_key.")]
    assert len(self_nodes) == layers and all(not n.input[-1].startswith("self_") for n in self_nodes)
    assert not any(t.name.startswith("self_key_scale") for t in step.graph.initializer)
    runtime = ModelRuntime.load(variant, [CPU], threads=1, variant="int8")
    assert runtime.step is not None and runtime.step.get_inputs()[3].type == "tensor(float)"
    sources = _sources(variant, data)
    decoded = _decoded(variant, sources)
    reversal = {i: source[:-1][::-1] for i, source in enumerate(sources)}
    assert sum(decoded[i] == reversal[i] for i in reversal) >= 0.8 * len(reversal)


@pytest.mark.parametrize("cache", list(ATTENTION_CACHES))
def test_attention_is_timed_for_each_cache_type(cache: str) -> None:
    assert attention_us(cache, rows=2, length=3, capacity=8, calls=3) > 0


def test_the_report_compares_each_arm_with_the_shipped_graphs(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    models, data = tiny_bench_dirs
    out = tmp_path / "out"
    assert main(["--model", str(models / "tiny-reverse"), "--data-dir", str(data), "--variants", "re-saved",
                 "--padding-slacks", "1.0", "--sentences", "12", "--rows", "4", "--group", "2", "--turns", "2",
                 "--out", str(out)]) == 0
    result = json.loads((out / "step_variants.json").read_text(encoding="utf-8"))
    arms = result["arms"]
    assert list(arms) == ["shipped", "re-saved", "padding slack 1"]
    assert arms["re-saved"]["same_tokens"] == 1.0 and arms["re-saved"]["nodes"] == arms["shipped"]["nodes"]
    assert all(len(arm["runs"]) == 2 and arm["median"]["steps"] > 0 for arm in arms.values())
    assert "| re-saved |" in (out / "step_variants.md").read_text(encoding="utf-8")
