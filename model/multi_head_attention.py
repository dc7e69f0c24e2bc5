"""Scaled dot-product multi-head attention that returns its weights, and the masks it uses.

Mask convention everywhere: a boolean tensor where True means "may attend".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, T) ids -> (B, T) bool, True on real tokens."""
    return tokens != pad_id


def causal_mask(n_queries: int, n_keys: int, device: torch.device | None = None) -> Tensor:
    """(T, P+T) bool: query i (at absolute position P+i) may see keys 0..P+i."""
    past = n_keys - n_queries
    query_pos = torch.arange(n_queries, device=device).unsqueeze(1) + past  # (T, 1)
    key_pos = torch.arange(n_keys, device=device).unsqueeze(0)  # (1, P+T)
    return key_pos <= query_pos  # (T, P+T)


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout: float = 0.0
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d)) V, returning (output, weights).

    query (B, h, T, d), key/value (B, h, S, d), mask broadcastable to (B, h, T, S).
    Weights are (B, h, T, S); each row sums to 1 over allowed keys and is 0 on masked ones.
    """
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))  # (B, h, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = scores.float().softmax(dim=-1).to(value.dtype)  # (B, h, T, S)
    output = F.dropout(weights, p=dropout) @ value if dropout > 0 else weights @ value
    return output, weights  # (B, h, T, d), (B, h, T, S)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, h, T, d)."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def project_key_value(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of `memory` (B, S, D), each (B, h, S, d); cached by the decoder."""
        return self.split_heads(self.key(memory)), self.split_heads(self.value(memory))

    def forward(
        self,
        x: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        need_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from `x` (B, T, D) over projected keys/values (B, h, S, d).

        Returns the output (B, T, D) and the weights (B, h, T, S), or None when
        `need_weights` is False (then a fused kernel is used: training speed).
        """
        query = self.split_heads(self.query(x))  # (B, h, T, d)
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            context, weights = scaled_dot_product_attention(query, key, value, mask, dropout)
        else:
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout)
            weights = None
        batch, _, length, _ = context.shape
        context = context.transpose(1, 2).reshape(batch, length, -1)  # (B, T, D)
        return self.output(context), weights
