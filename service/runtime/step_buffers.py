"""Calling the step graph (`decoder_step.onnx`, see `export.step_graph`): one decoder step per
row over that row's own cache, written in place.

`CacheBuffers` holds the keys/values of every decoder layer in fixed (B, h, capacity, d) host
buffers wrapped as OrtValues; `run_step` binds each layer's past and present to the same buffer
(IO binding), so onnxruntime writes each row's new position into it instead of returning a grown
copy. Torch-free.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from service.repository import graph_io


class CacheBuffers:
    """Per decoder layer, key and value buffers (rows, h, capacity, d); row b's positions in
    columns 0..its length-1 (the rest is never read)."""

    def __init__(self, layers: int, rows: int, heads: int, capacity: int, head_dim: int,
                 dtype: type = np.float32) -> None:
        shape = (rows, heads, capacity, head_dim)
        self.arrays: list[np.ndarray] = [np.zeros(shape, dtype=dtype) for _ in range(2 * layers)]  # key.0, value.0, key.1, ...

    @property
    def rows(self) -> int:
        return int(self.arrays[0].shape[0])

    @property
    def capacity(self) -> int:
        return int(self.arrays[0].shape[2])

    def ortvalues(self, rows: int | None = None) -> list[ort.OrtValue]:
        """OrtValues over the first `rows` rows (all by default) of each buffer: the same memory."""
        count = self.rows if rows is None else rows
        return [ort.OrtValue.ortvalue_from_numpy(array[:count]) for array in self.arrays]

    def resized(self, rows: int, capacity: int, kept_rows: int, kept_columns: int) -> CacheBuffers:
        """New buffers of `rows` x `capacity` holding the first `kept_rows` rows' first
        `kept_columns` columns of these (one copy)."""
        layers = len(self.arrays) // 2
        _, heads, _, head_dim = self.arrays[0].shape
        grown = CacheBuffers(layers, rows, heads, capacity, head_dim, self.arrays[0].dtype.type)
        for new, old in zip(grown.arrays, self.arrays, strict=True):
            new[:kept_rows, :, :kept_columns] = old[:kept_rows, :, :kept_columns]
        return grown

    def move_rows(self, sources: np.ndarray, targets: np.ndarray, columns: int) -> None:
        """Copy rows `sources` (their first `columns` columns) onto rows `targets`, in place."""
        for array in self.arrays:
            array[targets, :, :columns] = array[sources, :, :columns]


def run_step(session: ort.InferenceSession, input_ids: np.ndarray, positions: np.ndarray,
             source_mask: np.ndarray, cross: list[np.ndarray], buffers: CacheBuffers) -> np.ndarray:
    """One step of B rows (the first B of `buffers`): (B, 1) ids and positions (each row's
    cached length, < capacity), (B, S) source mask, cross keys/values (cross_key.0,
    cross_value.0, ...: (B, h, S, d)). Writes each row's new key/value into `buffers` at column
    positions[b]; returns the (B, vocab) logits."""
    layers = len(buffers.arrays) // 2
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
    binding.bind_cpu_input("positions", np.ascontiguousarray(positions, dtype=np.int64))
    binding.bind_cpu_input("source_mask", np.ascontiguousarray(source_mask, dtype=bool))
    for name, array in zip(graph_io.cross_names(layers), cross, strict=True):
        binding.bind_cpu_input(name, np.ascontiguousarray(array))
    binding.bind_output("logits", "cpu")
    for past, present, value in zip(graph_io.past_names(layers), graph_io.present_names(layers),
                                    buffers.ortvalues(len(input_ids)), strict=True):
        binding.bind_ortvalue_input(past, value)
        binding.bind_ortvalue_output(present, value)  # the same buffer: written in place
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()  # logits: bound first
