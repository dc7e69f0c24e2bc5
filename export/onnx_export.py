"""PyTorch -> ONNX: the encoder graph and one merged decoder graph with a key/value cache.

Exporter: torch 2.13's default, the dynamo (torch.export) exporter, with `Dim.AUTO` dynamic
sizes renamed afterwards to our axis names. We checked it on the case that usually breaks it,
a dynamic past length of 0 (the first step, and teacher forcing): the graph is traced with
every dynamic size >= 2 (torch.export specialises sizes 0 and 1) and gives PyTorch's numbers
in onnxruntime for past_len 0 and 1, batch 1 and source_len 1 (tests/export/test_export.py).
The legacy TorchScript exporter is faster but deprecated; the supported path is the one used.

One merged decoder rather than a first-step decoder plus a with-past decoder (optimum's
layout): the step with past_len 0 is the same graph (`Concat` of an empty past is a no-op), so
one file halves the decoder's weight storage on disk and in memory, the runtime holds one
session, and a single call with past_len 0 gives teacher-forced attention for a whole target.
The price is a graph that cannot specialise the first step; it has nothing to specialise:
cross-attention keys/values come from the encoder graph, not from the decoder.

The wrappers are thin: they call `Transformer.encode` / `start_decoding` / `decode` and only
flatten the dataclasses into named tensors (see `service.repository.graph_io` for the names and axes).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import onnx
import torch
from torch import Tensor, nn

from model.transformer import DecoderCache, LayerCache, Transformer
from service.repository import graph_io

log = logging.getLogger(__name__)

OPSET = 18
ENCODER_FILE, DECODER_FILE = "encoder.onnx", "decoder.onnx"
# Loggers the exporter is chatty on. "torch.__trace" emits structured traces (whole graphs) at
# DEBUG whenever a handler listens, e.g. pytest's log capture: minutes of formatting.
QUIET_LOGGERS = ("onnx_ir", "onnxscript", "torch.onnx", "torch.export", "torch._export", "torch.__trace",
                 "torch._dynamo", "torch.fx", "torch._subclasses", "torch._functorch", "torch._guards")


class EncoderGraph(nn.Module):
    """input_ids (B, S) -> encoder self-attention per layer, cross keys/values per decoder layer."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        encoded = self.model.encode(input_ids, need_weights=True)
        cache = self.model.start_decoding(encoded)
        cross = [t for layer in cache.layers for t in (layer.cross_key, layer.cross_value)]  # (B, h, S, d)
        return (*encoded.attentions, *cross)  # attentions (B, h, S, S)


