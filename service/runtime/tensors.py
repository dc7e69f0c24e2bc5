"""The tensors the graph calls hand over: the encoder's state for the decoder, the KV cache
and one decoder call's outputs, each on the host (numpy) or on the session's device (OrtValue,
with IO binding), and row selection on either."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

# A tensor as the graph calls hand it over: numpy on the host, or an OrtValue on the session's
# device (IO binding).
Tensor: TypeAlias = np.ndarray | ort.OrtValue
# Gathers batch rows of tensors that live on a device: (tensors, rows) -> tensors.
Gatherer: TypeAlias = Callable[[list[ort.OrtValue], np.ndarray], list[ort.OrtValue]]


def shape(tensor: Tensor) -> tuple[int, ...]:
    """The shape of a numpy array or an OrtValue."""
    return tuple(tensor.shape()) if isinstance(tensor, ort.OrtValue) else tuple(tensor.shape)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A host copy (or view, for a CPU OrtValue) of a tensor."""
    return tensor.numpy() if isinstance(tensor, ort.OrtValue) else tensor


def _take(tensors: list[Tensor], rows: np.ndarray, gather: Gatherer | None) -> list[Tensor]:
    """Rows of each tensor: numpy indexing on the host, `gather` on the device for OrtValues."""
    if tensors and isinstance(tensors[0], ort.OrtValue):
        if gather is None:  # an OrtValue without a device gatherer: through the host
            return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(to_numpy(t)[rows])) for t in tensors]
        return list(gather(tensors, rows))
    return [t[rows] for t in tensors]  # type: ignore[index]


@dataclass
class EncoderState:
    """What the decoder needs from the encoder, per batch row."""

    source_mask: np.ndarray  # (B, S) bool, True on real source tokens
    cross_keys: list[Tensor]  # per decoder layer (B, h, S, d); OrtValues on the device with IO binding
    cross_values: list[Tensor]  # per decoder layer (B, h, S, d)
    attentions: list[np.ndarray] | None = None  # per encoder layer (B, h, S, S), when asked for
    gather: Gatherer | None = field(default=None, repr=False, compare=False)  # row selection on the device

    def select(self, rows: np.ndarray) -> EncoderState:
        """Keep, reorder or repeat batch rows (finished rows leave, beams follow their parent)."""
        rows = np.asarray(rows, dtype=np.int64)
        layers = len(self.cross_keys)
        cross = _take([*self.cross_keys, *self.cross_values], rows, self.gather)
        return EncoderState(
            self.source_mask[rows],
            cross[:layers],
            cross[layers:],
            None if self.attentions is None else [a[rows] for a in self.attentions],
            self.gather,
        )


@dataclass
class KVCache:
    """Self-attention keys and values of the positions decoded so far."""

    keys: list[Tensor]  # per decoder layer (B, h, P, d); OrtValues on the device with IO binding
    values: list[Tensor]  # per decoder layer (B, h, P, d)
    gather: Gatherer | None = field(default=None, repr=False, compare=False)  # row selection on the device

    @property
    def length(self) -> int:
        return int(shape(self.keys[0])[2])

    def select(self, rows: np.ndarray) -> KVCache:
        rows = np.asarray(rows, dtype=np.int64)
        layers = len(self.keys)
        kept = _take([*self.keys, *self.values], rows, self.gather)
        return KVCache(kept[:layers], kept[layers:], self.gather)


@dataclass
class DecoderStep:
    """One call of the decoder graph."""

    logits: np.ndarray  # (B, T, V) float32, on the host
    cache: KVCache  # grown by T positions (on the device with IO binding)
    self_attentions: list[np.ndarray] | None = None  # per layer (B, h, T, P+T)
    cross_attentions: list[np.ndarray] | None = None  # per layer (B, h, T, S)
