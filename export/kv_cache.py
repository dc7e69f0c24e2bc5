"""An int8 cache for the step graph: its keys and values read as a quarter of the bytes.

On the CPU a running batch's step spends most of its time in `GroupQueryAttention`, reading
every row's cached and source keys and values in float32 (bench/README.md, "Where a running
batch's step spends its time now"). onnxruntime's kernel also takes an int8 cache with a fixed
scale per tensor (`k_quant_type`/`v_quant_type` "PER_TENSOR", `kv_cache_bit_width` 8, the
scales as inputs `k_scale`/`v_scale`): it quantizes each new position as it writes it and
dequantizes as it reads. `int8_cache_graph` rewrites a step graph that way, for its self-attention
cache and for its cross keys/values (which the caller quantizes as it writes them, with the
scales the graph's metadata lists, `graph_io.CROSS_SCALES`). Each cross-attention's "new"
key/value is the row's last source position, written back where it is: the graph takes it, and
that position, as inputs (`last_source_inputs`) which the caller keeps beside its slots, rather
than reading them back from the int8 buffer and dequantizing them at every step.

A tensor's scale is its largest magnitude over calibration sentences (`calibrate`: the encoder's
cross keys/values and the merged decoder's cache while it decodes them greedily) divided by 127.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.repository import graph_io
from service.runtime import CPU, ModelRuntime, to_numpy

QUANT_ATTRIBUTES = {"k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR", "kv_cache_bit_width": 8}
SCALE_INPUTS = 12  # GroupQueryAttention's inputs before k_scale and v_scale


@dataclass(frozen=True)
class CacheScales:
    """Per decoder layer, (key scale, value scale) of the self-attention cache and of the cross
    keys/values: a value is its int8 times its tensor's scale."""

    self_attention: list[tuple[float, float]]
    cross_attention: list[tuple[float, float]]

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {"self_attention": [list(pair) for pair in self.self_attention],
                "cross_attention": [list(pair) for pair in self.cross_attention]}


def calibrate(runtime: ModelRuntime, sources: Sequence[list[int]], batch: int = 32,
              max_new_tokens: int | None = None) -> CacheScales:
    """The scales that hold the largest magnitude each tensor takes on `sources` (ids ending with
    EOS): the encoder's cross keys/values, and the cache the merged decoder builds decoding them
    greedily, in batches of `batch` until every row has ended (rows that ended keep decoding
    and count too)."""
    layers = runtime.n_decoder_layers
    self_max = np.zeros((layers, 2))
    cross_max = np.zeros((layers, 2))
    limit = max_new_tokens or runtime.max_target_len
    for start in range(0, len(sources), batch):
        group = list(sources[start:start + batch])
        state = runtime.encode(runtime.pad(group))
        for i in range(layers):
            cross_max[i] = np.maximum(cross_max[i], [np.abs(to_numpy(state.cross_keys[i])).max(),
                                                     np.abs(to_numpy(state.cross_values[i])).max()])
        last = np.full((len(group), 1), runtime.decoder_start_id, dtype=np.int64)
        cache = None
        ended = np.zeros(len(group), dtype=bool)
        for _ in range(limit):
            out = runtime.decode(last, state, cache)
            cache = out.cache
            last = out.logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            ended |= last[:, 0] == runtime.eos_id
            if ended.all():
                break
        assert cache is not None
        for i in range(layers):
            self_max[i] = np.maximum(self_max[i], [np.abs(to_numpy(cache.keys[i])).max(),
                                                   np.abs(to_numpy(cache.values[i])).max()])
    scale = lambda pairs: [(float(k) / 127, float(v) / 127) for k, v in pairs]
    return CacheScales(scale(self_max), scale(cross_max))


def _layer(name: str) -> int:
    return int(name.rsplit(".", 1)[1])


