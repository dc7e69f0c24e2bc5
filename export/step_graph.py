"""The decoder step for continuous batching: each row attends over its own cache length.

The merged decoder (`export.onnx_export.DecoderGraph`) takes a (B, h, P, d) cache that every
row shares in length: a running batch pads each newcomer's cache to its oldest row's, masks
the padding, and the graph's `Concat` copies the whole cache at every step (`bench.decoder_profile`
measures its share of a step).

This graph keeps each row's keys/values in a fixed buffer (B, h, capacity, d): row b's own
positions sit in columns 0..positions[b]-1, and its new key/value goes to column
positions[b]. Self-attention is onnxruntime's `com.microsoft.GroupQueryAttention` (with as many
key/value heads as query heads: plain multi-head attention), which reads each row's own length
from `seqlens_k` and, when `present_*` is bound to the same buffer as `past_*` (IO binding),
writes the new column in place: no copy of the cache, no padding to the oldest row.
Cross-attention is the same kernel over each row's own source (`own_length_cross_attention`):
the cross keys/values are its past, `seqlens_k` the row's source length - 1 (from
`source_mask`, whose valid columns are a prefix), and the row's last source position its "new"
key/value, written where it already is; so a row reads its own source and none of the batch's
padding, which the masked products read in full (`bench.cross_attention`). The cross
keys/values are therefore outputs too, bound to their input buffers (`present_cross_*`).

    inputs   input_ids, positions (batch, 1) int64 (a row's position = its cached length);
             source_mask (batch, source_len) bool; past_key.{i}, past_value.{i}
             (batch, heads, capacity, head_dim); cross_key.{i}, cross_value.{i}
    outputs  logits (batch, vocab); present_key.{i}, present_value.{i} (the buffers, updated);
             present_cross_key.{i}, present_cross_value.{i} (the cross buffers, unchanged)

Graphs exported before the cross presents existed have the masked products instead and are
run as before (`service.runtime.step_buffers.run_step` binds what the graph has).

The PyTorch side is two custom operators (`attnserve::cached_self_attention`,
`attnserve::own_length_cross_attention`) whose reference implementations compute the same
thing, so the wrapper traces like the other graphs and the exporter translates those operators
to the onnxruntime kernel. It runs on onnxruntime only
(the kernel is a contrib operator); no attention weights come out of it (maps use the merged
decoder).
"""

from __future__ import annotations

from typing import Any

import onnx
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset
from torch import Tensor, nn

from model.multi_head_attention import MultiHeadAttention, scaled_dot_product_attention
from model.transformer import DecoderLayer, Transformer
from service.repository import graph_io

STEP_DECODER_FILE = "decoder_step.onnx"

_MICROSOFT = Opset("com.microsoft", 1)
_Param = OpSchema.FormalParameter
# The onnx package carries no schemas of onnxruntime's contrib operators; the exporter needs
# one to build the node (only the inputs, outputs and attributes used here).
_GQA_SCHEMA = OpSchema(
    "GroupQueryAttention", "com.microsoft", 1,
    inputs=[_Param("query", "T"), _Param("key", "T"), _Param("value", "T"), _Param("past_key", "T"),
            _Param("past_value", "T"), _Param("seqlens_k", "M"), _Param("total_sequence_length", "M")],
    outputs=[_Param("output", "T"), _Param("present_key", "T"), _Param("present_value", "T")],
    type_constraints=[("T", ["tensor(float)"], ""), ("M", ["tensor(int32)"], "")],
    attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, "")],
)
_GROUP_QUERY_ATTENTION = Op(_MICROSOFT, "GroupQueryAttention", _GQA_SCHEMA)


