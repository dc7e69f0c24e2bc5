"""A self-attention's query, key and value as one int8 product, packed into its kernel.

`onnxruntime.quantization.quantize_dynamic` quantizes each `MatMul` on its own: an activation
read by several projections is quantized once (`DynamicQuantizeLinear`) and multiplied by each
weight in a `MatMulInteger` of its own, whose int32 result is cast, scaled by the activation's
scale times the weight's per-column scales and given its bias (onnxruntime fuses each such
chain into one `MatMulIntegerToFloat` kernel at load). Where the three are exactly the query,
key and value of a `GroupQueryAttention` (the step graph's self-attention), `fuse_shared_projections`
concatenates their weights along the columns (and their zero points, scales and biases alike)
into one chain, which the kernel takes packed (its `query` input holding all three, `key` and
`value` empty): one kernel call where there were three, each output column computed from the
same int8 values and scales as before, so the outputs are the same to the last bit.

The float step graphs (fp32, and fp16 for CUDA) multiply each projection with a `MatMul` of a
weight cast from the repository's bfloat16 initializer, then add its bias. `fuse_float_projections`
packs a self-attention's three the same way, in the graph alone: the weights and the biases are
concatenated by `Concat` nodes over the casts, which onnxruntime folds into one constant when it
loads the graph, so the repository's weights stay as they are. Each output column is the same
dot product as before; whether a kernel's result is the same to the last bit at a wider product
is the kernel's (the tests hold it to the CPU's).

Where the projections' outputs go on as separate tensors (the encoder's query, key and value,
its cross keys/values of every decoder layer), one product followed by a `Split` copying them
apart was slower on the CPU (bench/README.md, "A self-attention's query, key and value as one
product"), so those groups stay as they are.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclass(frozen=True)
class _Projection:
    """One `MatMulInteger` chain reading a shared quantized activation: its nodes, its weight's
    int8 values, zero points and scales, its bias (None without one) and the name of its float
    output."""

    nodes: tuple[onnx.NodeProto, ...]
    weight: np.ndarray  # (in, out) int8
    zero_point: np.ndarray  # (out,) int8
    scale: np.ndarray  # (out,) float32
    bias: np.ndarray | None  # (out,) float32
    output: str


def _chain(mm: onnx.NodeProto, scale_of: str, consumers: dict[str, list[onnx.NodeProto]],
           producer: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray]) -> _Projection | None:
    """The chain `MatMulInteger -> Cast -> Mul(scale) [-> Add(bias)]` starting at `mm`, or None
    where it is not that shape (an input not constant, an intermediate read elsewhere)."""
    if len(mm.input) != 4 or mm.input[1] not in constants or mm.input[3] not in constants:
        return None
    weight, zero_point = constants[mm.input[1]], constants[mm.input[3]]
    if weight.ndim != 2 or zero_point.shape != (weight.shape[1],):
        return None
    after = consumers.get(mm.output[0], [])
    if len(after) != 1 or after[0].op_type != "Cast":
        return None
    cast = after[0]
    after = consumers.get(cast.output[0], [])
    if len(after) != 1 or after[0].op_type != "Mul":
        return None
    mul = after[0]
    factor = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
    scales = producer.get(factor)  # Mul(activation scale, weight scale)
    if scales is None or scales.op_type != "Mul" or len(consumers.get(factor, [])) != 1:
        return None
    weight_scale = [name for name in scales.input if name != scale_of]
    if len(weight_scale) != 1 or weight_scale[0] not in constants:
        return None
    scale = constants[weight_scale[0]].astype(np.float32).reshape(-1)
    if scale.shape != (weight.shape[1],):
        return None
    nodes = [mm, cast, scales, mul]
    output, bias = mul.output[0], None
    after = consumers.get(mul.output[0], [])
    if len(after) == 1 and after[0].op_type == "Add":
        add = after[0]
        other = add.input[1] if add.input[0] == mul.output[0] else add.input[0]
        if other in constants and constants[other].shape == (weight.shape[1],):
            nodes.append(add)
            output, bias = add.output[0], constants[other].astype(np.float32)
    return _Projection(tuple(nodes), weight, zero_point, scale, bias, output)


def fuse_shared_projections(graph: onnx.ModelProto, split: bool = False) -> int:
    """Fuse, in place, the query, key and value projections of each `GroupQueryAttention` that
    reads them from one quantized activation into one product it takes packed (module doc);
    with `split`, also every other group of two or more projections of one activation, their
    outputs split apart after it (the variant `bench.step_variants` measures). Returns the number
    of groups fused."""
    body = graph.graph
    constants = {t.name: numpy_helper.to_array(t) for t in body.initializer}
    consumers, producer = _edges(body)
    graph_outputs = {o.name for o in body.output}
    fused = 0
    for quantize in [n for n in body.node if n.op_type == "DynamicQuantizeLinear"]:
        quantized, scale_of, zero_of = quantize.output
        group = [n for n in consumers[quantized] if n.op_type == "MatMulInteger" and n.input[2] == zero_of]
        chains = [_chain(mm, scale_of, consumers, producer, constants) for mm in group]
        projections = [c for c in chains if c is not None]
        if len(projections) < 2 or len({p.bias is None for p in projections}) != 1:
            continue
        attention = _packed_attention(projections, consumers, graph_outputs)
        if attention is not None:
            projections.sort(key=lambda p: list(attention.input[:3]).index(p.output))  # query, key, value
        elif not split:
            continue
        stem = f"{quantize.name}_fused"
        tensors = {
            f"{stem}_weight": np.concatenate([p.weight for p in projections], axis=1),
            f"{stem}_zero_point": np.concatenate([p.zero_point for p in projections]),
            f"{stem}_weight_scale": np.concatenate([p.scale for p in projections]),
        }
        if projections[0].bias is not None:
            tensors[f"{stem}_bias"] = np.concatenate([p.bias for p in projections if p.bias is not None])
        body.initializer.extend(numpy_helper.from_array(v, k) for k, v in tensors.items())
        packed = f"{stem}_output"
        nodes = [
            helper.make_node("MatMulInteger", [quantized, f"{stem}_weight", zero_of, f"{stem}_zero_point"],
                             [f"{stem}_int32"], name=f"{stem}_matmul"),
            helper.make_node("Cast", [f"{stem}_int32"], [f"{stem}_float"], name=f"{stem}_cast",
                             to=onnx.TensorProto.FLOAT),
            helper.make_node("Mul", [scale_of, f"{stem}_weight_scale"], [f"{stem}_scales"], name=f"{stem}_scales_mul"),
            helper.make_node("Mul", [f"{stem}_float", f"{stem}_scales"],
                             [packed if projections[0].bias is None else f"{stem}_scaled"], name=f"{stem}_scale_mul"),
        ]
        if projections[0].bias is not None:
            nodes.append(helper.make_node("Add", [f"{stem}_scaled", f"{stem}_bias"], [packed], name=f"{stem}_bias_add"))
        if attention is not None:
            attention.input[0], attention.input[1], attention.input[2] = packed, "", ""
        else:
            widths = np.asarray([p.weight.shape[1] for p in projections], dtype=np.int64)
            body.initializer.append(numpy_helper.from_array(widths, f"{stem}_widths"))
            nodes.append(helper.make_node("Split", [packed, f"{stem}_widths"], [p.output for p in projections],
                                          name=f"{stem}_split", axis=-1))
        _replace_nodes(body, [node for p in projections for node in p.nodes], nodes)
        fused += 1
    if fused:
        _sort_topologically(body)
        _drop_unused_initializers(graph)
    return fused


def fuse_float_projections(graph: onnx.ModelProto) -> int:
    """Pack, in place, the query, key and value of each `GroupQueryAttention` that reads them from
    three float products of one activation (`MatMul(x, W)`, each perhaps followed by `Add(b)`,
    the weights and biases constant: initializers or casts of initializers) into one product that
    the kernel takes packed (module doc). Returns the number of self-attentions packed."""
    body = graph.graph
    consumers, producer = _edges(body)
    shapes = {t.name: tuple(t.dims) for t in body.initializer}
    graph_outputs = {o.name for o in body.output}
    fused = 0
    for attention in [n for n in body.node if n.op_type == "GroupQueryAttention"]:
        names = list(attention.input[:3])
        if "" in names or any(n in graph_outputs or len(consumers[n]) != 1 for n in names):
            continue
        products = [_float_product(name, consumers, producer, shapes) for name in names]
        if any(p is None for p in products):
            continue
        chains = [p for p in products if p is not None]
        if len({c.activation for c in chains}) != 1 or len({c.bias is None for c in chains}) != 1:
            continue
        if chains[1].width != chains[2].width:
            continue
        stem = f"{attention.name or names[0]}_packed"
        packed = f"{stem}_output"
        nodes = [
            helper.make_node("Concat", [c.weight for c in chains], [f"{stem}_weight"], name=f"{stem}_weight_concat",
                             axis=1),
            helper.make_node("MatMul", [chains[0].activation, f"{stem}_weight"],
                             [packed if chains[0].bias is None else f"{stem}_product"], name=f"{stem}_matmul"),
        ]
        if chains[0].bias is not None:
            nodes += [
                helper.make_node("Concat", [c.bias for c in chains if c.bias is not None], [f"{stem}_bias"],
                                 name=f"{stem}_bias_concat", axis=0),
                helper.make_node("Add", [f"{stem}_product", f"{stem}_bias"], [packed], name=f"{stem}_bias_add"),
            ]
        attention.input[0], attention.input[1], attention.input[2] = packed, "", ""
        _replace_nodes(body, [node for chain in chains for node in chain.nodes], nodes)
        fused += 1
    if fused:
        _sort_topologically(body)
    return fused


@dataclass(frozen=True)
class _FloatProduct:
    """One float projection `MatMul(activation, weight) [-> Add(bias)]`: its nodes, the names of
    its activation, weight and bias (None without one) and its output width."""

    nodes: tuple[onnx.NodeProto, ...]
    activation: str
    weight: str
    bias: str | None
    width: int


def _float_product(output: str, consumers: dict[str, list[onnx.NodeProto]], producer: dict[str, onnx.NodeProto],
                   shapes: dict[str, tuple[int, ...]]) -> _FloatProduct | None:
    """The float projection whose result is `output`, or None where it is not that shape (a
    weight or bias not constant, an intermediate read elsewhere, a weight not 2-D)."""
    node = producer.get(output)
    nodes: list[onnx.NodeProto] = []
    bias = None
    if node is not None and node.op_type == "Add":
        operands = list(node.input)
        products = [name for name in operands if (p := producer.get(name)) is not None and p.op_type == "MatMul"]
        if len(products) != 1 or len(consumers[products[0]]) != 1:
            return None
        bias = operands[1 - operands.index(products[0])]
        if _constant_shape(bias, producer, shapes) is None:
            return None
        nodes.append(node)
        node = producer[products[0]]
    if node is None or node.op_type != "MatMul":
        return None
    weight_shape = _constant_shape(node.input[1], producer, shapes)
    if weight_shape is None or len(weight_shape) != 2:
        return None
    if bias is not None and _constant_shape(bias, producer, shapes) != (weight_shape[1],):
        return None
    nodes.append(node)
    return _FloatProduct(tuple(nodes), node.input[0], node.input[1], bias, weight_shape[1])


def _constant_shape(name: str, producer: dict[str, onnx.NodeProto],
                    shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape of `name` where it is an initializer or a `Cast` of one, else None."""
    node = producer.get(name)
    if node is not None and node.op_type == "Cast" and len(node.input) == 1:
        name = node.input[0]
    elif node is not None:
        return None
    return shapes.get(name)


