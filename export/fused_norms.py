"""Each residual Add and the LayerNormalization after it as one `SkipLayerNormalization`.

A pre-norm Transformer layer adds each sublayer's output to the residual stream and normalizes
the sum before the next sublayer: an `Add` whose output a `LayerNormalization` over the last
axis reads. onnxruntime's contrib operator `SkipLayerNormalization` (input, skip, gamma, beta)
computes both in one kernel and gives the sum as its fourth output where the residual stream
goes on. onnxruntime's own fusion of this pair needs every shape known to its shape inference,
which does not follow our step graphs, so `fuse_skip_layer_norms` matches the pair on the graph's
structure alone. The kernel normalizes the sum it computes in its own order, so its outputs are
not the same to the last bit: a repository takes this pass only when asked (`update-step-graphs
--fuse-layer-norms`), checked within a tolerance.
"""

from __future__ import annotations

import onnx
from onnx import helper

MS_DOMAIN = "com.microsoft"


def fuse_skip_layer_norms(graph: onnx.ModelProto) -> int:
    """Fuse, in place, each LayerNormalization over the last axis of an Add's sum with that Add
    into one `SkipLayerNormalization` (the epsilon kept), its fourth output the sum where other
    nodes read it or the graph gives it out. A pair is left alone where the norm's mean or
    deviation is read, or a reader of the sum runs between the two. Returns the pairs fused."""
    body = graph.graph
    nodes = list(body.node)
    position = {id(node): i for i, node in enumerate(nodes)}
    producers = {name: node for node in nodes for name in node.output}
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(i)
    outputs = {value.name for value in body.output}
    replaced: dict[int, onnx.NodeProto | None] = {}
    for i, norm in enumerate(nodes):
        attributes = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        if norm.op_type != "LayerNormalization" or attributes.get("axis", -1) != -1 or len(norm.input) < 2:
            continue
        add = producers.get(norm.input[0])
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or position[id(add)] in replaced:
            continue
        if any(name and (readers.get(name) or name in outputs) for name in norm.output[1:]):
            continue
        total = add.output[0]
        later = [r for r in readers.get(total, []) if r != i]
        if any(position[id(add)] < r < i for r in later):
            continue
        replaced[position[id(add)]] = None
        beta = norm.input[2] if len(norm.input) > 2 else ""
        replaced[i] = helper.make_node(
            "SkipLayerNormalization", [add.input[0], add.input[1], norm.input[1], beta],
            [norm.output[0], "", "", total if later or total in outputs else ""], name=f"{norm.name}_skip",
            domain=MS_DOMAIN, epsilon=float(attributes.get("epsilon", 1e-5)))
    if not replaced:
        return 0
    kept = [replaced.get(i, node) for i, node in enumerate(nodes)]
    del body.node[:]
    body.node.extend(node for node in kept if node is not None)
    if not any(opset.domain == MS_DOMAIN for opset in graph.opset_import):
        graph.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return sum(node is not None for node in replaced.values())