def int8_cache_graph(graph: onnx.ModelProto, scales: CacheScales) -> onnx.ModelProto:
    """A copy of the step graph `graph` (`export.step_graph`, cross-attention over each row's own
    source) whose cache and cross keys/values are int8 with `scales`."""
    graph = onnx.ModelProto.FromString(graph.SerializeToString())
    body = graph.graph
    attention = [n for n in body.node if n.op_type == "GroupQueryAttention"]
    cross_nodes = [n for n in attention if n.input[3].startswith("cross_key.")]
    if not cross_nodes:
        raise ValueError("the step graph's cross-attention does not read the cross keys/values in place "
                         "(re-export it: export.step_graph)")
    before: dict[str, list[onnx.NodeProto]] = {}  # the nodes that go right before a cross-attention
    for node in attention:
        cross = node.input[3].startswith("cross_key.")
        layer = _layer(node.input[3])
        key_scale, value_scale = (scales.cross_attention if cross else scales.self_attention)[layer]
        kind = "cross" if cross else "self"
        names = (f"{kind}_key_scale.{layer}", f"{kind}_value_scale.{layer}")
        for name, value in zip(names, (key_scale, value_scale), strict=True):
            body.initializer.append(numpy_helper.from_array(np.array([value], dtype=np.float32), name))
        if cross:  # the row's last source position, read from the int8 buffer: dequantized first
            new_nodes = before.setdefault(node.name, [])
            for slot, scale_name in ((1, names[0]), (2, names[1])):
                quantized = node.input[slot]
                as_float = f"{quantized}_float"
                new_nodes += [helper.make_node("Cast", [quantized], [as_float], to=TensorProto.FLOAT,
                                               name=f"{node.name}_cast_{slot}"),
                              helper.make_node("Mul", [as_float, scale_name], [f"{quantized}_dequantized"],
                                               name=f"{node.name}_dequantize_{slot}")]
                node.input[slot] = f"{quantized}_dequantized"
        inputs = list(node.input) + [""] * (SCALE_INPUTS - len(node.input))
        del node.input[:]
        node.input.extend([*inputs[:SCALE_INPUTS], *names])
        for attribute, setting in QUANT_ATTRIBUTES.items():
            node.attribute.append(helper.make_attribute(attribute, setting))
    nodes = list(body.node)
    del body.node[:]
    for node in nodes:
        body.node.extend(before.get(node.name, []) if node.op_type == "GroupQueryAttention" else [])
        body.node.append(node)
    quantized = {f"{prefix}.{i}" for i in range(len(cross_nodes))
                 for prefix in ("past_key", "past_value", "cross_key", "cross_value",
                                "present_key", "present_value", "present_cross_key", "present_cross_value")}
    for value in [*body.input, *body.output]:
        if value.name in quantized:
            value.type.tensor_type.elem_type = TensorProto.INT8
    del body.value_info[:]  # intermediate types change (int8 reshapes and gathers): onnxruntime infers them
    cross_scales = [scale for pair in scales.cross_attention for scale in pair]
    helper.set_model_props(graph, {**{p.key: p.value for p in graph.metadata_props},
                                   graph_io.CROSS_SCALES: json.dumps(cross_scales)})
    last_source_inputs(graph)
    return graph


def last_source_inputs(graph: onnx.ModelProto) -> int:
    """Make the int8-cache step graph `graph` take each row's last source position and its cross
    keys/values there as inputs (`graph_io.SOURCE_LAST`, `graph_io.cross_last_names`), in place;
    returns 1 if it changed, 0 for a graph without an int8 cache or with these inputs already.

    Each cross-attention reads the row's source as its past and its last source position as its
    "new" key/value (`export.step_graph`); the graph worked that position out from `source_mask`
    and gathered and dequantized the key/value there from the int8 buffers at every step: 48 of
    the 128 kernels onnxruntime runs a step, for values that stay the same over a row's steps. As inputs they cost
    the step nothing (the caller works them out when rows join or move:
    `service.runtime.step_buffers.last_source_columns`, the same arithmetic); the nodes that only
    computed them go, and `source_mask` with them."""
    body = graph.graph
    inputs = {value.name: value for value in body.input}
    if not has_int8_cache(graph) or graph_io.SOURCE_LAST in inputs:
        return 0
    cross_nodes = [n for n in body.node if n.op_type == "GroupQueryAttention" and n.input[3].startswith("cross_key.")]
    if not cross_nodes:
        return 0
    dims = inputs["cross_key.0"].type.tensor_type.shape.dim  # (batch, heads, source_len, head_dim)
    width = dims[1].dim_value * dims[3].dim_value
    for node in cross_nodes:
        layer = _layer(node.input[3])
        node.input[1], node.input[2] = f"cross_last_key.{layer}", f"cross_last_value.{layer}"
        node.input[5] = graph_io.SOURCE_LAST  # seqlens_k: the past's length, the new position's index
    added = [helper.make_tensor_value_info(graph_io.SOURCE_LAST, TensorProto.INT32, [graph_io.BATCH])]
    added += [helper.make_tensor_value_info(name, TensorProto.FLOAT, [graph_io.BATCH, 1, width])
              for name in graph_io.cross_last_names(len(cross_nodes))]
    at = [value.name for value in body.input].index("positions") + 1
    for offset, value in enumerate(added):
        body.input.insert(at + offset, value)
    _prune(graph)
    return 1


