"""A lone row's slot buffers at fixed shapes and addresses, stepped by the step graph with its
dimensions fixed, on CUDA replayed as a CUDA graph.

A request alone in the running batch decodes one row; on a GPU each of its steps launches the
step graph's kernels one by one and waits where onnxruntime placed shape arithmetic on the CPU,
which is what a single request's latency is made of there. With every dimension fixed (one row,
`max_target_len` cache columns, `max_source_len` source width: `fixed_dimensions`) onnxruntime
folds that arithmetic into constants at load, and on CUDA a session whose inputs and outputs are
all bound once at fixed device addresses can capture a step as a CUDA graph and replay it
(`enable_cuda_graph`). The graph reads each row's own cache and source lengths, so the spare
columns and width cost no attention (`bench.static_step` measures each way).

`LoneSlots` are `DeviceSlots` of one row at those shapes, with their own step session bound once:
`SlotBatch` decodes a greedy row that arrives at an empty batch in them, and copies it into
ordinary device slots (`resized`) when other rows join. A runtime has one (its CUDA graph holds
their addresses): a batch `take`s it and gives it back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from service.repository import graph_io
from service.runtime.device_slots import DeviceSlots, SlotGraphs, slot_graphs, step_element_types
from service.runtime.providers import CUDA, execution_providers, session_options
from service.runtime.tensors import Tensor

if TYPE_CHECKING:
    from service.runtime.model_runtime import ModelRuntime


def fixed_dimensions(max_target_len: int, max_source_len: int) -> dict[str, int]:
    """The step graph's free dimensions, fixed for a lone row at the model's limits."""
    return {"batch": 1, "capacity": max_target_len, "source_len": max_source_len}


def lone_providers(provider: str, cuda_graph: bool = False, device_id: int = 0,
                   gpu_memory_limit_mb: int = 0) -> list[str | tuple[str, dict[str, str]]]:
    """The model sessions' providers (`execution_providers`: the memory cap, TF32 off), on CUDA
    on `device_id` and with `cuda_graph` onnxruntime's graph capture on."""
    providers = execution_providers(provider, gpu_memory_limit_mb)
    if provider != CUDA:
        return providers
    first = providers[0]
    options = dict(first[1]) if isinstance(first, tuple) else {}
    options["device_id"] = str(device_id)
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return [(CUDA, options), *providers[1:]]


def lone_session(path: str | Path, provider: str, dimensions: dict[str, int], cuda_graph: bool = False,
                 threads: int = 0, device_id: int = 0, fold_dequantize: bool = False,
                 gpu_memory_limit_mb: int = 0) -> ort.InferenceSession:
    """The step graph at `path` in a session with `dimensions` fixed, on `provider` (on CUDA, with
    `cuda_graph`, onnxruntime's graph capture on: every node must then run on CUDA), with the
    model sessions' options (`session_options`: `fold_dequantize` for int8 graphs) and providers
    (`lone_providers`: `gpu_memory_limit_mb` caps its CUDA arena as the model's sessions')."""
    options = session_options(threads, spinning=False, fold_dequantize=fold_dequantize)
    for name, value in dimensions.items():
        options.add_free_dimension_override_by_name(name, value)
    providers = lone_providers(provider, cuda_graph, device_id, gpu_memory_limit_mb)
    return ort.InferenceSession(str(path), options, providers=providers)


