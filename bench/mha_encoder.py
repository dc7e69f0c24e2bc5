"""The encoder's self-attention as onnxruntime's `MultiHeadAttention` contrib operator, against
the shipped int8 encoder (its attention as MatMul / Softmax / Transpose nodes).

    python -m bench.mha_encoder --model models/translate-en-it --data-dir data --out bench/results/mha-encoder

The repository's PyTorch weights are exported once more as an encoder graph without the
attention-map outputs (a server's running batch never fetches them), each layer's attention one
`com.microsoft.MultiHeadAttention` node over the (B, S, D) queries, keys and values with the
source's padding as its key mask, then quantized as the int8 variant is (`export.variants.to_int8`).
Both encoders then run, one thread each, in alternating turns: encoder calls alone at a few
(rows, length) shapes (ms per call), and the first `--sentences` test sources through a running
batch of `--rows` slots on the shipped step graph (sentences/s); the report counts the sentences
whose tokens the two encoders' batches decode alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset
from torch import Tensor, nn

from bench import machine
from model.multi_head_attention import scaled_dot_product_attention
from model.transformer import DecoderLayer, EncoderLayer, Transformer
from service.repository import graph_io

SHAPES = ((1, 24), (4, 24), (8, 32), (16, 32), (16, 64))  # (rows, source length) of the timed calls

_Param = OpSchema.FormalParameter
# The onnx package carries no schemas of onnxruntime's contrib operators (as export.step_graph).
_MHA_SCHEMA = OpSchema(
    "MultiHeadAttention", "com.microsoft", 1,
    inputs=[_Param("query", "T"), _Param("key", "T"), _Param("value", "T"), _Param("bias", "T"),
            _Param("key_padding_mask", "M")],
    outputs=[_Param("output", "T")],
    type_constraints=[("T", ["tensor(float)"], ""), ("M", ["tensor(int32)"], "")],
    attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "")],
)
_MULTI_HEAD_ATTENTION = Op(Opset("com.microsoft", 1), "MultiHeadAttention", _MHA_SCHEMA)


@torch.library.custom_op("attnserve_bench::padded_self_attention", mutates_args=())
def padded_self_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, n_heads: int) -> Tensor:
    """query/key/value (B, S, D), mask (B, S) bool (True on real tokens) -> the attention (B, S, D)."""
    batch, length, width = query.shape
    head_dim = width // n_heads

    def heads(x: Tensor) -> Tensor:  # (B, S, D) -> (B, h, S, d)
        return x.view(batch, length, n_heads, head_dim).transpose(1, 2)

    context, _ = scaled_dot_product_attention(heads(query), heads(key), heads(value), mask[:, None, None, :])
    return context.transpose(1, 2).reshape(batch, length, width)


@padded_self_attention.register_fake
def _padded_self_attention_shapes(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, n_heads: int) -> Tensor:
    return torch.empty_like(query)


def _padded_self_attention_onnx(query, key, value, mask, n_heads: int):  # type: ignore[no-untyped-def]
    return _MULTI_HEAD_ATTENTION(query, key, value, None, op.Cast(mask, to=onnx.TensorProto.INT32), num_heads=n_heads)


class MhaEncoderGraph(nn.Module):
    """input_ids (B, S) -> the cross keys/values of every decoder layer (no attention maps)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        mask = input_ids != model.config.pad_id  # (B, S)
        positions = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        x = model.source_embedding(input_ids, positions)  # (B, S, D)
        for layer in model.encoder_layers:
            assert isinstance(layer, EncoderLayer)
            attention = layer.attention
            h = layer.attention_sublayer.input(x)
            context = torch.ops.attnserve_bench.padded_self_attention(
                attention.query(h), attention.key(h), attention.value(h), mask, attention.n_heads)
            x = layer.attention_sublayer.output(x, attention.output(context))
            x = layer.feed_forward_sublayer.output(x, layer.feed_forward(layer.feed_forward_sublayer.input(x)))
        memory = model.encoder_norm(x)
        cross: list[Tensor] = []
        for decoder_layer in model.decoder_layers:
            assert isinstance(decoder_layer, DecoderLayer)
            cross += decoder_layer.cross_attention.project_key_value(memory)  # (B, h, S, d) each
        return tuple(cross)


