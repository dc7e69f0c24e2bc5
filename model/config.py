"""The model's hyper-parameters: one frozen dataclass, saved as JSON next to the weights."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACTIVATIONS = ("relu", "gelu", "swish")
POSITION_LAYOUTS = ("interleaved", "halves", "learned")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and special tokens of an encoder-decoder Transformer (Vaswani et al. 2017).

    Source and target share one vocabulary (one SentencePiece model per task), so the source
    embedding, target embedding and output projection can be one matrix (`tie_embeddings`).
    """

    vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    d_ff: int = 1024
    dropout: float = 0.1
    max_source_len: int = 256
    max_target_len: int = 128
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3
    norm_first: bool = True  # pre-LayerNorm (stable without long warm-up); False = the paper's post-LN
    tie_embeddings: bool = True
    # Variations of imported models (`export.hf_import`); the defaults are our own architecture.
    activation: str = "relu"  # feed-forward activation: "relu" | "gelu" | "swish"
    # positions: "interleaved" sinusoids (sin/cos alternating); "halves": all sines, then cosines;
    # "learned": a table per stack, row p for position p (`learned_positions` rows each)
    position_layout: str = "interleaved"
    scale_embedding: bool = True  # token embeddings * sqrt(d_model)
    output_bias: bool = False  # the output projection adds a bias (Marian's final_logits_bias)
    decoder_start_id: int | None = None  # the decoder's first input token; None: bos_id
    embedding_norm: bool = False  # a LayerNorm after token embedding + position (BART's layernorm_embedding)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.position_layout not in POSITION_LAYOUTS:
            raise ValueError(f"position_layout must be one of {POSITION_LAYOUTS}, got {self.position_layout!r}")

    @property
    def start_id(self) -> int:
        """The token the decoder starts from: `decoder_start_id`, else bos."""
        return self.bos_id if self.decoder_start_id is None else self.decoder_start_id

    def learned_positions(self, stack: str) -> int:
        """Rows of the "learned" position table of `stack` ("source" or "target"): every position
        the model is fed. A source holds at most `max_source_len` tokens (positions 0..max_source_len-1);
        the decoder generates at most `max_target_len` tokens after the start token, and teacher
        forcing a `max_target_len`-token target feeds it positions 0..max_target_len."""
        if stack == "source":
            return self.max_source_len
        if stack == "target":
            return self.max_target_len + 1
        raise ValueError(f"stack must be 'source' or 'target', got {stack!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
