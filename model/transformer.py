"""The encoder-decoder Transformer of "Attention Is All You Need", with a key/value cache.

`Transformer.encode` runs the encoder once; `Transformer.start_decoding` turns its output into
a `DecoderCache` (cross-attention keys/values computed once, empty self-attention cache);
`Transformer.decode` runs the decoder on new target tokens and returns the grown cache. The
same path serves training (all target tokens at once) and generation (one token a step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig
from model.embedding import Embedding
from model.multi_head_attention import MultiHeadAttention, causal_mask, padding_mask


@dataclass
class LayerCache:
    """Keys and values one decoder layer keeps between steps, each (B, h, length, d)."""

    self_key: Tensor  # (B, h, P, d): grows by one position a step
    self_value: Tensor  # (B, h, P, d)
    cross_key: Tensor  # (B, h, S, d): computed once from the encoder output
    cross_value: Tensor  # (B, h, S, d)

    def select(self, rows: Tensor) -> LayerCache:
        """Keep (or reorder/repeat) batch rows, e.g. drop finished rows or follow beams."""
        return LayerCache(*(t.index_select(0, rows) for t in self.tensors()))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.self_key, self.self_value, self.cross_key, self.cross_value


@dataclass
class DecoderCache:
    """Everything the decoder needs besides the new tokens: per-layer caches and masks."""

    layers: list[LayerCache]
    source_mask: Tensor  # (B, S) bool, True on real source tokens

    @property
    def past_length(self) -> int:
        return self.layers[0].self_key.size(2)

    def select(self, rows: Tensor) -> DecoderCache:
        return DecoderCache([c.select(rows) for c in self.layers], self.source_mask.index_select(0, rows))


@dataclass
class EncoderOutput:
    memory: Tensor  # (B, S, D)
    source_mask: Tensor  # (B, S) bool
    attentions: list[Tensor]  # per layer (B, h, S, S); empty when weights were not asked for


@dataclass
class DecoderOutput:
    logits: Tensor  # (B, T, V)
    cache: DecoderCache
    self_attentions: list[Tensor]  # per layer (B, h, T, P+T)
    cross_attentions: list[Tensor]  # per layer (B, h, T, S)


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear -> ReLU (or `activation`) -> Linear (section 3.3)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu") -> None:
        super().__init__()
        self.inner = nn.Linear(d_model, d_ff)
        self.outer = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(self.dropout(self.activation(self.inner(x))))


class Sublayer(nn.Module):
    """Residual connection around a sublayer with LayerNorm before (pre-LN) or after (post-LN)."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def input(self, x: Tensor) -> Tensor:
        """What the sublayer function sees."""
        return self.norm(x) if self.norm_first else x

    def output(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        """Residual sum, normalised afterwards in post-LN."""
        y = x + self.dropout(sublayer_out)
        return y if self.norm_first else self.norm(y)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual `Sublayer`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = MultiHeadAttention(config.d_model, config.n_heads, config.dropout)
        self.feed_forward = FeedForward(config.d_model, config.d_ff, config.dropout, config.activation)
        self.attention_sublayer = Sublayer(config.d_model, config.dropout, config.norm_first)
        self.feed_forward_sublayer = Sublayer(config.d_model, config.dropout, config.norm_first)

    def forward(self, x: Tensor, mask: Tensor, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """x (B, S, D), mask (B, 1, 1, S) -> (B, S, D), weights (B, h, S, S) or None."""
        h = self.attention_sublayer.input(x)
        key, value = self.attention.project_key_value(h)  # (B, h, S, d) each
        attended, weights = self.attention(h, key, value, mask, need_weights)
        x = self.attention_sublayer.output(x, attended)
        x = self.feed_forward_sublayer.output(x, self.feed_forward(self.feed_forward_sublayer.input(x)))
        return x, weights


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config.d_model, config.n_heads, config.dropout)
        self.cross_attention = MultiHeadAttention(config.d_model, config.n_heads, config.dropout)
        self.feed_forward = FeedForward(config.d_model, config.d_ff, config.dropout, config.activation)
        self.self_sublayer = Sublayer(config.d_model, config.dropout, config.norm_first)
        self.cross_sublayer = Sublayer(config.d_model, config.dropout, config.norm_first)
        self.feed_forward_sublayer = Sublayer(config.d_model, config.dropout, config.norm_first)

    def forward(
        self,
        x: Tensor,
        cache: LayerCache,
        self_mask: Tensor,
        cross_mask: Tensor,
        need_weights: bool,
    ) -> tuple[Tensor, LayerCache, Tensor | None, Tensor | None]:
        """x (B, T, D) new positions; self_mask (B, 1, T, P+T); cross_mask (B, 1, 1, S).

        Returns the output (B, T, D), the cache grown by T positions, and the self- and
        cross-attention weights (B, h, T, P+T) and (B, h, T, S), or None.
        """
        # 1. masked self-attention over the past and the new positions
        h = self.self_sublayer.input(x)
        new_key, new_value = self.self_attention.project_key_value(h)  # (B, h, T, d)
        key = torch.cat([cache.self_key, new_key], dim=2)  # (B, h, P+T, d)
        value = torch.cat([cache.self_value, new_value], dim=2)  # (B, h, P+T, d)
        attended, self_weights = self.self_attention(h, key, value, self_mask, need_weights)
        x = self.self_sublayer.output(x, attended)
        # 2. and 3.
        x, cross_weights = self.attend_source_and_feed_forward(x, cache.cross_key, cache.cross_value, cross_mask,
                                                               need_weights)
        grown = LayerCache(key, value, cache.cross_key, cache.cross_value)
        return x, grown, self_weights, cross_weights

    def attend_source_and_feed_forward(
        self, x: Tensor, cross_key: Tensor, cross_value: Tensor, cross_mask: Tensor, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """After self-attention: cross-attention over the encoder output (keys/values (B, h, S, d),
        cached once), then feed-forward. x (B, T, D) -> (B, T, D), weights (B, h, T, S) or None."""
        return self.around_source_attention(
            x, lambda h: self.cross_attention(h, cross_key, cross_value, cross_mask, need_weights))

    def around_source_attention(
        self, x: Tensor, attend: Callable[[Tensor], tuple[Tensor, Tensor | None]]
    ) -> tuple[Tensor, Tensor | None]:
        """The cross sublayer and feed-forward around `attend`, which maps the normalized input
        (B, T, D) to the attended, output-projected (B, T, D) and its weights (or None): the one
        place the decoder layer's residual and norm order after self-attention is written."""
        attended, cross_weights = attend(self.cross_sublayer.input(x))
        x = self.cross_sublayer.output(x, attended)
        x = self.feed_forward_sublayer.output(x, self.feed_forward(self.feed_forward_sublayer.input(x)))
        return x, cross_weights


class Transformer(nn.Module):
    """Encoder-decoder Transformer with shared source/target vocabulary."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.source_embedding = Embedding(config.vocab_size, config.d_model, config.pad_id, config.dropout,
                                          config.scale_embedding, config.position_layout,
                                          config.learned_positions("source"), config.embedding_norm)
        self.target_embedding = Embedding(config.vocab_size, config.d_model, config.pad_id, config.dropout,
                                          config.scale_embedding, config.position_layout,
                                          config.learned_positions("target"), config.embedding_norm)
        if config.tie_embeddings:
            self.target_embedding.tokens.weight = self.source_embedding.tokens.weight
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        # pre-LN stacks end with a LayerNorm; post-LN outputs are already normalised
        self.encoder_norm = nn.LayerNorm(config.d_model) if config.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(config.d_model) if config.norm_first else nn.Identity()
        self.output_projection = nn.Linear(config.d_model, config.vocab_size, bias=config.output_bias)
        if config.tie_embeddings:
            self.output_projection.weight = self.target_embedding.tokens.weight
        self._init_linear_weights()

    def _init_linear_weights(self) -> None:
        if self.output_projection.bias is not None:
            nn.init.zeros_(self.output_projection.bias)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2 and "embedding" not in name and "output_projection" not in name:
                nn.init.xavier_uniform_(parameter)

    def encode(self, source: Tensor, need_weights: bool = True) -> EncoderOutput:
        """(B, S) source ids, right-padded with pad_id -> encoder output and self-attention."""
        source_mask = padding_mask(source, self.config.pad_id)  # (B, S)
        positions = torch.arange(source.size(1), device=source.device).expand_as(source)  # (B, S)
        x = self.source_embedding(source, positions)  # (B, S, D)
        attention_mask = source_mask[:, None, None, :]  # (B, 1, 1, S)
        attentions = []
        for layer in self.encoder_layers:
            x, weights = layer(x, attention_mask, need_weights)
            if weights is not None:
                attentions.append(weights)
        return EncoderOutput(self.encoder_norm(x), source_mask, attentions)

    def start_decoding(self, encoded: EncoderOutput) -> DecoderCache:
        """Cache with cross-attention keys/values of every layer and an empty self-attention past."""
        batch = encoded.memory.size(0)
        empty = encoded.memory.new_zeros(batch, self.config.n_heads, 0, self.config.head_dim)  # (B, h, 0, d)
        layers = []
        for layer in self.decoder_layers:
            assert isinstance(layer, DecoderLayer)
            cross_key, cross_value = layer.cross_attention.project_key_value(encoded.memory)  # (B, h, S, d)
            layers.append(LayerCache(empty, empty, cross_key, cross_value))
        return DecoderCache(layers, encoded.source_mask)

    def decode(
        self,
        target: Tensor,
        cache: DecoderCache,
        target_mask: Tensor | None = None,
        positions: Tensor | None = None,
        need_weights: bool = True,
    ) -> DecoderOutput:
        """Run the decoder on T new target tokens (B, T) after P cached positions.

        `target_mask` (B, P+T) marks real target positions (default all real): a batch may hold
        rows whose past is left-padded. `positions` (B, T) defaults to P..P+T-1 for every row.
        """
        batch, length = target.shape
        past = cache.past_length
        if positions is None:
            positions = torch.arange(past, past + length, device=target.device).expand(batch, length)
        self_mask = causal_mask(length, past + length, target.device)[None, None]  # (1, 1, T, P+T)
        if target_mask is not None:
            self_mask = self_mask & target_mask[:, None, None, :]  # (B, 1, T, P+T)
        cross_mask = cache.source_mask[:, None, None, :]  # (B, 1, 1, S)
        x = self.target_embedding(target, positions)  # (B, T, D)
        layers, self_attentions, cross_attentions = [], [], []
        for layer, layer_cache in zip(self.decoder_layers, cache.layers, strict=True):
            x, grown, self_weights, cross_weights = layer(x, layer_cache, self_mask, cross_mask, need_weights)
            layers.append(grown)
            if self_weights is not None and cross_weights is not None:
                self_attentions.append(self_weights)
                cross_attentions.append(cross_weights)
        logits = self.output_projection(self.decoder_norm(x))  # (B, T, V)
        return DecoderOutput(logits, DecoderCache(layers, cache.source_mask), self_attentions, cross_attentions)

    def forward(self, source: Tensor, target_input: Tensor, need_weights: bool = False) -> Tensor:
        """Teacher forcing: (B, S) source and (B, T) target input (start token + target) -> (B, T, V) logits."""
        encoded = self.encode(source, need_weights)
        target_mask = padding_mask(target_input, self.config.pad_id)  # (B, T)
        return self.decode(target_input, self.start_decoding(encoded), target_mask, need_weights=need_weights).logits
