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
their addresses): a batch `take`s it and gives it back. The encoder at one row and the source
width fixed (`attach_encoder`; a CUDA graph on CUDA too) writes the row's cross keys/values
straight into the slot's buffers (`encode`): the row's source, padded to the width, costs one
replay and no copy. An encoder whose cross outputs are of another float type than the buffers
(the fp16 graphs keep float32 inputs and outputs; the fp16 step graph's cache is float16) writes
into buffers of its own type at fixed addresses, cast into the slot's by one pad-graph call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from service.repository import graph_io
from service.runtime import onnx_proto
from service.runtime.device_slots import (
    ELEMENT_TYPES,
    DeviceSlots,
    SlotGraphs,
    slot_graphs,
    step_element_types,
)
from service.runtime.providers import CUDA, execution_providers, session_options
from service.runtime.tensors import EncoderState, Tensor

if TYPE_CHECKING:
    from service.runtime.model_runtime import ModelRuntime

# the encoder outputs `attach_encoder` takes: float tensors, cast on the device where not the slot's type
FLOAT_TYPES = (onnx_proto.FLOAT, onnx_proto.FLOAT16, onnx_proto.DOUBLE)


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
    """The graph at `path` (the step graph, or the encoder) in a session with `dimensions` fixed,
    on `provider` (on CUDA, with `cuda_graph`, onnxruntime's graph capture on: every node must
    then run on CUDA), with the model sessions' options (`session_options`: `fold_dequantize` for
    int8 graphs) and providers (`lone_providers`: `gpu_memory_limit_mb` caps its CUDA arena as
    the model's sessions')."""
    options = session_options(threads, spinning=False, fold_dequantize=fold_dequantize)
    for name, value in dimensions.items():
        options.add_free_dimension_override_by_name(name, value)
    providers = lone_providers(provider, cuda_graph, device_id, gpu_memory_limit_mb)
    return ort.InferenceSession(str(path), options, providers=providers)


class LoneSlots(DeviceSlots):
    """One slot of `capacity` cache columns and source width `width` on `graphs`' device, with
    `session` (a step graph of those fixed dimensions) bound once to it: the buffers, the next
    token and its position (one device value, written in place before each step), the source
    mask (written when the source changes) and the logits. `step` ignores the batch's session
    and runs this one."""

    shares_buffers = False  # slots resized from these never hold their buffers

    def __init__(self, graphs: SlotGraphs, session: ort.InferenceSession, layers: int, heads: int, head_dim: int,
                 capacity: int, width: int) -> None:
        cache_type, cross_type = step_element_types(session)
        super().__init__(graphs, layers, 1, heads, capacity, head_dim, width, cache_type, cross_type)
        self.session = session
        self.encoder: ort.InferenceSession | None = None  # `attach_encoder`
        self._encoded: list[ort.OrtValue] | None = None  # the encoder's own outputs, when cast
        self._lock = threading.Lock()
        value = self._value
        # the next token and its position in one buffer, rows 0 and 1: one copy to the device a step
        self._feed_host = np.zeros((2, 1), dtype=np.int64)
        self._feed = value(self._feed_host)
        self._mask_host = np.zeros((1, width), dtype=bool)
        self._mask = value(self._mask_host)
        vocab = session.get_outputs()[0].shape[-1]
        self._logits = value(np.zeros((1, vocab), dtype=np.float32))
        outputs = {o.name for o in session.get_outputs()}
        binding = self.binding = session.io_binding()
        binding.bind_ortvalue_output("logits", self._logits)
        graphs.bind_view(binding, "input_ids", self._feed, (1, 1), row=0)
        graphs.bind_view(binding, "positions", self._feed, (1, 1), row=1)
        binding.bind_ortvalue_input("source_mask", self._mask)
        for name, buffer in zip(graph_io.cross_names(layers), self.cross, strict=True):
            binding.bind_ortvalue_input(name, buffer)
            if f"present_{name}" in outputs:  # cross-attention over the row's own source: in place
                binding.bind_ortvalue_output(f"present_{name}", buffer)
        for past, present, buffer in zip(graph_io.past_names(layers), graph_io.present_names(layers), self.cache,
                                         strict=True):
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)  # the same memory: in place

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        """`array` copied into a new OrtValue on the slot's device."""
        return ort.OrtValue.ortvalue_from_numpy(array, self.graphs.device, self.graphs.device_id)

    def attach_encoder(self, session: ort.InferenceSession, pad_id: int) -> None:
        """Bind `session` (the encoder graph at one row and source width `width`) once: its ids
        (padded with `pad_id`) and, as its outputs, this slot's cross buffers, or, where an
        output is of another float type, a buffer of that type cast into the slot's at each
        `encode`. Raises ValueError when a cross output is not a float tensor of the slot's shape."""
        names = graph_io.cross_names(self.layers)
        outputs = {o.name: o for o in session.get_outputs()}
        encoded: list[ort.OrtValue] = []
        for name, buffer in zip(names, self.cross, strict=True):
            output = outputs.get(name)
            element_type = ELEMENT_TYPES.get(output.type) if output is not None else None
            if output is None or element_type not in FLOAT_TYPES or list(output.shape) != buffer.shape():
                raise ValueError(f"the encoder's {name} is {output.type if output else 'missing'} of shape "
                                 f"{output.shape if output else '-'}, not a float tensor of shape {buffer.shape()}")
            encoded.append(buffer if element_type == buffer.element_type() else ort.OrtValue.ortvalue_from_shape_and_type(
                buffer.shape(), onnx_proto.NUMPY_TYPES[element_type].type, self.graphs.device, self.graphs.device_id))
        self._pad_id = pad_id
        self._ids = self._value(np.full((1, self.width), pad_id, dtype=np.int64))
        binding = session.io_binding()
        binding.bind_ortvalue_input("input_ids", self._ids)
        for name, buffer in zip(names, encoded, strict=True):
            binding.bind_ortvalue_output(name, buffer)
        # the other outputs (the encoder's attention weights) at fixed addresses too, never read:
        # a captured CUDA graph writes where it wrote at the capture
        self._unread = []
        for output in session.get_outputs():
            if output.name not in names:
                scratch = ort.OrtValue.ortvalue_from_shape_and_type(
                    output.shape, onnx_proto.NUMPY_TYPES[ELEMENT_TYPES[output.type]].type, self.graphs.device,
                    self.graphs.device_id)
                binding.bind_ortvalue_output(output.name, scratch)
                self._unread.append(scratch)
        self._encoded = encoded if any(a is not b for a, b in zip(encoded, self.cross, strict=True)) else None
        self.encoder, self._encoder_binding = session, binding

    def encodes(self, sources: Sequence[list[int]]) -> bool:
        """Whether `encode` takes `sources`: one source no wider than the slot, an encoder attached."""
        return self.encoder is not None and len(sources) == 1 and len(sources[0]) <= self.width

    def encode(self, sources: Sequence[list[int]]) -> EncoderState:
        """One source (ids ending with EOS, at most `width`) through the attached encoder, its
        cross keys/values written into this slot's buffers; the state holds those buffers
        (`write` then copies nothing) and the source mask, `width` wide."""
        if self.encoder is None or not self.encodes(sources):
            raise ValueError(f"the lone encoder takes one source of at most {self.width} tokens")
        ids = np.full((1, self.width), self._pad_id, dtype=np.int64)
        ids[0, :len(sources[0])] = sources[0]
        self._ids.update_inplace(ids)
        self.encoder.run_with_iobinding(self._encoder_binding)
        if self._encoded is not None:  # outputs of another float type: cast into the slot's buffers
            self._pad(self._encoded, self.cross, 1, self.width)
        return EncoderState(source_mask=ids != self._pad_id, cross_keys=list(self.cross[0::2]),
                            cross_values=list(self.cross[1::2]))

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
        each step); nothing to copy when they are this slot's own buffers (`encode`)."""
        if row != 0:
            raise ValueError(f"lone slots hold row 0 only, not {row}")
        if len(cross) == len(self.cross) and all(a is b for a, b in zip(cross, self.cross, strict=True)):
            return  # encoded in place (`encode`)
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
        self._feed_host[0, 0] = np.asarray(input_ids).reshape(-1)[0]
        self._feed_host[1, 0] = np.asarray(positions).reshape(-1)[0]
        self._feed.update_inplace(self._feed_host)
        if not np.array_equal(source_mask, self._mask_host):  # a new source: written once
            self._mask_host = np.array(source_mask, dtype=bool)
            self._mask.update_inplace(self._mask_host)
        self.session.run_with_iobinding(self.binding)
        return np.array(self._logits.numpy(), dtype=np.float32)
