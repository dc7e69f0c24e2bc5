"""Write a variant's two graphs with their weights in one shared external-data file.

The encoder and the decoder both hold the (tied) embedding matrix: vocab x d_model, 8 MB in
fp32 for our 8000 x 256 models. Saved as two self-contained .onnx files it is stored twice;
here every large initializer goes to `weights.bin` beside the graphs, deduplicated by content,
so the tied matrix is stored once per variant. onnxruntime reads external data relative to
the .onnx file; the file name stays inside the variant's folder. With `pack_bfloat16` (weights
that are all bfloat16 numbers), the file is stored packed at half the size as
`weights.bin.bf16` (see `service.repository.packed_weights`) and expanded in memory when served.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx import numpy_helper

from service.repository import packed_weights

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


# Node metadata the exporter fills with the Python stack of each op: source paths of the machine
# that exported the model, nothing a runtime reads.
BUILD_MACHINE_METADATA = ("pkg.torch.onnx.stack_trace",)


def strip_build_metadata(graph: onnx.ModelProto) -> onnx.ModelProto:
    """Drop `BUILD_MACHINE_METADATA` entries from every node (in place); returns `graph`."""
    nodes = [*graph.graph.node, *(node for function in graph.functions for node in function.node)]
    for node in nodes:
        kept = [p for p in node.metadata_props if p.key not in BUILD_MACHINE_METADATA]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    return graph


def save_graphs(directory: str | Path, graphs: dict[str, onnx.ModelProto], pack_bfloat16: bool = False) -> list[Path]:
    """Save {file name: graph} into `directory` with one `weights.bin`; returns the files written.
    Stack traces of the export (`BUILD_MACHINE_METADATA`) are not saved.
    With `pack_bfloat16`, `weights.bin` is written packed (`weights.bin.bf16`), or raises
    `packed_weights.NotBfloat16` when some weight is not a bfloat16 number.
    The graphs passed in are left as they are (copies are rewritten)."""
    directory = Path(directory)
    copies = {}
    for name, graph in graphs.items():
        copies[name] = onnx.ModelProto()
        copies[name].CopyFrom(graph)
    graphs = {name: strip_build_metadata(graph) for name, graph in copies.items()}
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
    if blob and pack_bfloat16:  # checked above against the plain file, then packed
        packed = directory / packed_weights.packed_name(WEIGHTS_FILE)
        packed.write_bytes(packed_weights.pack(bytes(blob)))
        (directory / WEIGHTS_FILE).unlink()
        written[written.index(directory / WEIGHTS_FILE)] = packed
    return written


def load_graph(path: str | Path) -> onnx.ModelProto:
    """A graph with its external weights loaded into memory (from a packed file if so stored)."""
    path = Path(path)
    graph = onnx.load_model(str(path), load_external_data=False)
    files: dict[str, bytes] = {}
    for tensor in graph.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info["location"]
        if location not in files:
            plain, packed = path.parent / location, path.parent / packed_weights.packed_name(location)
            files[location] = (plain.read_bytes() if plain.exists()
                               else packed_weights.read_unpacked(packed).tobytes())
        offset = int(info.get("offset", 0))
        length = int(info.get("length", len(files[location]) - offset))
        tensor.raw_data = files[location][offset:offset + length]
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return graph