class DecoderGraph(nn.Module):
    """One decoder call on new_len tokens after past_len cached positions (past_len may be 0)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: Tensor,  # (B, T)
        positions: Tensor,  # (B, T)
        source_mask: Tensor,  # (B, S) bool
        target_mask: Tensor,  # (B, P+T) bool
        past: tuple[Tensor, ...],  # past_key.0, past_value.0, ...: (B, h, P, d)
        cross: tuple[Tensor, ...],  # cross_key.0, cross_value.0, ...: (B, h, S, d)
    ) -> tuple[Tensor, ...]:
        layers = [
            LayerCache(past[2 * i], past[2 * i + 1], cross[2 * i], cross[2 * i + 1])
            for i in range(len(self.model.decoder_layers))
        ]
        out = self.model.decode(input_ids, DecoderCache(layers, source_mask), target_mask, positions, need_weights=True)
        present = [t for layer in out.cache.layers for t in (layer.self_key, layer.self_value)]  # (B, h, P+T, d)
        return (out.logits, *present, *out.self_attentions, *out.cross_attentions)


def example_encoder_inputs(model: Transformer) -> tuple[Tensor]:
    """A (3, 7) batch: every dynamic size >= 2 and all different, so none is specialised."""
    return (torch.randint(4, model.config.vocab_size, (3, 7)),)


def example_decoder_inputs(model: Transformer) -> tuple[Tensor | tuple[Tensor, ...], ...]:
    config = model.config
    batch, source, past, new = 3, 7, 4, 2
    heads, head_dim, layers = config.n_heads, config.head_dim, config.n_decoder_layers
    return (
        torch.randint(4, config.vocab_size, (batch, new)),
        torch.arange(past, past + new).expand(batch, new).contiguous(),
        torch.ones(batch, source, dtype=torch.bool),
        torch.ones(batch, past + new, dtype=torch.bool),
        tuple(torch.randn(batch, heads, past, head_dim) for _ in range(2 * layers)),
        tuple(torch.randn(batch, heads, source, head_dim) for _ in range(2 * layers)),
    )


def _name_axes(proto: onnx.ModelProto, graph: str) -> None:
    """Give the graph's inputs and outputs our axis names (torch.export calls them s0, s1, ...)."""
    for value in [*proto.graph.input, *proto.graph.output]:
        names = graph_io.axes(graph, value.name)
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(names):
            raise RuntimeError(f"{graph}.{value.name}: rank {len(dims)}, expected axes {names}")
        for dim, name in zip(dims, names, strict=True):
            if name in (graph_io.BATCH, graph_io.SOURCE_LEN, graph_io.NEW_LEN, graph_io.PAST_LEN, graph_io.TOTAL_LEN,
                        graph_io.CAPACITY):
                dim.ClearField("dim_value")
                dim.dim_param = name


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Raise these loggers to ERROR for the duration (the exporter logs every pass at INFO and
    warns that torchvision's operators are not registered)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def export_graph(module: nn.Module, args: tuple, input_names: list[str], output_names: list[str],
                 dynamic_shapes: tuple, graph: str, translations: dict | None = None) -> onnx.ModelProto:
    """Export `module` with the dynamo exporter, check its I/O names, name its axes (`graph_io`);
    `translations` maps custom PyTorch operators to their ONNX functions."""
    with warnings.catch_warnings(), _quiet(*QUIET_LOGGERS):
        warnings.simplefilter("ignore")  # exporter chatter (deprecations, torchvision missing)
        program = torch.onnx.export(
            module.eval(), args, None, input_names=input_names, output_names=output_names,
            dynamic_shapes=dynamic_shapes, opset_version=OPSET, dynamo=True, optimize=True, verbose=False,
            custom_translation_table=translations,
        )
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    proto = program.model_proto
    found = [v.name for v in proto.graph.input], [v.name for v in proto.graph.output]
    if found != (input_names, output_names):
        raise RuntimeError(f"{graph}: exported I/O {found} differs from {input_names, output_names}")
    _name_axes(proto, graph)
    proto.doc_string = f"attnserve {graph}"
    if not translations:  # the checker knows no contrib operators (onnxruntime checks them at load)
        onnx.checker.check_model(proto)
    return proto


@torch.no_grad()
def export_encoder(model: Transformer) -> onnx.ModelProto:
    config = model.config
    auto = torch.export.Dim.AUTO
    return export_graph(EncoderGraph(model), example_encoder_inputs(model), graph_io.encoder_inputs(),
                   graph_io.encoder_outputs(config.n_encoder_layers, config.n_decoder_layers),
                   ({0: auto, 1: auto},), "encoder")


@torch.no_grad()
def export_decoder(model: Transformer) -> onnx.ModelProto:
    layers = model.config.n_decoder_layers
    auto = torch.export.Dim.AUTO
    kv = tuple({0: auto, 2: auto} for _ in range(2 * layers))
    dynamic_shapes = ({0: auto, 1: auto},) * 4 + (kv, kv)
    return export_graph(DecoderGraph(model), example_decoder_inputs(model), graph_io.decoder_inputs(layers),
                   graph_io.decoder_outputs(layers), dynamic_shapes, "decoder")


def export_graphs(model: Transformer) -> dict[str, onnx.ModelProto]:
    """The fp32 graphs in memory: {"encoder.onnx": ..., "decoder.onnx": ...}."""
    model = model.eval()
    log.info("exporting encoder and decoder (opset %d, dynamo exporter)", OPSET)
    return {ENCODER_FILE: export_encoder(model), DECODER_FILE: export_decoder(model)}
