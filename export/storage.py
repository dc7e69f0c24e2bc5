"""Write a variant's two graphs with their weights in one shared external-data file.

The encoder and the decoder both hold the (tied) embedding matrix: vocab x d_model, 8 MB in
fp32 for our 8000 x 256 models. Saved as two self-contained .onnx files it is stored twice;
here every large initializer goes to `weights.bin` beside the graphs, deduplicated by content,
so the tied matrix is stored once per variant. onnxruntime reads external data relative to
the .onnx file; the file name stays inside the variant's folder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx import numpy_helper

WEIGHTS_FILE = "weights.bin"
MIN_EXTERNAL_BYTES = 1024  # smaller tensors stay inside the graph
ALIGNMENT = 64


def _raw(tensor: onnx.TensorProto) -> bytes:
    """The tensor's bytes, converting the typed fields (float_data, ...) to raw_data first."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ValueError(f"{tensor.name}: external data must be loaded before saving")
    if not tensor.HasField("raw_data"):
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
    return tensor.raw_data


def save_graphs(directory: str | Path, graphs: dict[str, onnx.ModelProto]) -> list[Path]:
    """Save {file name: graph} into `directory` with one `weights.bin`; returns the files written.
    The graphs passed in are left as they are (copies are rewritten)."""
    directory = Path(directory)
    copies = {}
    for name, graph in graphs.items():
        copies[name] = onnx.ModelProto()
        copies[name].CopyFrom(graph)
    graphs = copies
    directory.mkdir(parents=True, exist_ok=True)
    blob = bytearray()
    stored: dict[tuple[int, tuple[int, ...], str], tuple[int, int]] = {}  # key -> (offset, length)
    for graph in graphs.values():
        for tensor in graph.graph.initializer:
            if tensor.data_type == onnx.TensorProto.STRING:
                continue
            raw = _raw(tensor)
            if len(raw) < MIN_EXTERNAL_BYTES:
                continue
            key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(raw).hexdigest())
            if key not in stored:
                blob.extend(b"\0" * (-len(blob) % ALIGNMENT))
                stored[key] = (len(blob), len(raw))
                blob.extend(raw)
            offset, length = stored[key]
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for name, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = name, value
    written = []
    if blob:
        (directory / WEIGHTS_FILE).write_bytes(bytes(blob))
        written.append(directory / WEIGHTS_FILE)
    for name, graph in graphs.items():
        path = directory / name
        onnx.save_model(graph, str(path))
        onnx.checker.check_model(str(path))
        written.append(path)
    return written


def load_graph(path: str | Path) -> onnx.ModelProto:
    """A graph with its external weights loaded into memory."""
    return onnx.load_model(str(path), load_external_data=True)
