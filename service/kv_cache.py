"""The decoder's self-attention key/value cache, on the host or on a device.

The decoder graph reads the cache where it is and outputs only the keys/values of its new
positions (`export.graph_io`); `KVCache.extend` appends them:
- On the host, into spare columns of the same buffers, in place. A layer's keys (and values)
  live in a (B, h, C, d) buffer whose first P columns are the cache; `CACHE_ROOM` more columns
  are allocated, with one copy, only when the spare ones run out. The decoder is fed the whole
  buffer with the spare columns masked (`feeds`, `widen_mask`), so a step copies no cache.
- On a device (IO binding: OrtValues), by a `Concat` on the device (`DeviceOps.concat`): the
  cache there holds exactly P columns.

Caches over the same host buffers share a record of the columns written so far: extending a
cache that is not the latest over its buffers (two continuations of one cache) copies it
instead of overwriting the other continuation's positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from service.device_ops import DeviceOps, Tensor, on_device, shape, to_numpy

CACHE_ROOM = 16  # spare columns a host cache is given when it must be copied anyway


@dataclass(eq=False)
class _Buffers:
    """Host buffers of every layer, shared by the caches that view them."""

    keys: list[np.ndarray]  # per decoder layer (B, h, C, d)
    values: list[np.ndarray]
    filled: int  # columns written so far (the latest cache's length)

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])


@dataclass
class KVCache:
    """Self-attention keys and values of the positions decoded so far."""

    keys: list[Tensor]  # per decoder layer (B, h, P, d): host views, or OrtValues on the device
    values: list[Tensor]  # per decoder layer (B, h, P, d)
    device_ops: DeviceOps | None = field(default=None, repr=False, compare=False)  # for OrtValues
    on_device: bool = False  # `extend` keeps the cache on the device (IO binding)
    buffers: _Buffers | None = field(default=None, repr=False, compare=False)  # host: room to grow

    @property
    def length(self) -> int:
        """P: cached positions per row."""
        return int(shape(self.keys[0])[2])

    @classmethod
    def empty(cls, batch: int, layers: int, heads: int, head_dim: int, dtype: np.dtype,
              device_ops: DeviceOps | None = None, on_device: bool = False) -> KVCache:
        """P = 0 (host arrays even for a device cache: onnxruntime copies their zero bytes)."""
        empty = np.zeros((batch, heads, 0, head_dim), dtype=dtype)
        return cls([empty] * layers, [empty] * layers, device_ops, on_device)

    @classmethod
    def on_host(cls, keys: list[np.ndarray], values: list[np.ndarray], room: int = CACHE_ROOM) -> KVCache:
        """A host cache of copies of `keys`/`values` (B, h, P, d), with `room` spare columns."""
        batch, heads, length, head_dim = keys[0].shape
        key_buffers, value_buffers = (
            [np.zeros((batch, heads, length + room, head_dim), dtype=keys[0].dtype) for _ in part]
            for part in (keys, values))
        for buffer, array in zip([*key_buffers, *value_buffers], [*keys, *values], strict=True):
            buffer[:, :, :length] = array
        return cls.over_buffers(key_buffers, value_buffers, length)

    @classmethod
    def over_buffers(cls, keys: list[np.ndarray], values: list[np.ndarray], length: int) -> KVCache:
        """A host cache over these (B, h, C, d) buffers (kept, not copied) whose first `length`
        columns hold it; the others are zeros or stale values, room for the next positions."""
        return cls._viewing(_Buffers(list(keys), list(values), length))

    @classmethod
    def _viewing(cls, buffers: _Buffers) -> KVCache:
        length = buffers.filled
        return cls([b[:, :, :length] for b in buffers.keys], [b[:, :, :length] for b in buffers.values],
                   buffers=buffers)

    def feeds(self) -> tuple[list[Tensor], list[Tensor]]:
        """What the decoder is fed as past keys/values: each layer's whole host buffer (its
        columns past `length` to be masked, see `widen_mask`), else the cache itself."""
        if self.buffers is None:
            return self.keys, self.values
        return list(self.buffers.keys), list(self.buffers.values)

    def extend(self, new_keys: list[Tensor], new_values: list[Tensor]) -> KVCache:
        """The cache grown by the new positions' keys/values (B, h, T, d) of every layer."""
        length = self.length
        if self.on_device:
            if length == 0:  # nothing to keep: the new positions are the cache
                return KVCache(list(new_keys), list(new_values), self.device_ops, on_device=True)
            if self.device_ops is not None and on_device(self.keys):
                joined = self.device_ops.concat([*self.keys, *self.values], [*new_keys, *new_values])
            else:  # no device operations: through the host
                joined = [ort.OrtValue.ortvalue_from_numpy(np.concatenate([to_numpy(a), to_numpy(b)], axis=2))
                          for a, b in zip([*self.keys, *self.values], [*new_keys, *new_values], strict=True)]
            layers = len(self.keys)
            return KVCache(joined[:layers], joined[layers:], self.device_ops, on_device=True)
        keys, values = [to_numpy(k) for k in new_keys], [to_numpy(v) for v in new_values]
        added = keys[0].shape[2]
        buffers = self.buffers
        if (buffers is None or buffers.filled != length or buffers.capacity < length + added
                or buffers.keys[0].shape[0] != keys[0].shape[0]):
            grown = KVCache.on_host([to_numpy(k) for k in self.keys], [to_numpy(v) for v in self.values],
                                    room=added + CACHE_ROOM)
            buffers = grown.buffers
            assert buffers is not None
        for buffer, new in zip([*buffers.keys, *buffers.values], [*keys, *values], strict=True):
            buffer[:, :, length:length + added] = new  # (B, h, T, d) into the spare columns
        buffers.filled = length + added
        return KVCache._viewing(buffers)

    def select(self, rows: np.ndarray) -> KVCache:
        """Keep, reorder or repeat batch rows (host buffers keep their spare columns)."""
        rows = np.asarray(rows, dtype=np.int64)
        layers = len(self.keys)
        if on_device(self.keys):
            tensors = [*self.keys, *self.values]
            if self.device_ops is None:  # an OrtValue without device operations: through the host
                kept = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(to_numpy(t)[rows])) for t in tensors]
            else:
                kept = self.device_ops.gather(tensors, rows)
            return KVCache(kept[:layers], kept[layers:], self.device_ops, self.on_device)
        if self.buffers is None:
            return KVCache([k[rows] for k in self.keys], [v[rows] for v in self.values],  # type: ignore[index]
                           self.device_ops, self.on_device)
        buffers = _Buffers([b[rows] for b in self.buffers.keys], [b[rows] for b in self.buffers.values], self.length)
        selected = KVCache._viewing(buffers)
        selected.device_ops, selected.on_device = self.device_ops, self.on_device
        return selected


def widen_mask(target_mask: np.ndarray, past: int, capacity: int) -> np.ndarray:
    """(B, P+T) -> (B, C+T): the mask of a past fed as C >= P columns, the spare ones masked."""
    if capacity == past:
        return target_mask
    batch, total = target_mask.shape
    wide = np.zeros((batch, capacity + total - past), dtype=bool)
    wide[:, :past] = target_mask[:, :past]
    wide[:, capacity:] = target_mask[:, past:]
    return wide


def narrow_weights(weights: np.ndarray, past: int, capacity: int) -> np.ndarray:
    """(B, h, T, C+T) self-attention weights -> (B, h, T, P+T): the spare columns dropped."""
    if capacity == past:
        return weights
    return np.concatenate([weights[..., :past], weights[..., capacity:]], axis=-1)