@torch.library.custom_op("attnserve::cached_self_attention", mutates_args=())
def cached_self_attention(query: Tensor, key: Tensor, value: Tensor, past_key: Tensor, past_value: Tensor,
                          lengths: Tensor, n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """query/key/value (B, 1, D) of each row's new position; past keys/values (B, h, C, d) with
    row b's positions in columns 0..lengths[b]-1. Returns the output (B, 1, D) and the buffers
    with the new key/value in column lengths[b] (B, h, C, d)."""
    batch, _, width = query.shape
    head_dim = width // n_heads
    rows = torch.arange(batch, device=query.device)
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[rows, :, lengths] = key.view(batch, n_heads, head_dim)
    present_value[rows, :, lengths] = value.view(batch, n_heads, head_dim)
    own = torch.arange(past_key.size(2), device=query.device)[None, :] <= lengths[:, None]  # (B, C)
    heads = query.view(batch, 1, n_heads, head_dim).transpose(1, 2)  # (B, h, 1, d)
    context, _ = scaled_dot_product_attention(heads, present_key, present_value, own[:, None, None, :])
    return context.transpose(1, 2).reshape(batch, 1, width), present_key, present_value


@cached_self_attention.register_fake
def _cached_self_attention_shapes(query: Tensor, key: Tensor, value: Tensor, past_key: Tensor,
                                  past_value: Tensor, lengths: Tensor, n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


def _cached_self_attention_onnx(query, key, value, past_key, past_value, lengths, n_heads: int):  # type: ignore[no-untyped-def]
    """The operator as onnxruntime's GroupQueryAttention: seqlens_k is each row's past length,
    total_sequence_length the cache's capacity. The kernel reads the total on the host and each
    row's span from seqlens_k; a total taken from a shape is computed on the host, whereas one
    reduced from `positions` is computed on the device and copied, and onnxruntime's CUDA kernel
    then read a wrong total (`python -m bench.step_graph_parity`)."""
    seqlens = op.Cast(lengths, to=onnx.TensorProto.INT32)
    total = op.Cast(op.Squeeze(op.Slice(op.Shape(past_key), _ints(2), _ints(3))), to=onnx.TensorProto.INT32)
    return _GROUP_QUERY_ATTENTION(query, key, value, past_key, past_value, seqlens, total,
                                  num_heads=n_heads, kv_num_heads=n_heads, _num_outputs=3)


@torch.library.custom_op("attnserve::own_length_cross_attention", mutates_args=())
def own_length_cross_attention(query: Tensor, cross_key: Tensor, cross_value: Tensor, lengths: Tensor,
                               n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """query (B, 1, D) of each row's new position; cross keys/values (B, h, S, d) with row b's
    source in columns 0..lengths[b]-1. Returns the output (B, 1, D) and the cross keys/values
    unchanged (the graph's in-place outputs)."""
    batch, _, width = query.shape
    head_dim = width // n_heads
    own = torch.arange(cross_key.size(2), device=query.device)[None, :] < lengths[:, None]  # (B, S)
    heads = query.view(batch, 1, n_heads, head_dim).transpose(1, 2)  # (B, h, 1, d)
    context, _ = scaled_dot_product_attention(heads, cross_key, cross_value, own[:, None, None, :])
    return context.transpose(1, 2).reshape(batch, 1, width), cross_key.clone(), cross_value.clone()


@own_length_cross_attention.register_fake
def _own_length_cross_attention_shapes(query: Tensor, cross_key: Tensor, cross_value: Tensor, lengths: Tensor,
                                       n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(query), torch.empty_like(cross_key), torch.empty_like(cross_value)


def _ints(*values: int) -> Any:
    """An int64 constant tensor of `values` (typed loosely: onnxscript's constant type is a union)."""
    return op.Constant(value_ints=list(values))


def _own_length_cross_attention_onnx(query, cross_key, cross_value, lengths, n_heads: int):  # type: ignore[no-untyped-def]
    """The operator as onnxruntime's GroupQueryAttention over each row's own source: the cross
    keys/values are the past, `seqlens_k` each row's length - 1, and the "new" key/value the
    row's own last source position, which the kernel writes where it already is (present bound
    to the past's buffer): it attends over exactly columns 0..lengths[b]-1 and reads no padding."""
    last = op.Sub(lengths, op.Constant(value_int=1))  # (B,)
    shape: Any = op.Shape(cross_key)  # (B, h, S, d)
    rows_heads = op.Slice(shape, _ints(0), _ints(2))  # [B, h]
    width = op.Slice(shape, _ints(2), _ints(3))  # [S]
    # row b's head k, column last[b] of the cache seen as (B*h*S, d): (b*h + k)*S + last[b]
    starts = op.Mul(op.Range(op.Constant(value_int=0), op.ReduceProd(rows_heads, keepdims=0),
                             op.Constant(value_int=1)), width)  # (B*h,)
    index = op.Add(starts, op.Reshape(op.Expand(op.Reshape(last, _ints(-1, 1)), rows_heads), _ints(-1)))
    flat = op.Concat(_ints(-1), op.Slice(shape, _ints(3), _ints(4)), axis=0)  # [-1, d]

    def last_column(cache):  # type: ignore[no-untyped-def]
        column = op.Gather(op.Reshape(cache, flat), index, axis=0)  # (B*h, d): b-major, then heads
        return op.Reshape(column, op.Shape(query))  # (B, 1, D)

    seqlens = op.Cast(last, to=onnx.TensorProto.INT32)
    total = op.Cast(op.Squeeze(op.Slice(shape, _ints(2), _ints(3))), to=onnx.TensorProto.INT32)
    return _GROUP_QUERY_ATTENTION(query, last_column(cross_key), last_column(cross_value), cross_key, cross_value,
                                  seqlens, total, num_heads=n_heads, kv_num_heads=n_heads, _num_outputs=3)


TRANSLATIONS = {torch.ops.attnserve.cached_self_attention.default: _cached_self_attention_onnx,
                torch.ops.attnserve.own_length_cross_attention.default: _own_length_cross_attention_onnx}


class StepGraph(nn.Module):
    """One decoder step per row over its own cache (see the module's docstring)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: Tensor,  # (B, 1)
        positions: Tensor,  # (B, 1): each row's cached length
        source_mask: Tensor,  # (B, S) bool
        past: tuple[Tensor, ...],  # past_key.0, past_value.0, ...: (B, h, C, d)
        cross: tuple[Tensor, ...],  # cross_key.0, cross_value.0, ...: (B, h, S, d)
    ) -> tuple[Tensor, ...]:
        model = self.model
        x = model.target_embedding(input_ids, positions)  # (B, 1, D)
        lengths = positions[:, 0]  # (B,)
        # (B,): a row's source is a prefix of its columns; at least one (a row without a source, which
        # the service never steps, reads column 0 instead of an undefined position)
        source_lengths = source_mask.sum(dim=1).clamp(min=1)
        presents: list[Tensor] = []
        cross_presents: list[Tensor] = []
        for i, layer in enumerate(model.decoder_layers):
            assert isinstance(layer, DecoderLayer)
            attention = layer.self_attention
            h = layer.self_sublayer.input(x)
            context, key, value = torch.ops.attnserve.cached_self_attention(
                attention.query(h), attention.key(h), attention.value(h), past[2 * i], past[2 * i + 1],
                lengths, attention.n_heads)
            x = layer.self_sublayer.output(x, attention.output(context))
            source = layer.cross_attention

            def attend_own_source(h: Tensor, i: int = i, source: MultiHeadAttention = source) -> tuple[Tensor, None]:
                context, cross_key, cross_value = torch.ops.attnserve.own_length_cross_attention(
                    source.query(h), cross[2 * i], cross[2 * i + 1], source_lengths, source.n_heads)
                cross_presents.extend((cross_key, cross_value))
                return source.output(context), None

            x, _ = layer.around_source_attention(x, attend_own_source)
            presents += [key, value]
        logits = model.output_projection(model.decoder_norm(x))[:, 0]  # (B, V)
        return (logits, *presents, *cross_presents)


def example_step_inputs(model: Transformer) -> tuple[Tensor | tuple[Tensor, ...], ...]:
    """Every dynamic size >= 2 and all different (batch 3, source 7, capacity 5)."""
    config = model.config
    batch, source, capacity = 3, 7, 5
    heads, head_dim, layers = config.n_heads, config.head_dim, config.n_decoder_layers
    return (
        torch.randint(4, config.vocab_size, (batch, 1)),
        torch.tensor([[0], [2], [4]]),
        torch.ones(batch, source, dtype=torch.bool),
        tuple(torch.randn(batch, heads, capacity, head_dim) for _ in range(2 * layers)),
        tuple(torch.randn(batch, heads, source, head_dim) for _ in range(2 * layers)),
    )


def _declared_shape(value: onnx.ValueInfoProto) -> tuple[str | int, ...] | None:
    """A graph input's declared dimensions (names or sizes), or None if one is undeclared."""
    dims = value.type.tensor_type.shape.dim
    shape = tuple(d.dim_param if d.HasField("dim_param") else d.dim_value for d in dims)
    return shape if all(d.HasField("dim_param") or d.HasField("dim_value") for d in dims) else None


def share_input_shapes(graph: onnx.ModelProto) -> int:
    """Make every `Shape` of a graph input read the first input declared with the same
    dimensions (in place); returns the nodes rewired.

    Each layer derives its attention's total and its cross-attention's gather indices from the
    shape of its own cache or cross keys/values, which the graph declares with the same named
    dimensions in every layer (`graph_io`) and the runtime allocates together. Read from one
    input, those computations become identical, and onnxruntime's common-subexpression
    elimination runs them once per step instead of once per layer (fewer kernels per step,
    the same results)."""
    first: dict[tuple[str | int, ...], str] = {}
    canonical: dict[str, str] = {}
    for value in graph.graph.input:
        shape = _declared_shape(value)
        if shape is not None and any(isinstance(d, str) for d in shape):
            canonical[value.name] = first.setdefault(shape, value.name)
    rewired = 0
    for node in graph.graph.node:
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input:
            target = canonical.get(node.input[0], node.input[0])
            if target != node.input[0]:
                node.input[0] = target
                rewired += 1
    return rewired


def select_before_projection(graph: onnx.ModelProto) -> int:
    """Take each row's one position before the output projection instead of after it (in
    place); returns 1 if the graph changed, 0 if it has the pass already or another shape.

    The step graph decodes one position per row, and `logits` is the projection's (B, 1, V)
    output with axis 1 gathered at 0: a copy of the whole (B, V) logits at every step. The
    same `Gather` on the decoder norm's (B, 1, D) output moves D values a row instead of V,
    and the projection writes `logits` itself. Every node between the norm and `logits` works
    on each row alone (the int8 projection's activation scale is taken over the same values
    either way), so the outputs stay the same; `update_step_graphs` checks that they do. A
    float16 graph (its logits cast to float after the `Gather`) is left as it is: its
    half-precision product rounds differently at the other shape, and on a GPU the copy is
    cheap."""
    nodes = graph.graph.node
    producers = {name: node for node in nodes for name in node.output}
    select = producers.get("logits")
    if select is None or select.op_type != "Gather" or _axis(select) != 1:
        return 0
    chain: list[onnx.NodeProto] = []
    norms: list[onnx.NodeProto] = []
    frontier, seen = [select.input[0]], set()
    while frontier:
        name = frontier.pop()
        node = producers.get(name)
        if node is None or name in seen:
            continue
        seen.add(name)
        if node.op_type == "LayerNormalization":
            norms.append(node)
            continue
        chain.append(node)
        frontier.extend(node.input)
    if len({id(n) for n in norms}) != 1:
        return 0
    norm = norms[0]
    normed = norm.output[0]
    chain_ids = {id(node) for node in chain}
    if any(normed in node.input for node in nodes if id(node) not in chain_ids and node is not select):
        return 0  # the norm's output feeds something else too
    last = f"{normed}_last_position"
    for node in chain:
        for i, name in enumerate(node.input):
            if name == normed:
                node.input[i] = last
    projected = select.input[0]
    for node in nodes:
        for i, name in enumerate(node.output):
            if name == projected:
                node.output[i] = select.output[0]
    gather = onnx.helper.make_node("Gather", [normed, select.input[1]], [last], name=f"{norm.name}_last_position",
                                   axis=1)
    reshaped = {last}  # the values computed from the selected position lose their axis 1
    while any(reshaped.intersection(node.input) and not reshaped.issuperset(node.output) for node in chain):
        for node in chain:
            if reshaped.intersection(node.input):
                reshaped.update(node.output)
    stale = (reshaped - {last}) | {projected}  # their shapes, if the graph lists them, are stale
    kept = [v for v in graph.graph.value_info if v.name not in stale]
    del graph.graph.value_info[:]
    graph.graph.value_info.extend(kept)
    nodes.remove(select)
    nodes.insert(list(nodes).index(norm) + 1, gather)
    return 1


def _axis(node: onnx.NodeProto) -> int:
    """A node's `axis` attribute (0 when absent, as `Gather` defaults)."""
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def random_graph_inputs(session: Any, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """Random inputs for an onnxruntime `session` of a repository's graph, step graphs first: 3
    rows, 8 cache columns, sources of at most 5 (a prefix of each row's mask; last source
    positions below 5), positions within the cache, ids below `vocab_size`; for the merged
    decoder one new position after 4 cached ones, its target mask all true; any other int8
    input (a shortlist's columns) small integers, float inputs positive (float16 where the graph
    takes it)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = {"batch": 3, "capacity": 8, "source_len": 5, "shortlist": 16, "new_len": 1, "past_len": 4,
             "total_len": 5}
    feed: dict[str, Any] = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(d, 4) for d in value.shape]
        if value.name == "source_mask":
            feed[value.name] = np.arange(shape[1])[None, :] < rng.integers(1, shape[1] + 1, (shape[0], 1))
        elif value.name == graph_io.SOURCE_LAST:  # an int8-cache graph's last source positions
            feed[value.name] = rng.integers(0, sizes["source_len"], shape).astype(np.int32)
        elif value.name == "positions":
            feed[value.name] = rng.integers(0, sizes["capacity"], shape)
        elif value.type == "tensor(bool)":
            feed[value.name] = np.ones(shape, dtype=bool)
        elif value.type == "tensor(int64)":
            feed[value.name] = rng.integers(0, vocab_size, shape)
        elif value.type == "tensor(int8)":
            feed[value.name] = rng.integers(-8, 8, shape).astype(np.int8)
        else:
            dtype = np.float16 if value.type == "tensor(float16)" else np.float32
            feed[value.name] = (rng.random(shape, dtype=np.float32) * 0.5 + 0.01).astype(dtype)
    return feed


@torch.no_grad()
def export_step_graph(model: Transformer) -> onnx.ModelProto:
    """The fp32 step graph in memory, with the graph passes (`share_input_shapes`,
    `select_before_projection`)."""
    from export.onnx_export import export_graph

    layers = model.config.n_decoder_layers
    auto = torch.export.Dim.AUTO
    kv = tuple({0: auto, 2: auto} for _ in range(2 * layers))
    graph = export_graph(StepGraph(model.eval()), example_step_inputs(model), graph_io.step_inputs(layers),
                         graph_io.step_outputs(layers), ({0: auto}, {0: auto}, {0: auto, 1: auto}, kv, kv),
                         "decoder_step", translations=TRANSLATIONS)
    share_input_shapes(graph)
    select_before_projection(graph)
    return graph