class LoneSlots(DeviceSlots):
    """One slot of `capacity` cache columns and source width `width` on `graphs`' device, with
    `session` (a step graph of those fixed dimensions) bound once to it: the buffers, the next
    token, position and source mask (device values written in place before each step) and the
    logits. `step` ignores the batch's session and runs this one."""

    shares_buffers = False  # slots resized from these never hold their buffers

    def __init__(self, graphs: SlotGraphs, session: ort.InferenceSession, layers: int, heads: int, head_dim: int,
                 capacity: int, width: int) -> None:
        cache_type, cross_type = step_element_types(session)
        super().__init__(graphs, layers, 1, heads, capacity, head_dim, width, cache_type, cross_type)
        self.session = session
        self._lock = threading.Lock()

        def value(array: np.ndarray) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_numpy(array, graphs.device, graphs.device_id)

        self._token, self._position = value(np.zeros((1, 1), np.int64)), value(np.zeros((1, 1), np.int64))
        self._mask_host = np.zeros((1, width), dtype=bool)
        self._mask = value(self._mask_host)
        vocab = session.get_outputs()[0].shape[-1]
        self._logits = value(np.zeros((1, vocab), dtype=np.float32))
        outputs = {o.name for o in session.get_outputs()}
        binding = self.binding = session.io_binding()
        binding.bind_ortvalue_output("logits", self._logits)
        for name, bound in (("input_ids", self._token), ("positions", self._position), ("source_mask", self._mask)):
            binding.bind_ortvalue_input(name, bound)
        for name, buffer in zip(graph_io.cross_names(layers), self.cross, strict=True):
            binding.bind_ortvalue_input(name, buffer)
            if f"present_{name}" in outputs:  # cross-attention over the row's own source: in place
                binding.bind_ortvalue_output(f"present_{name}", buffer)
        for past, present, buffer in zip(graph_io.past_names(layers), graph_io.present_names(layers), self.cache,
                                         strict=True):
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)  # the same memory: in place

    @classmethod
    def of(cls, runtime: ModelRuntime, session: ort.InferenceSession) -> LoneSlots:
        """The lone slot of `runtime` (on its device, at its model's limits) stepped by `session`."""
        return cls(slot_graphs(runtime.provider, runtime.device, runtime.device_id), session, runtime.n_decoder_layers,
                   runtime.n_heads, runtime.head_dim, runtime.max_target_len, runtime.max_source_len)

    def take(self) -> bool:
        """Claim the slot for one batch; False when another batch holds it."""
        return self._lock.acquire(blocking=False)

    def give_back(self) -> None:
        """Free the slot for any batch (its contents are overwritten by the next row's)."""
        self._lock.release()

    def write(self, row: int, cross: Sequence[Tensor]) -> None:
        """The row's (1, h, w, d) cross keys/values (`DeviceSlots.write`; the mask comes with
        each step)."""
        if row != 0:
            raise ValueError(f"lone slots hold row 0 only, not {row}")
        super().write(row, cross)

    def resized(self, rows: int, capacity: int, width: int, kept_rows: int, kept_columns: int) -> DeviceSlots:
        """These slots when nothing changes, else ordinary `DeviceSlots` of that size holding the
        row (`DeviceSlots.resized`, sharing no buffer: the session replays these addresses)."""
        if (rows, capacity, width) == (1, self.capacity, self.width):
            return self
        return super().resized(rows, capacity, width, kept_rows, kept_columns)

    def step(self, session: ort.InferenceSession, input_ids: np.ndarray, positions: np.ndarray,
             source_mask: np.ndarray) -> np.ndarray:
        """One step of the row (`DeviceSlots.step`'s inputs, one row, the mask `width` wide) on
        this slot's own session; returns the (1, vocab) logits (float32, a fresh array)."""
        if len(input_ids) != 1 or source_mask.shape[1] != self.width:
            raise ValueError(f"lone slots step one row of source width {self.width}, "
                             f"got {len(input_ids)} of {source_mask.shape[1]}")
        self._token.update_inplace(np.ascontiguousarray(input_ids, dtype=np.int64).reshape(1, 1))
        self._position.update_inplace(np.ascontiguousarray(positions, dtype=np.int64).reshape(1, 1))
        if not np.array_equal(source_mask, self._mask_host):  # a new source: written once
            self._mask_host = np.array(source_mask, dtype=bool)
            self._mask.update_inplace(self._mask_host)
        self.session.run_with_iobinding(self.binding)
        return np.array(self._logits.numpy(), dtype=np.float32)
