"""Write a variant's graphs with their weights in one shared external-data file.

The encoder and the decoder both hold the (tied) embedding matrix: vocab x d_model, 8 MB in
fp32 for our 8000 x 256 models. Saved as self-contained .onnx files it is stored in each;
here every large initializer goes to `weights.bin` beside the graphs (ONNX's standard external
data), deduplicated by content, so the tied matrix is stored once per variant. With
`bfloat16_weights` (the fp32 variant, whose weights are all bfloat16 numbers), each large float
initializer `W` is stored as a bfloat16 initializer `W.bf16` followed by a node
`Cast(W.bf16) -> W`: half the bytes, the same float32 values, and a graph that plain
`onnxruntime.InferenceSession(path)` loads (it folds the Casts once, when it builds the session).
`load_graph` gives back the float32 graph as it was exported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

WEIGHTS_FILE = "weights.bin"
BFLOAT16_SUFFIX = ".bf16"  # initializer W stored as W.bf16 and a Cast back to W
MIN_EXTERNAL_BYTES = 1024  # smaller tensors stay inside the graph
ALIGNMENT = 64


def _raw(tensor: onnx.TensorProto) -> bytes:
    """The tensor's bytes, converting the typed fields (float_data, ...) to raw_data first."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ValueError(f"{tensor.name}: external data must be loaded before saving")
    if not tensor.HasField("raw_data"):
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
    return tensor.raw_data


class NotBfloat16(ValueError):
    """A weight to store as bfloat16 holds a float32 value that is not a bfloat16 number."""


FLOAT16_SMALLEST_NORMAL = 2.0**-14


def _casts_to(source: np.ndarray, float16_raw: bytes) -> bool:
    """Whether casting `source` to float16 gives the weights `float16_raw`, but for values below
    float16's normal range (converters clip those to its smallest subnormal, a cast rounds them)."""
    if source.size * 2 != len(float16_raw):
        return False
    cast = source.astype("<f2").ravel()
    given = np.frombuffer(float16_raw, dtype="<f2")
    differ = cast.view("<u2") != given.view("<u2")
    return bool(np.all(np.abs(source.ravel()[differ]) < FLOAT16_SMALLEST_NORMAL))