def _prune(graph: onnx.ModelProto) -> None:
    """Remove the nodes none of the graph's outputs needs, then the inputs, initializers and
    value_info entries nothing reads any more (in place)."""
    body = graph.graph
    needed = {value.name for value in body.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(body.node):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(name for name in node.input if name)
    kept.reverse()
    del body.node[:]
    body.node.extend(kept)
    for field in (body.input, body.initializer, body.value_info):
        unused = [value for value in field if value.name not in needed]
        for value in unused:
            field.remove(value)


def has_int8_cache(graph: onnx.ModelProto) -> bool:
    """Whether the step graph's cache is int8 already."""
    types = {value.name: value.type.tensor_type.elem_type for value in graph.graph.input}
    return types.get("past_key.0") == TensorProto.INT8


def _decode(runtime: ModelRuntime, sources: list[list[int]], rows: int = 64, join: int = 16) -> list[list[int]]:
    """Greedy tokens of each source through one running batch, newcomers joining as slots free
    (as the server's batch takes them)."""
    from service.batching.slot_batch import generate_running

    results = dict(generate_running(runtime, list(enumerate(sources)), rows=rows, join_at=join))
    return [results[i].tokens for i in range(len(sources))]


def add_int8_cache(directory: str | Path, data_dir: str | Path, variant: str = "int8", calibration_rows: int = 500,
                   test_rows: int | None = None, max_drop: float = 0.1, threads: int = 0) -> dict[str, Any] | None:
    """Give the step graphs of `variant` in the repository `directory` (its `step_decoder` and its
    shortlist's) an int8 cache (`int8_cache_graph`), in place, with scales calibrated on the
    first `calibration_rows` sentences of `data_dir`'s valid split; decode the first `test_rows`
    test sentences (all by default) in a running batch before and after and record both scores,
    the share of sentences whose tokens changed and the scales in the manifest
    (`exporter.int8_cache`). Refused, the repository left as it was (`restored_on_failure`), when
    a metric of the task (`export.quality.METRICS`) drops more than `max_drop`. Returns the
    record, or None when the graphs have an int8 cache already."""
    from export.quality import METRICS
    from export.repository import restored_on_failure
    from model.evaluation import rouge_scores, translation_scores
    from model.run_config import read_split
    from service.repository.manifest import (
        read_manifest,
        verify_files,
        write_manifest,
    )

    directory, data_dir = Path(directory), Path(data_dir)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    if variant not in manifest.variants or not manifest.variants[variant].step_decoder:
        raise ValueError(f"{directory}: no {variant} variant with a step graph")
    entry = manifest.variants[variant]
    files = [entry.step_decoder, *([entry.shortlist["step_decoder"]] if entry.shortlist else [])]
    graphs = {name: onnx.load_model(str(directory / name), load_external_data=False) for name in files}
    if all(has_int8_cache(graph) for graph in graphs.values()):
        return None
    before = ModelRuntime.load(directory, [CPU], threads=threads, variant=variant, step_graph=True)
    keep = before.max_source_len - 1
    valid, _ = read_split(data_dir, "valid")
    calibration = [ids[:keep] + [before.eos_id] for ids in before.tokenizer.encode_batch(valid[:calibration_rows])]
    scales = calibrate(before, calibration)
    texts, references = read_split(data_dir, "test")
    sources = [ids[:keep] + [before.eos_id] for ids in before.tokenizer.encode_batch(texts[:test_rows])]
    expected = _decode(before, sources)
    with restored_on_failure(directory, files):
        for name, graph in graphs.items():
            onnx.save_model(int8_cache_graph(graph, scales), str(directory / name))
        write_manifest(directory, manifest)
        after = ModelRuntime.load(directory, [CPU], threads=threads, variant=variant, step_graph=True)
        actual = _decode(after, sources)
        decode = before.tokenizer.decode
        score = translation_scores if manifest.task == "translate" else rouge_scores
        quality = {label: score([decode(t) for t in tokens], references[:len(sources)])
                   for label, tokens in (("float_cache", expected), ("int8_cache", actual))}
        for metric in METRICS[manifest.task]:
            if quality["float_cache"][metric] - quality["int8_cache"][metric] > max_drop:
                raise QualityDrop(f"{metric} {quality['float_cache'][metric]} -> {quality['int8_cache'][metric]} "
                                  f"with the int8 cache (more than {max_drop} points)")
        record = {"variant": variant, "graphs": files, "scales": scales.to_dict(),
                  "calibration": f"valid split, first {len(calibration)} rows",
                  "quality": {"split": "test", "rows": len(sources), "decoding": "greedy, one running batch of 64 rows",
                              **quality, "rows_with_other_tokens": sum(a != b for a, b in zip(expected, actual, strict=True))}}
        manifest.exporter["int8_cache"] = record
        write_manifest(directory, manifest)
        verify_files(directory, read_manifest(directory))
    return record


class QualityDrop(RuntimeError):
    """The int8 cache costs more quality than allowed."""
