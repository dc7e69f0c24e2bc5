"""Row selection of OrtValues on their device (`RowGather`), with the tiny ONNX graph it
runs, written without the onnx package (not a serving dependency)."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from service.runtime.providers import CPU, CUDA


class RowGather:
    """Row selection of OrtValues on the device they live on, without a host round-trip.

    onnxruntime's Python API has no tensor indexing, so each call runs a tiny graph: one
    `Gather(axis=0)` per tensor sharing a `rows` input, with IO binding, outputs left on the
    device. Its cost is one device-to-device copy of the rows kept (what numpy indexing costs on
    the host) plus one graph call. Graphs are built here, without the onnx package (not a serving
    dependency), one per tuple of (element type, rank) of the tensors, and cached.
    """

    def __init__(self, provider: str, device: str, device_id: int, threads: int = 0) -> None:
        self.device, self.device_id = device, device_id
        self._providers: list = ([(CUDA, {"device_id": str(device_id)}), CPU] if provider == CUDA else [CPU])
        self._threads = threads
        self._sessions: dict[tuple[tuple[int, int], ...], ort.InferenceSession] = {}
        self._lock = threading.Lock()

    def session(self, tensors: tuple[tuple[int, int], ...]) -> ort.InferenceSession:
        with self._lock:
            session = self._sessions.get(tensors)
            if session is None:
                options = ort.SessionOptions()
                options.intra_op_num_threads = self._threads
                options.inter_op_num_threads = 1
                options.log_severity_level = 3  # no warnings about nodes placed on the CPU
                session = ort.InferenceSession(gather_graph(tensors), options, providers=self._providers)
                self._sessions[tensors] = session
            return session

    def __call__(self, tensors: list[ort.OrtValue], rows: np.ndarray) -> list[ort.OrtValue]:
        session = self.session(tuple((t.element_type(), len(t.shape())) for t in tensors))
        binding = session.io_binding()
        binding.bind_cpu_input("rows", np.ascontiguousarray(rows, dtype=np.int64))
        for i, tensor in enumerate(tensors):
            binding.bind_ortvalue_input(f"x{i}", tensor)
            binding.bind_output(f"y{i}", self.device, self.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()


# -- a minimal ONNX ModelProto writer (protobuf wire format), for `gather_graph` ---------------

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