def store_as_bfloat16(graph: onnx.ModelProto,
                      float32_sources: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Replace each float32 initializer of at least `MIN_EXTERNAL_BYTES` by its bfloat16 form and
    a Cast back to float32 at the head of the graph (in place); returns `graph`. Raises
    `NotBfloat16` when a value would change. A float16 initializer is stored the same way, with a
    Cast to float16, when a Cast gives its values back: from the bfloat16 weight of the same name
    in `float32_sources` (what it was converted from; `_casts_to`), else from its own values when
    they are all bfloat16 numbers; otherwise it stays float16."""
    float32_sources = float32_sources or {}
    casts = []
    for tensor in graph.graph.initializer:
        if tensor.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        raw = _raw(tensor)
        if len(raw) < MIN_EXTERNAL_BYTES:
            continue
        kind = tensor.data_type
        if kind == onnx.TensorProto.FLOAT:
            words = np.frombuffer(raw, dtype="<u4")
            if np.any(words & 0xFFFF):
                raise NotBfloat16(f"{tensor.name}: values that are not bfloat16 numbers")
        else:  # float16 weights converted from bfloat16 ones: stored as those when the Cast gives them back
            source = float32_sources.get(tensor.name)
            if source is not None and _casts_to(source, raw):
                words = np.ascontiguousarray(source, dtype="<f4").view("<u4").ravel()
            else:
                words = np.frombuffer(raw, dtype="<f2").astype("<f4").view("<u4")
            if np.any(words & 0xFFFF):
                continue
        name = tensor.name
        tensor.raw_data = (words >> 16).astype("<u2").tobytes()
        tensor.data_type = onnx.TensorProto.BFLOAT16
        tensor.name = name + BFLOAT16_SUFFIX
        casts.append(helper.make_node("Cast", [tensor.name], [name], name=f"{name}.cast", to=kind))
    nodes = list(graph.graph.node)
    del graph.graph.node[:]
    graph.graph.node.extend(casts + nodes)
    return graph


def restore_float32(graph: onnx.ModelProto) -> onnx.ModelProto:
    """Undo `store_as_bfloat16` (in place; weights loaded): each Cast of a bfloat16 initializer
    `W.bf16` to `W` becomes a float32 (or float16) initializer `W` again; returns `graph`."""
    initializers = {t.name: t for t in graph.graph.initializer}
    kept = []
    for node in graph.graph.node:
        source = initializers.get(node.input[0]) if node.op_type == "Cast" and node.input else None
        if (source is None or source.data_type != onnx.TensorProto.BFLOAT16
                or node.input[0] != node.output[0] + BFLOAT16_SUFFIX):
            kept.append(node)
            continue
        to = next(a.i for a in node.attribute if a.name == "to")
        values = (np.frombuffer(source.raw_data, dtype="<u2").astype("<u4") << 16).view("<f4")
        source.raw_data = values.astype("<f2" if to == onnx.TensorProto.FLOAT16 else "<f4").tobytes()
        source.data_type = to
        source.name = node.output[0]
    del graph.graph.node[:]
    graph.graph.node.extend(kept)
    return graph


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


def _prepared(graphs: Mapping[str, onnx.ModelProto], bfloat16_weights: bool,
              sources: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, onnx.ModelProto]:
    """Copies of `graphs` without `BUILD_MACHINE_METADATA`, their large float weights stored as
    bfloat16 with `bfloat16_weights` (`store_as_bfloat16`, a graph's float32 sources from
    `sources` under its name)."""
    copies = {}
    for name, graph in graphs.items():
        copies[name] = onnx.ModelProto()
        copies[name].CopyFrom(graph)
    prepared = {name: strip_build_metadata(graph) for name, graph in copies.items()}
    if bfloat16_weights:
        prepared = {name: store_as_bfloat16(graph, sources.get(name, {})) for name, graph in prepared.items()}
    return prepared


def _float32_weights(graph: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}


_Stored = dict[tuple[int, tuple[int, ...], str], tuple[int, int]]  # (type, dims, sha256) -> (offset, length)


def _externalize(graphs: Mapping[str, onnx.ModelProto], blob: bytearray, stored: _Stored) -> None:
    """Move every initializer of at least `MIN_EXTERNAL_BYTES` into `blob` (in place), once per
    content: a tensor whose type, dims and bytes are in `stored` refers to those bytes, another
    is appended (at a multiple of `ALIGNMENT`) and added to `stored`."""
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


def _save(directory: Path, graphs: Mapping[str, onnx.ModelProto]) -> list[Path]:
    written = []
    for name, graph in graphs.items():
        path = directory / name
        onnx.save_model(graph, str(path))
        onnx.checker.check_model(str(path))
        written.append(path)
    return written


def save_graphs(directory: str | Path, graphs: dict[str, onnx.ModelProto], bfloat16_weights: bool = False,
                converted_from: Mapping[str, str] | None = None) -> list[Path]:
    """Save {file name: graph} into `directory` with one `weights.bin`; returns the files written.
    Stack traces of the export (`BUILD_MACHINE_METADATA`) are not saved. With
    `bfloat16_weights` the large float32 weights are stored as bfloat16 (`store_as_bfloat16`);
    `converted_from` names, for a float16 graph, the float32 graph of `graphs` it was converted
    from, whose weights it then shares. The graphs passed in are left as they are (copies are
    rewritten)."""
    directory = Path(directory)
    converted_from = converted_from or {}
    sources = {name: _float32_weights(graphs[converted_from[name]]) for name in graphs
               if converted_from.get(name) in graphs}
    prepared = _prepared(graphs, bfloat16_weights, sources)
    directory.mkdir(parents=True, exist_ok=True)
    blob = bytearray()
    _externalize(prepared, blob, {})
    written = []
    if blob:
        (directory / WEIGHTS_FILE).write_bytes(bytes(blob))
        written.append(directory / WEIGHTS_FILE)
    return written + _save(directory, prepared)


def stored_weights(directory: str | Path) -> _Stored:
    """What the graphs in `directory` (its *.onnx files) keep in its `weights.bin`: (element type,
    dims, sha256 of the bytes) -> (offset, length), as `_externalize` indexes it."""
    directory = Path(directory)
    blob = (directory / WEIGHTS_FILE).read_bytes() if (directory / WEIGHTS_FILE).exists() else b""
    stored: _Stored = {}
    for path in sorted(directory.glob("*.onnx")):
        graph = onnx.load_model(str(path), load_external_data=False)
        for tensor in graph.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            entries = {e.key: e.value for e in tensor.external_data}
            if entries.get("location") != WEIGHTS_FILE:
                continue
            offset, length = int(entries["offset"]), int(entries["length"])
            key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(blob[offset:offset + length]).hexdigest())
            stored.setdefault(key, (offset, length))
    return stored


def add_graphs(directory: str | Path, graphs: dict[str, onnx.ModelProto], bfloat16_weights: bool = False,
               converted_from: Mapping[str, onnx.ModelProto] | None = None) -> list[Path]:
    """Save {file name: graph} into `directory` beside the graphs already there, sharing their
    `weights.bin`: a weight whose bytes it holds is read from there, another is appended to it
    (the other graphs' offsets stay valid; the file is not rewritten when nothing is added).
    `bfloat16_weights` and `converted_from` (for a float16 graph, the float32 graph it was
    converted from) as in `save_graphs`. Returns the files written."""
    directory = Path(directory)
    converted_from = converted_from or {}
    sources = {name: _float32_weights(converted_from[name]) for name in graphs if name in converted_from}
    prepared = _prepared(graphs, bfloat16_weights, sources)
    path = directory / WEIGHTS_FILE
    blob = bytearray(path.read_bytes()) if path.exists() else bytearray()
    size = len(blob)
    _externalize(prepared, blob, stored_weights(directory))
    written = []
    if len(blob) != size:
        with path.open("ab") as file:
            file.write(bytes(blob[size:]))
        written.append(path)
    return written + _save(directory, prepared)


def load_graph(path: str | Path) -> onnx.ModelProto:
    """A graph with its external weights loaded into memory, float32 weights as exported
    (`restore_float32`)."""
    return restore_float32(onnx.load_model(str(path), load_external_data=True))