@torch.no_grad()
def export_mha_encoder(model: Transformer) -> onnx.ModelProto:
    """The fp32 encoder graph of `model` with `MultiHeadAttention` nodes (outputs: `graph_io.cross_names`)."""
    from export.onnx_export import example_encoder_inputs, export_graph

    auto = torch.export.Dim.AUTO
    return export_graph(MhaEncoderGraph(model.eval()), example_encoder_inputs(model), graph_io.encoder_inputs(),
                        graph_io.cross_names(model.config.n_decoder_layers), ({0: auto, 1: auto},), "encoder",
                        translations={torch.ops.attnserve_bench.padded_self_attention.default: _padded_self_attention_onnx})


def call_ms(session: Any, names: list[str], shape: tuple[int, int], vocab_size: int, calls: int,
            seed: int = 0) -> float:
    """Median ms of `calls` encoder calls on a random (rows, length) batch of ids below
    `vocab_size` whose rows' lengths lie between half the length and the length (the first row
    the full length)."""
    rows, length = shape
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocab_size, (rows, length))
    for row in range(rows):
        end = length if row == 0 else int(rng.integers(max(2, length // 2), length + 1))
        ids[row, end - 1], ids[row, end:] = 3, 0  # EOS, then padding
    feeds = {"input_ids": ids.astype(np.int64)}
    for _ in range(3):
        session.run(names, feeds)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        session.run(names, feeds)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mha_encoder", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=100, help="encoder calls per shape and turn")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import onnxruntime as ort

    from bench import workload as workload_module
    from bench.in_process import load_runtime
    from export.variants import to_int8
    from model.checkpoint import load_model
    from service.batching.slot_batch import generate_running
    from service.runtime.providers import session_options

    shipped = load_runtime(args.model, 1)
    graph = to_int8(export_mha_encoder(load_model(args.model)))
    session = ort.InferenceSession(graph.SerializeToString(), session_options(1, True, True),
                                   providers=["CPUExecutionProvider"])
    variants = {"int8 (shipped)": shipped, "int8, MultiHeadAttention": dataclasses.replace(shipped, encoder=session)}
    names = graph_io.cross_names(shipped.n_decoder_layers)
    vocab = shipped.vocab_size
    work = workload_module.load(args.data_dir, args.model.name, shipped.task, shipped.tokenizer, shipped.max_source_len,
                                args.sentences)
    calls: dict[str, dict[str, list[float]]] = {name: {f"{r}x{s}": [] for r, s in SHAPES} for name in variants}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, dict[int, list[int]]] = {}
    for turn in range(args.turns):
        for name in (list(variants) if turn % 2 == 0 else list(variants)[::-1]):
            runtime = variants[name]
            for shape in SHAPES:
                calls[name][f"{shape[0]}x{shape[1]}"].append(round(call_ms(runtime.encoder, names, shape, vocab, args.calls), 3))
            started = time.perf_counter()
            results = dict(generate_running(runtime, list(enumerate(work.source_ids)), rows=args.rows))
            rates[name].append(round(len(results) / (time.perf_counter() - started), 1))
            tokens[name] = {i: r.tokens for i, r in results.items()}
    first, second = (tokens[name] for name in variants)
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.mha_encoder", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine.describe(), "sentences": len(work.source_ids), "rows": args.rows, "turns": args.turns,
        "nodes": {"int8 (shipped)": len(onnx.load(str(args.model / "int8" / "encoder.onnx"), load_external_data=False).graph.node),
                  "int8, MultiHeadAttention": len(graph.graph.node)},
        "call_ms": calls, "sentences_per_s": rates,
        "same_tokens": sum(first[i] == second[i] for i in first) / len(first),
    }
    lines = ["# The encoder's self-attention as MultiHeadAttention", "", f"Command: `{result['command']}`", "",
             (f"One thread each, {args.turns} alternating turns; medians over the turns (ms per encoder call at each "
              f"rows x length; sentences/s of {len(work.source_ids)} test sentences through a running batch of "
              f"{args.rows} slots)."), "",
             "| encoder | nodes | " + " | ".join(f"{r} x {s} ms" for r, s in SHAPES) + " | running batch, sentences/s |",
             "|---|---|" + "---|" * len(SHAPES) + "---|"]
    for name in variants:
        per_shape = " | ".join(f"{statistics.median(v):.3f}" for v in calls[name].values())
        lines.append(f"| {name} | {result['nodes'][name]} | {per_shape} | {statistics.median(rates[name]):.1f} |")
    lines += ["", f"Sentences with the same tokens from both encoders: {result['same_tokens']:.3f}."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mha_encoder.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "mha_encoder.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
