"""Row selection of OrtValues on their device (`RowGather`), with the tiny ONNX graph it
runs, written without the onnx package (not a serving dependency: `onnx_proto`)."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from service.runtime import onnx_proto
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


def gather_graph(tensors: tuple[tuple[int, int], ...], opset: int = 13) -> bytes:
    """A serialized ONNX model: inputs `rows` (int64 [n]) and `x0..`, outputs
    `yi = Gather(xi, rows, axis=0)`; `tensors` are the (ONNX element type, rank) of the `xi`."""
    nodes = [onnx_proto.node("Gather", [f"x{i}", "rows"], [f"y{i}"], f"gather{i}", axis=0)
             for i in range(len(tensors))]
    inputs = [onnx_proto.value_info("rows", onnx_proto.INT64, ["rows"])] + [
        onnx_proto.value_info(f"x{i}", t, [f"x{i}_{a}" for a in range(rank)]) for i, (t, rank) in enumerate(tensors)]
    outputs = [onnx_proto.value_info(f"y{i}", t, ["rows"] + [f"x{i}_{a}" for a in range(1, rank)])
               for i, (t, rank) in enumerate(tensors)]
    return onnx_proto.model(nodes, inputs, outputs, "row_gather", opset)
