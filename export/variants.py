"""Reduced-precision variants of the fp32 graphs.

- fp16: for the CUDA execution provider. onnxruntime's own converter (bundled with the
  onnxruntime wheel, so no onnxconverter-common dependency) with `keep_io_types=True`: graph
  inputs and outputs stay float32, so callers feed and read the same arrays as with fp32.
  The step graph (`export.step_graph`) is the exception (`convert_step`): its caches and cross
  keys/values are float16 in its inputs and outputs too. They are its slot buffers, past and
  present bound to one buffer and written in place, and onnxruntime's CUDA GroupQueryAttention
  takes float16 caches only; a float32 cache would be cast to a float16 copy at every step and
  could not be written in place. Its logits stay float32, as every graph's do.
- int8: for CPU. onnxruntime dynamic quantization: int8 weights (per output channel) for
  MatMul and Gather, activations quantized on the fly; inputs and outputs stay float32.
  A MatMul whose weight is a transposed initializer (the output projection tied to the
  embedding) first gets its own pre-transposed copy: the quantizer only turns a MatMul with
  an initializer weight into an integer MatMul, and would otherwise leave the largest MatMul
  of a decoder step in float32. The projections of one activation (a self-attention's query,
  key and value; the cross keys/values of every decoder layer) then become one integer MatMul
  (`export.fused_projections`), with the same outputs.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import numpy_helper

from export.fused_projections import fuse_shared_projections

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "int8", "fp16")
# The float graph inputs/outputs the step graph's fp16 form keeps in float32 (`convert_step`).
STEP_FLOAT32_IO = ("logits",)


def to_fp16(graph: onnx.ModelProto, keep_io_types: bool | Sequence[str] = True) -> onnx.ModelProto:
    """fp16 weights and arithmetic; float32 graph inputs and outputs (`keep_io_types` True), or
    only those named in `keep_io_types` (the other float ones become float16)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    copy = onnx.ModelProto()
    copy.CopyFrom(graph)
    keep = keep_io_types if isinstance(keep_io_types, bool) else list(keep_io_types)
    converted: onnx.ModelProto = convert_float_to_float16(copy, keep_io_types=keep)
    _sort_nodes(converted.graph)  # the converter appends the input Casts after their users
    return converted


def _sort_nodes(graph: onnx.GraphProto) -> None:
    """Order the nodes topologically (stable: a node keeps its place when it can)."""
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in known for i in n.input)]
        if not ready:
            raise ValueError(f"graph has a cycle or an undefined input near node {pending[0].name!r}")
        for node in ready:
            known.update(node.output)
        ordered.extend(ready)
        taken = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in taken]
    del graph.node[:]
    graph.node.extend(ordered)


def untie_transposed_weights(graph: onnx.ModelProto) -> onnx.ModelProto:
    """A copy in which every MatMul fed by `Transpose(initializer)` reads its own transposed
    initializer instead; a Transpose left without readers is removed."""
    copy = onnx.ModelProto()
    copy.CopyFrom(graph)
    body = copy.graph
    initializers = {t.name: t for t in body.initializer}
    producers = {out: node for node in body.node for out in node.output}
    untied: dict[str, str] = {}  # Transpose output -> name of its transposed initializer
    for node in body.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        weight = numpy_helper.to_array(initializers[transpose.input[0]])  # (out, in)
        if weight.ndim != 2 or perm not in (None, [1, 0]):
            continue
        if node.input[1] not in untied:
            name = f"{transpose.input[0]}.transposed"
            body.initializer.append(numpy_helper.from_array(weight.T.copy(), name))  # (in, out)
            untied[node.input[1]] = name
        node.input[1] = untied[node.input[1]]
    read = {name for node in body.node for name in node.input} | {o.name for o in body.output}
    unused = [n for n in body.node if n.op_type == "Transpose" and n.output[0] in untied and n.output[0] not in read]
    for node in unused:
        body.node.remove(node)
    return copy


def to_int8(graph: onnx.ModelProto) -> onnx.ModelProto:
    """Dynamically quantized: int8 weights per channel, uint8 activations computed per call; the
    projections of one activation as one product (`fuse_shared_projections`)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = untie_transposed_weights(graph)
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "int8.onnx"
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # quantize_dynamic warns on the root logger about pre-processing
        try:
            quantize_dynamic(graph, output, weight_type=QuantType.QInt8, per_channel=True)
        finally:
            root.setLevel(level)
        quantized = onnx.load_model(str(output), load_external_data=True)
    fuse_shared_projections(quantized)
    return quantized


def convert(graph: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    if precision == "fp32":
        return graph
    if precision == "fp16":
        return to_fp16(graph)
    if precision == "int8":
        return to_int8(graph)
    raise ValueError(f"unknown precision {precision!r} (one of {PRECISIONS})")


def convert_step(graph: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The step graph in `precision`: as `convert`, but fp16 with float16 caches and cross
    keys/values in its inputs and outputs (only `STEP_FLOAT32_IO` stays float32)."""
    if precision == "fp16":
        return to_fp16(graph, keep_io_types=STEP_FLOAT32_IO)
    return convert(graph, precision)