def _edges(body: onnx.GraphProto) -> tuple[dict[str, list[onnx.NodeProto]], dict[str, onnx.NodeProto]]:
    """The nodes reading each value of `body` and the node writing each."""
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    producer: dict[str, onnx.NodeProto] = {}
    for node in body.node:
        for name in node.input:
            consumers[name].append(node)
        for name in node.output:
            producer[name] = node
    return consumers, producer


def _replace_nodes(body: onnx.GraphProto, old: list[onnx.NodeProto], new: list[onnx.NodeProto]) -> None:
    """Take `old` out of the graph and append `new` (the caller sorts the graph afterwards)."""
    for node in old:
        body.node.remove(node)
    body.node.extend(new)


def _sort_topologically(body: onnx.GraphProto) -> None:
    """Order `body`'s nodes so that each comes after the producers of its inputs, moving a node
    only when it comes before one of them (in place)."""
    available = {value.name for value in body.input} | {t.name for t in body.initializer} | {""}
    pending = list(body.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        waiting = []
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            raise ValueError("the graph has a cycle or reads a value nothing produces")
        pending = waiting
    del body.node[:]
    body.node.extend(ordered)


def _packed_attention(projections: list[_Projection], consumers: dict[str, list[onnx.NodeProto]],
                      graph_outputs: set[str]) -> onnx.NodeProto | None:
    """The `GroupQueryAttention` whose query, key and value are exactly the outputs of
    `projections` (read by nothing else), with a key and value as wide as each other: it can take
    them packed."""
    names = [p.output for p in projections]
    if len(names) != 3 or any(n in graph_outputs for n in names):
        return None
    readers = [consumers.get(n, []) for n in names]
    if any(len(r) != 1 for r in readers) or len({id(r[0]) for r in readers}) != 1:
        return None
    node = readers[0][0]
    if node.op_type != "GroupQueryAttention" or sorted(node.input[:3]) != sorted(names):
        return None
    width = {p.output: p.weight.shape[1] for p in projections}
    if width[node.input[1]] != width[node.input[2]]:
        return None
    return node


def _drop_unused_initializers(graph: onnx.ModelProto) -> None:
    """Remove the initializers no node and no output reads (the weights a fusion replaced)."""
    body = graph.graph
    read = {name for node in body.node for name in node.input} | {o.name for o in body.output}
    unused = [t for t in body.initializer if t.name not in read]
    for tensor in unused:
        body.initializer.remove(tensor)
