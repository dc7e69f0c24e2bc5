"""Tensors as the graph calls hand them over, and the few operations the service needs on
tensors that live on a device (IO binding): row selection and concatenation.

onnxruntime's Python API has no tensor indexing or concatenation for `OrtValue`s, so each
operation runs a tiny graph with IO binding, outputs left on the device: one `Gather(axis=0)`
per tensor sharing a `rows` input, or one `Concat` per pair of tensors. Its cost is one
device-to-device copy (what numpy costs on the host) plus one graph call. The graphs are built
here, without the onnx package (not a serving dependency), one per signature of the tensors
(element types and ranks), and cached.
"""

from __future__ import annotations

import threading
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"

# A tensor as the graph calls hand it over: numpy on the host, or an OrtValue on the session's
# device (IO binding).
Tensor: TypeAlias = np.ndarray | ort.OrtValue


def shape(tensor: Tensor) -> tuple[int, ...]:
    """The shape of a numpy array or an OrtValue."""
    return tuple(tensor.shape()) if isinstance(tensor, ort.OrtValue) else tuple(tensor.shape)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A host copy (or view, for a CPU OrtValue) of a tensor."""
    return tensor.numpy() if isinstance(tensor, ort.OrtValue) else tensor


def on_device(tensors: list[Tensor]) -> bool:
    """Whether these tensors are OrtValues (IO binding) rather than host arrays."""
    return bool(tensors) and isinstance(tensors[0], ort.OrtValue)


class DeviceOps:
    """Row selection and concatenation of OrtValues on the device they live on, without a host
    round-trip (see the module's docstring)."""

    def __init__(self, provider: str, device: str, device_id: int, threads: int = 0) -> None:
        self.device, self.device_id = device, device_id
        self._providers: list = ([(CUDA, {"device_id": str(device_id)}), CPU] if provider == CUDA else [CPU])
        self._threads = threads
        self._sessions: dict[tuple[str, tuple[tuple[int, int], ...]], ort.InferenceSession] = {}
        self._lock = threading.Lock()

    def session(self, kind: str, tensors: tuple[tuple[int, int], ...]) -> ort.InferenceSession:
        """The cached graph `kind` ("gather" | "concat") for tensors of these (element type, rank)."""
        with self._lock:
            session = self._sessions.get((kind, tensors))
            if session is None:
                options = ort.SessionOptions()
                options.intra_op_num_threads = self._threads
                options.inter_op_num_threads = 1
                options.log_severity_level = 3  # no warnings about nodes placed on the CPU
                graph = gather_graph(tensors) if kind == "gather" else concat_graph(tensors, axis=2)
                session = ort.InferenceSession(graph, options, providers=self._providers)
                self._sessions[(kind, tensors)] = session
            return session

    def gather(self, tensors: list[ort.OrtValue], rows: np.ndarray) -> list[ort.OrtValue]:
        """`tensor[rows]` of each tensor (rows along axis 0)."""
        session = self.session("gather", _signature(tensors))
        binding = session.io_binding()
        binding.bind_cpu_input("rows", np.ascontiguousarray(rows, dtype=np.int64))
        for i, tensor in enumerate(tensors):
            binding.bind_ortvalue_input(f"x{i}", tensor)
        return self._run(session, binding, len(tensors))

    def concat(self, firsts: list[ort.OrtValue], seconds: list[Tensor]) -> list[ort.OrtValue]:
        """Each pair concatenated along axis 2 (the cache's positions): (B, h, P, d) + (B, h, T, d)."""
        session = self.session("concat", _signature(firsts))
        binding = session.io_binding()
        for i, (first, second) in enumerate(zip(firsts, seconds, strict=True)):
            binding.bind_ortvalue_input(f"x{i}", first)
            if isinstance(second, ort.OrtValue):
                binding.bind_ortvalue_input(f"z{i}", second)
            else:
                binding.bind_cpu_input(f"z{i}", np.ascontiguousarray(second))
        return self._run(session, binding, len(firsts))

    def _run(self, session: ort.InferenceSession, binding: ort.IOBinding, count: int) -> list[ort.OrtValue]:
        for i in range(count):
            binding.bind_output(f"y{i}", self.device, self.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()


def _signature(tensors: list[ort.OrtValue]) -> tuple[tuple[int, int], ...]:
    return tuple((t.element_type(), len(t.shape())) for t in tensors)


# -- a minimal ONNX ModelProto writer (protobuf wire format) -------------------------------

_INT64 = 7  # TensorProto.INT64


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _int(field_number: int, value: int) -> bytes:
    return _varint(field_number << 3) + _varint(value)


def _message(field_number: int, payload: bytes | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(field_number << 3 | 2) + _varint(len(data)) + data


def _value_info(name: str, element_type: int, dims: list[str]) -> bytes:
    """ValueInfoProto: name, TypeProto.tensor_type (elem_type, shape of named dynamic dims)."""
    shape = b"".join(_message(1, _message(2, d)) for d in dims)
    return _message(1, name) + _message(2, _message(1, _int(1, element_type) + _message(2, shape)))


def gather_graph(tensors: tuple[tuple[int, int], ...], opset: int = 13) -> bytes:
    """A serialized ONNX model: inputs `rows` (int64 [n]) and `x0..`, outputs
    `yi = Gather(xi, rows, axis=0)`; `tensors` are the (ONNX element type, rank) of the `xi`."""
    nodes = b"".join(
        _message(1, _message(1, f"x{i}") + _message(1, "rows") + _message(2, f"y{i}") + _message(3, f"gather{i}")
                 + _message(4, "Gather") + _message(5, _message(1, "axis") + _int(3, 0) + _int(20, 2)))
        for i in range(len(tensors)))
    inputs = _message(11, _value_info("rows", _INT64, ["rows"])) + b"".join(
        _message(11, _value_info(f"x{i}", t, [f"x{i}_{a}" for a in range(rank)]))
        for i, (t, rank) in enumerate(tensors))
    outputs = b"".join(
        _message(12, _value_info(f"y{i}", t, ["rows"] + [f"x{i}_{a}" for a in range(1, rank)]))
        for i, (t, rank) in enumerate(tensors))
    graph = nodes + _message(2, "row_gather") + inputs + outputs
    opset_import = _message(1, "") + _int(2, opset)
    return _int(1, 8) + _message(2, "attnserve") + _message(7, graph) + _message(8, opset_import)  # ir_version 8


def concat_graph(tensors: tuple[tuple[int, int], ...], axis: int, opset: int = 13) -> bytes:
    """A serialized ONNX model: inputs `x0..` and `z0..`, outputs `yi = Concat(xi, zi, axis)`;
    `tensors` are the (ONNX element type, rank) of the `xi` (the `zi` alike)."""
    nodes = b"".join(
        _message(1, _message(1, f"x{i}") + _message(1, f"z{i}") + _message(2, f"y{i}") + _message(3, f"concat{i}")
                 + _message(4, "Concat") + _message(5, _message(1, "axis") + _int(3, axis) + _int(20, 2)))
        for i in range(len(tensors)))
    inputs = b"".join(
        _message(11, _value_info(f"{name}{i}", t, [f"{name}{i}_{a}" for a in range(rank)]))
        for name in ("x", "z") for i, (t, rank) in enumerate(tensors))
    outputs = b"".join(
        _message(12, _value_info(f"y{i}", t, [f"y{i}_{a}" for a in range(rank)]))
        for i, (t, rank) in enumerate(tensors))
    graph = nodes + _message(2, "concat") + inputs + outputs
    opset_import = _message(1, "") + _int(2, opset)
    return _int(1, 8) + _message(2, "attnserve") + _message(7, graph) + _message(8, opset_import)  # ir_version 8
