"""Attention maps of requests: token labels, layer and head selection, rounding. Torch-free.

Conventions (the same for `POST /v1/attention` and `return_attention`):
- The encoder reads the source's token ids then EOS: `source_tokens` are the source's pieces,
  then `</s>` (spanning `[len(text), len(text)]`).
- The decoder reads `<s>` + target. Decoder position i reads `<s>` + target[:i] and predicts
  target token i (EOS after the last): it is labelled by that token, so `target_tokens` are
  the target's pieces, then `</s>`, and row i of the cross and decoder maps (and column i of
  the decoder map) belong to `target_tokens[i]`. Decoder self-attention is causal.
- For a generated output (`return_attention`), the rows are the steps that produced it: one
  per output token, plus the `</s>` row when generation stopped at EOS (not at the limit).
- Word alignments (`return_alignment`, and `alignment` of `/v1/attention`) come from every
  layer's and head's cross-attention of one teacher-forced pass of `<s>` + the whole target,
  by `service.generation.alignment.DEFAULT`.

All of it runs in the model's worker thread (`Batcher.run`): one teacher-forced encoder and
decoder call, then numpy. `/v1/attention` responses are even serialised there, since a large
map takes the event loop long to turn into JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.generation import alignment
from service.generation.search import teacher_forced_attention
from service.runtime.protocol import Runtime

EOS_PIECE = "</s>"
KINDS = ("encoder", "decoder", "cross")
ALIGNMENT_DECIMALS = 4  # rounding of `return_attention` weights


@dataclass(frozen=True)
class Selection:
    """Which maps a request wants and how: kinds, layers and heads (None: all), rounding."""

    kinds: tuple[str, ...]
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    average_heads: bool = False
    decimals: int = 4

    def layer_indices(self, runtime: Runtime, kind: str) -> list[int]:
        """The layers of `kind` returned, in order."""
        if self.layers is not None:
            return list(self.layers)
        return list(range(layer_count(runtime, kind)))

    def head_indices(self, runtime: Runtime) -> list[int]:
        """The heads returned (or averaged), in order."""
        return list(self.heads) if self.heads is not None else list(range(runtime.n_heads))

    def cells(self, runtime: Runtime, source_len: int, target_len: int) -> int:
        """How many weights the maps hold, for sources and targets of these lengths (with EOS)."""
        heads = 1 if self.average_heads else len(self.head_indices(runtime))
        shape = {"encoder": (source_len, source_len), "decoder": (target_len, target_len),
                 "cross": (target_len, source_len)}
        return sum(len(self.layer_indices(runtime, kind)) * heads * shape[kind][0] * shape[kind][1]
                   for kind in self.kinds)


def layer_count(runtime: Runtime, kind: str) -> int:
    """Layers of the encoder (encoder kind) or of the decoder (decoder and cross kinds)."""
    return runtime.n_encoder_layers if kind == "encoder" else runtime.n_decoder_layers


def labels(pieces: Sequence[str], spans: Sequence[tuple[int, int]], text_length: int,
           add_eos: bool) -> list[dict[str, Any]]:
    """`{"piece", "start", "end"}` of each piece, then of `</s>` (at the text's end) if asked."""
    tokens = [{"piece": p, "start": s, "end": e} for p, (s, e) in zip(pieces, spans, strict=True)]
    if add_eos:
        tokens.append({"piece": EOS_PIECE, "start": text_length, "end": text_length})
    return tokens


def select(maps: Sequence[np.ndarray], layers: Sequence[int], heads: Sequence[int],
           average_heads: bool) -> np.ndarray:
    """Per-layer (h, Q, K) maps -> (layers, heads or 1, Q, K) of the chosen layers and heads."""
    stacked = np.stack([maps[layer] for layer in layers])  # (L', h, Q, K)
    chosen = stacked[:, list(heads)]  # (L', H', Q, K)
    return chosen.mean(axis=1, keepdims=True) if average_heads else chosen  # (L', 1 | H', Q, K)


def rounded(weights: np.ndarray, decimals: int) -> Any:
    """Nested lists of `weights` rounded to `decimals` (in float64, so that 0.1235 stays so)."""
    return np.round(weights.astype(np.float64), decimals).tolist()


@dataclass(frozen=True)
class Texts:
    """Source and target texts and their pieces' character spans (without `</s>`): what a
    word alignment needs besides the attention."""

    source: str
    source_spans: list[tuple[int, int]]
    target: str
    target_spans: list[tuple[int, int]]


def attention_json(runtime: Runtime, source_ids: list[int], target_ids: list[int],
                   selection: Selection, fields: dict[str, Any], texts: Texts | None = None) -> bytes:
    """The `/v1/attention` body: `fields` plus the selected maps of `target_ids` given
    `source_ids` (ending with EOS), teacher-forced; with `texts`, also the word alignment of
    the same pass (all its cross-attention, `alignment.DEFAULT`); serialised to JSON."""
    maps = teacher_forced_attention(runtime, source_ids, target_ids)
    heads = selection.head_indices(runtime)
    body = dict(fields)
    body["attention"] = {
        kind: rounded(select(getattr(maps, kind), selection.layer_indices(runtime, kind), heads,
                             selection.average_heads), selection.decimals)
        for kind in selection.kinds
    }
    if texts is not None:
        body["alignment"] = alignment_fields(np.stack(maps.cross), texts)
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def alignment_fields(cross: np.ndarray, texts: Texts) -> dict[str, Any]:
    """`{"pharaoh", "links", "source_words", "target_words"}` of one pass's cross-attention
    `(layers, heads, rows, source positions)`, by `alignment.DEFAULT`."""
    found = alignment.align(cross, texts.source, texts.source_spans, texts.target, texts.target_spans)
    return {
        "pharaoh": found.pharaoh,
        "links": [list(link) for link in found.links],
        "source_words": [{"word": w.text, "start": w.start, "end": w.end} for w in found.source_words],
        "target_words": [{"word": w.text, "start": w.start, "end": w.end} for w in found.target_words],
    }


def decoder_input(runtime: Runtime, tokens: Sequence[int], ended_with_eos: bool
                  ) -> tuple[list[int], int]:
    """The teacher-forced decoder input replaying a generated output, and its number of rows.

    The rows are the generation steps: one per token, plus one for EOS if it was generated.
    """
    rows = len(tokens) + int(ended_with_eos)
    return [runtime.decoder_start_id, *tokens][: max(rows, 1)], rows


def cross_attention(runtime: Runtime, sources: list[list[int]],
                    decoder_inputs: list[list[int]]) -> list[np.ndarray]:
    """Every decoder layer's cross-attention of each (source, decoder input) pair, teacher-forced:
    `(layers, heads, len(decoder input), len(source))` each.

    One encoder and one decoder call for the whole batch (sources ending with EOS, decoder
    inputs starting with the start token); padding is masked, and causal attention never reads it.
    """
    state = runtime.encode(runtime.pad(sources))
    width = max(len(ids) for ids in decoder_inputs)
    decoder_ids = np.full((len(decoder_inputs), width), runtime.decoder_start_id, dtype=np.int64)  # (B, T)
    target_mask = np.zeros((len(decoder_inputs), width), dtype=bool)  # (B, T)
    for row, ids in enumerate(decoder_inputs):
        decoder_ids[row, : len(ids)] = ids
        target_mask[row, : len(ids)] = True
    step = runtime.decode(decoder_ids, state, target_mask=target_mask, need_attention=True)
    assert step.cross_attentions is not None
    cross = np.stack(step.cross_attentions, axis=1)  # (B, L, h, T, S)
    return [cross[row, :, :, : len(ids), : len(source)]
            for row, (source, ids) in enumerate(zip(sources, decoder_inputs, strict=True))]


def alignments(runtime: Runtime, sources: list[list[int]],
               outputs: list[tuple[list[int], bool]]) -> list[list[list[float]]]:
    """Cross-attention of each generated output over its source, last decoder layer, mean of
    the heads, rounded: `[row][source token]` (rows as in `decoder_input`); sources end with
    EOS, outputs are (tokens, ended with EOS)."""
    inputs = [decoder_input(runtime, tokens, eos) for tokens, eos in outputs]
    maps = cross_attention(runtime, sources, [ids for ids, _ in inputs])
    return [rounded(cross[-1].mean(axis=0)[:rows], ALIGNMENT_DECIMALS)
            for cross, (_, rows) in zip(maps, inputs, strict=True)]


def word_alignments(runtime: Runtime, texts: list[str], sources: list[list[int]],
                    outputs: list[list[int]]) -> list[dict[str, Any]]:
    """The word alignment (`alignment_fields`) of each generated output (token ids) to its
    source text (`sources`: its ids, ending with EOS), from one teacher-forced pass of
    `<s>` + output for the whole batch."""
    tokenizer = runtime.tokenizer
    maps = cross_attention(runtime, sources, [[runtime.decoder_start_id, *tokens] for tokens in outputs])
    found = []
    for text, cross, tokens in zip(texts, maps, outputs, strict=True):
        _, source_spans = tokenizer.encode_with_offsets(text)
        target, target_spans = tokenizer.decode_with_offsets(tokens)
        found.append(alignment_fields(cross, Texts(text, source_spans, target, target_spans)))
    return found
