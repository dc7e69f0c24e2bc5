"""Token embeddings scaled by sqrt(d_model) plus sinusoidal (or learned) positional encoding."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_encoding(positions: Tensor, d_model: int, layout: str = "interleaved") -> Tensor:
    """(B, T) absolute positions -> (B, T, D): sin on even, cos on odd channels (section 3.5);
    with layout "halves" (Marian's), the sines in channels 0..D/2-1 and the cosines after them.

    Computed from the positions rather than read from a table, so rows of one batch may sit at
    different positions (continuous batching) and there is no maximum length.
    """
    channel = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)  # (D/2,)
    inv_freq = torch.exp(channel * (-math.log(10000.0) / d_model))  # (D/2,)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (B, T, D/2)
    if layout == "halves":
        return torch.cat((angles.sin(), angles.cos()), dim=-1)  # (B, T, D)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, D)


class Embedding(nn.Module):
    """Token embedding * sqrt(d_model) (unless `scale` is False) + positional encoding, then an
    optional LayerNorm (`norm`), then dropout.

    The positional encoding is sinusoidal in `layout` "interleaved" or "halves"; with "learned"
    it is row p of a trained table of `max_positions` rows for position p (a position past the
    table is an error, in PyTorch and in the exported graphs' Gather alike).
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, dropout: float, scale: bool = True,
                 layout: str = "interleaved", max_positions: int = 0, norm: bool = False) -> None:
        super().__init__()
        self.d_model = d_model
        self.scale = math.sqrt(d_model) if scale else 1.0
        self.layout = layout
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.tokens.weight, mean=0.0, std=d_model**-0.5)
        with torch.no_grad():
            self.tokens.weight[pad_id].zero_()
        self.positions = nn.Embedding(max_positions, d_model) if layout == "learned" else None
        if self.positions is not None:
            nn.init.normal_(self.positions.weight, mean=0.0, std=d_model**-0.5)
        self.norm = nn.LayerNorm(d_model) if norm else nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """(B, T) ids and (B, T) positions -> (B, T, D)."""
        x = self.tokens(tokens) * self.scale  # (B, T, D)
        if self.positions is not None:
            x = x + self.positions(positions)  # (B, T, D)
        else:
            x = x + sinusoidal_encoding(positions, self.d_model, self.layout).to(x.dtype)
        return self.dropout(self.norm(x))
