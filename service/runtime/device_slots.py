"""The step graph's slot buffers on the session's device (`DeviceSlots`): continuous batching
without a host round-trip of the cache.

`SlotBatch` keeps every row's keys/values in its slot of fixed buffers and the newcomers' cross
keys/values beside them. `step_buffers.HostSlots` keeps those buffers in host memory: on CUDA
every step would copy the cache host -> device -> host. `DeviceSlots` keeps them as OrtValues
allocated on the runtime's device (`OrtValue.ortvalue_from_shape_and_type`), and everything
that touches them runs there:

- the step: IO binding binds each layer's past and present to the same device buffer, so the
  graph writes each row's new key/value in place; the cross keys/values are bound from their
  device buffers; only the token ids, positions and the source mask go in from the host and the
  logits come out to it;
- a newcomer's cross keys/values (the encoder's outputs, already on the device with IO binding)
  are written into its slots on the device, padded to the batch's source width;
- rows moving into the holes of finished rows, and the buffers' growth and shrinking, are tiny
  ONNX graphs (Slice, Pad, Cast, ConstantOfShape, Gather, ScatterND, written with `onnx_proto`)
  run by a session of the runtime's provider, bound in and out by IO binding: a move gathers the
  moving rows of every buffer and scatters them over their targets in place, one call however
  many rows move and wherever they lie (`move_graph`).

Views over the first n rows. OrtValue has no sub-views (no slicing of device memory), but the
buffers are C-contiguous with the slot as the leading dimension, so the first n slots are the
first n/slots of the buffer's memory, and slots r..r+k-1 a contiguous range in it.
`IOBinding.bind_input` / `bind_output` take a raw device address and a shape: the step binds
(n, h, capacity, d) views at the buffers' own addresses and a newcomer's cross keys/values are
written into the address range of its slots. This is the design with the fewest device copies:
a step copies nothing and computes nothing for the free slots (the alternatives cost more: a
step over every slot with the free ones masked computes up to four times the live rows, since
slots shrink only at a quarter's use; buffers re-made at each join or departure copy the whole
cache each time); a join copies only the newcomers' cross keys/values into place; a departure
copies only the moved rows (whole rows: a column range of a row is not contiguous); a resize
copies the live rows once, as on the host.

The buffers hold zeros when allocated (a free slot's stale values are never read: a row reads
its own cache columns 0..its position and its own source width, the padding past it masked).
The cache's element type is the step graph's `past_key.0` type and the cross keys/values' its
`cross_key.0` type; encoder outputs of another float type are cast on the device when written.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import numpy as np
import onnxruntime as ort

from service.repository import graph_io
from service.runtime import onnx_proto
from service.runtime.providers import CPU, CUDA
from service.runtime.step_buffers import binding_kept, cross_in_place
from service.runtime.tensors import Tensor, shape

# onnxruntime's type strings of the slot buffers' element types
ELEMENT_TYPES = {"tensor(float)": onnx_proto.FLOAT, "tensor(float16)": onnx_proto.FLOAT16,
                 "tensor(double)": onnx_proto.DOUBLE, "tensor(int8)": onnx_proto.INT8}


def step_element_types(step: ort.InferenceSession) -> tuple[int, int]:
    """The ONNX element types of the step graph's cache (`past_key.0`) and cross keys/values
    (`cross_key.0`)."""
    types = {i.name: i.type for i in step.get_inputs()}
    return ELEMENT_TYPES[types["past_key.0"]], ELEMENT_TYPES[types["cross_key.0"]]


def step_dtypes(step: ort.InferenceSession) -> tuple[type, type]:
    """The numpy types of the step graph's cache and cross keys/values (`step_element_types`)."""
    cache_type, cross_type = step_element_types(step)
    return onnx_proto.NUMPY_TYPES[cache_type].type, onnx_proto.NUMPY_TYPES[cross_type].type


class SlotGraphs:
    """The tiny graphs `DeviceSlots` runs, as sessions of one execution provider on one device:
    built on first use, one per graph, and shared by every batch on that device (sessions run
    concurrently from several threads)."""

    def __init__(self, provider: str, device: str, device_id: int) -> None:
        self.device, self.device_id = device, device_id
        self._providers: list = ([(CUDA, {"device_id": str(device_id)}), CPU] if provider == CUDA else [CPU])
        self._sessions: dict[tuple, ort.InferenceSession] = {}
        self._lock = threading.Lock()

    def session(self, key: tuple, graph: Callable[[], bytes]) -> ort.InferenceSession:
        """The session of `key`, made from `graph()` the first time (a graph is built once per
        key: building it costs more than running it)."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                options = ort.SessionOptions()
                options.intra_op_num_threads = 1  # a copy of rows: no work to divide
                options.inter_op_num_threads = 1
                options.log_severity_level = 3  # no warnings about the shape inputs placed on the CPU
                session = ort.InferenceSession(graph(), options, providers=self._providers)
                self._sessions[key] = session
            return session

    def bind_view(self, binding: ort.IOBinding, name: str, value: ort.OrtValue, shape: Sequence[int],
                  row: int = 0, output: bool = False) -> None:
        """Bind rows row..row+shape[0]-1 of `value` (C-contiguous, rows leading), at their own
        device address, as input or output `name` of shape `shape`."""
        dtype = onnx_proto.NUMPY_TYPES[value.element_type()]
        dims = value.shape()
        row_bytes = int(np.prod(dims[1:], dtype=np.int64)) * dtype.itemsize
        address = value.data_ptr() + row * row_bytes
        if output:
            binding.bind_output(name, self.device, self.device_id, dtype.type, list(shape), address)
        else:
            binding.bind_input(name, self.device, self.device_id, dtype.type, list(shape), address)


@functools.cache
def slot_graphs(provider: str, device: str, device_id: int) -> SlotGraphs:
    """The one `SlotGraphs` of a provider and device in this process."""
    return SlotGraphs(provider, device, device_id)


# -- the tiny graphs ------------------------------------------------------------------------

_RANK4 = ("rows", "heads", "columns", "head_dim")


def _tensor(name: str, element_type: int, prefix: str = "") -> bytes:
    return onnx_proto.value_info(name, element_type, [f"{prefix}{d}" for d in _RANK4])


def pad_graph(types: tuple[int, ...], casts: tuple[int, ...] | None = None) -> bytes:
    """Inputs `starts`, `ends`, `axes` (1) and `pads` (8) int64 and tensors `x0..`; outputs
    `yi = Pad(Slice(xi, starts, ends, axes), pads)` (with zeros), cast to `casts[i]` first when given
    and different from `types[i]`."""
    nodes = []
    targets = casts if casts is not None else types
    for i, (source, target) in enumerate(zip(types, targets, strict=True)):
        sliced = f"sliced{i}"
        nodes.append(onnx_proto.node("Slice", [f"x{i}", "starts", "ends", "axes"], [sliced], f"slice{i}"))
        if source != target:
            nodes.append(onnx_proto.node("Cast", [sliced], [f"cast{i}"], f"cast{i}", to=target))
            sliced = f"cast{i}"
        nodes.append(onnx_proto.node("Pad", [sliced, "pads"], [f"y{i}"], f"pad{i}"))
    inputs = [onnx_proto.value_info(name, onnx_proto.INT64, [size])
              for name, size in (("starts", 1), ("ends", 1), ("axes", 1), ("pads", 8))]
    inputs += [_tensor(f"x{i}", t, f"x{i}_") for i, t in enumerate(types)]
    outputs = [_tensor(f"y{i}", t, f"y{i}_") for i, t in enumerate(targets)]
    return onnx_proto.model(nodes, inputs, outputs, "slot_pad")


def move_graph(types: tuple[int, ...]) -> bytes:
    """Inputs `sources` (k) and `targets` (k, 1) int64 and tensors `x0..` of `types`; outputs
    `yi = ScatterND(xi, targets, Gather(xi, sources))`: xi with its rows `sources` written over
    its rows `targets`, every row read before any is written. Bound to xi itself, the output is
    xi changed in place (onnxruntime's ScatterND copies nothing when they are one buffer)."""
    nodes = []
    for i in range(len(types)):
        nodes.append(onnx_proto.node("Gather", [f"x{i}", "sources"], [f"rows{i}"], f"gather{i}", axis=0))
        nodes.append(onnx_proto.node("ScatterND", [f"x{i}", "targets", f"rows{i}"], [f"y{i}"], f"scatter{i}"))
    inputs = [onnx_proto.value_info("sources", onnx_proto.INT64, ["moves"]),
              onnx_proto.value_info("targets", onnx_proto.INT64, ["moves", 1])]
    inputs += [_tensor(f"x{i}", t, f"x{i}_") for i, t in enumerate(types)]
    outputs = [_tensor(f"y{i}", t, f"x{i}_") for i, t in enumerate(types)]
    return onnx_proto.model(nodes, inputs, outputs, "slot_move")


def zeros_graph(types: tuple[int, ...]) -> bytes:
    """Input `shape` (4) int64; outputs `yi`: zeros of that shape and `types[i]`."""
    nodes = [onnx_proto.node("ConstantOfShape", ["shape"], ["zeros"], "zeros")]  # float32 zeros
    nodes += [onnx_proto.node("Cast", ["zeros"], [f"y{i}"], f"cast{i}", to=t) for i, t in enumerate(types)]
    inputs = [onnx_proto.value_info("shape", onnx_proto.INT64, [4])]
    outputs = [_tensor(f"y{i}", t, "y_") for i, t in enumerate(types)]
    return onnx_proto.model(nodes, inputs, outputs, "slot_zeros")


# -- the buffers ----------------------------------------------------------------------------

class DeviceSlots:
    """The slot buffers of a `SlotBatch` on a device: per decoder layer the cache's keys and
    values (rows, h, capacity, d) and the cross keys/values (rows, h, width, d), as OrtValues
    of `graphs`' device. Slot b's own cache positions sit in columns 0..its length-1, its
    source in cross columns 0..its source length-1 (zeros after)."""

    shares_buffers = True  # `resized` slots keep a buffer whose shape does not change

    def __init__(self, graphs: SlotGraphs, layers: int, rows: int, heads: int, capacity: int, head_dim: int,
                 width: int = 0, cache_type: int = onnx_proto.FLOAT, cross_type: int = onnx_proto.FLOAT,
                 zeroed: bool = True) -> None:
        self.graphs = graphs
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.cache_type, self.cross_type = cache_type, cross_type
        self.cache = self._allocate((rows, heads, capacity, head_dim), cache_type)  # key.0, value.0, key.1, ...
        self.cross = self._allocate((rows, heads, width, head_dim), cross_type)  # cross_key.0, cross_value.0, ...
        # the step graph bound to the buffers for a row count (`step`): (session, rows, binding,
        # whether the binding may serve the next steps: `binding_kept`)
        self._bound: tuple[ort.InferenceSession, int, ort.IOBinding, bool] | None = None
        if zeroed:
            self._zero(self.cache)
            self._zero(self.cross)

    @property
    def rows(self) -> int:
        return int(self.cache[0].shape()[0])

    @property
    def capacity(self) -> int:
        return int(self.cache[0].shape()[2])

    @property
    def width(self) -> int:
        return int(self.cross[0].shape()[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the cache and cross buffers together, on the device."""
        return sum(int(np.prod(value.shape(), dtype=np.int64)) * onnx_proto.NUMPY_TYPES[value.element_type()].itemsize
                   for value in (*self.cache, *self.cross))

    def _allocate(self, dims: tuple[int, int, int, int], element_type: int) -> list[ort.OrtValue]:
        dtype = onnx_proto.NUMPY_TYPES[element_type].type
        return [ort.OrtValue.ortvalue_from_shape_and_type(list(dims), dtype, self.graphs.device, self.graphs.device_id)
                for _ in range(2 * self.layers)]

    def _zero(self, buffers: list[ort.OrtValue]) -> None:
        """Fill `buffers` (one shape and type) with zeros, on the device."""
        if not int(np.prod(buffers[0].shape())):
            return
        types = tuple(b.element_type() for b in buffers)
        session = self.graphs.session(("zeros", types), lambda: zeros_graph(types))
        binding = session.io_binding()
        binding.bind_cpu_input("shape", np.asarray(buffers[0].shape(), dtype=np.int64))
        for i, buffer in enumerate(buffers):
            binding.bind_ortvalue_output(f"y{i}", buffer)
        session.run_with_iobinding(binding)

    def _pad(self, sources: Sequence[Tensor], targets: list[ort.OrtValue], kept_rows: int, kept_columns: int,
             row: int = 0, rows: int | None = None) -> None:
        """Write the first `kept_rows` rows' first `kept_columns` columns of `sources` (OrtValues
        on the device, or host arrays) into `rows` rows (default `kept_rows`) of `targets` from
        row `row` on, zeros after those rows and columns; cast to the targets' type."""
        rows = kept_rows if rows is None else rows
        columns = targets[0].shape()[2]
        self._run_pad([(source, 0, kept_rows, target, row, rows) for source, target in zip(sources, targets, strict=True)],
                      kept_columns, [0, 0, 0, 0, rows - kept_rows, 0, columns - kept_columns, 0])

    def _run_pad(self, views: list[tuple[Tensor, int, int, ort.OrtValue, int, int]], kept_columns: int,
                 pads: list[int]) -> None:
        """The pad graph over `views`, each (source, its first row, rows read, target, its first
        row, rows written): the rows read of the source, written into the rows of the target
        (each view its own shape past the rows)."""
        types = tuple(_element_type(view[0]) for view in views)
        casts = tuple(view[3].element_type() for view in views)
        session = self.graphs.session(("pad", types, casts), lambda: pad_graph(types, casts))
        binding = session.io_binding()
        binding.bind_cpu_input("starts", np.zeros(1, dtype=np.int64))
        binding.bind_cpu_input("ends", np.array([kept_columns], dtype=np.int64))
        binding.bind_cpu_input("axes", np.array([2], dtype=np.int64))
        binding.bind_cpu_input("pads", np.array(pads, dtype=np.int64))
        for i, (source, source_row, kept_rows, target, target_row, rows) in enumerate(views):
            if isinstance(source, ort.OrtValue):
                self.graphs.bind_view(binding, f"x{i}", source, [kept_rows, *source.shape()[1:]], source_row)
            else:  # a host array (the encoder without IO binding): copied to the device
                binding.bind_cpu_input(f"x{i}", np.ascontiguousarray(source[source_row:source_row + kept_rows]))
            self.graphs.bind_view(binding, f"y{i}", target, [rows, *target.shape()[1:]], target_row, output=True)
        session.run_with_iobinding(binding)

    def write(self, row: int, cross: Sequence[Tensor]) -> None:
        """Write a group of newcomers' cross keys/values (cross_key.0, cross_value.0, ...:
        (count, h, w, d), w <= width) into slots row..row+count-1, zeros past w."""
        count, _, w, _ = shape(cross[0])
        self._pad(cross, self.cross, count, w, row)

    def move_rows(self, sources: np.ndarray, targets: np.ndarray, columns: int, cross: bool = True) -> None:
        """Copy slots `sources` onto slots `targets` (each target once; a target may be among
        the sources: every source is read before any target is written), cache and cross
        keys/values (the cache only without `cross`), in place; whole rows (`columns` is for
        `HostSlots`' interface: a row's first columns are not contiguous in it). One call of the
        move graph (`move_graph`: a Gather and a ScatterND per buffer, written in place) however
        many rows move and wherever they lie."""
        del columns
        buffers = [*self.cache, *self.cross] if cross else list(self.cache)
        types = tuple(buffer.element_type() for buffer in buffers)
        session = self.graphs.session(("move", types), lambda: move_graph(types))
        binding = session.io_binding()
        binding.bind_cpu_input("sources", np.ascontiguousarray(sources, dtype=np.int64))
        binding.bind_cpu_input("targets", np.ascontiguousarray(np.reshape(targets, (-1, 1)), dtype=np.int64))
        for i, buffer in enumerate(buffers):
            binding.bind_ortvalue_input(f"x{i}", buffer)
            binding.bind_ortvalue_output(f"y{i}", buffer)  # the same memory: in place
        session.run_with_iobinding(binding)

    def resized(self, rows: int, capacity: int, width: int, kept_rows: int, kept_columns: int) -> DeviceSlots:
        """Buffers of `rows` slots, `capacity` cache columns and source width `width`, holding
        the first `kept_rows` slots of these: their first `kept_columns` cache columns and their
        cross keys/values up to the narrower width (one copy; zeros elsewhere). A buffer whose
        shape does not change is the same OrtValue (unless these slots' `shares_buffers` is False)."""
        new = DeviceSlots(self.graphs, self.layers, 0, self.heads, 0, self.head_dim, 0,
                          self.cache_type, self.cross_type, zeroed=False)
        for name, size, kept in (("cache", capacity, kept_columns), ("cross", width, min(width, self.width))):
            old: list[ort.OrtValue] = getattr(self, name)
            if self.shares_buffers and old[0].shape()[0] == rows and old[0].shape()[2] == size:
                setattr(new, name, old)
                continue
            buffers = new._allocate((rows, self.heads, size, self.head_dim), old[0].element_type())
            if kept_rows and kept:
                self._pad(old, buffers, kept_rows, kept, rows=rows)
            else:
                new._zero(buffers)
            setattr(new, name, buffers)
        return new

    def step(self, session: ort.InferenceSession, input_ids: np.ndarray, positions: np.ndarray,
             source_mask: np.ndarray) -> np.ndarray:
        """One step of the first B slots (`step_buffers.run_step`'s inputs, B = len(input_ids)):
        past and present bound to the same (B, h, capacity, d) views of the cache buffers,
        cross keys/values to (B, h, width, d) views (and the graph's `present_cross_*` outputs, when
        it has them, to the same views); returns the (B, vocab) logits (float32). The buffers'
        binding is kept while B and `session` stay the same and every reader of the buffers runs
        on their device (`binding_kept`): a step then binds its ids, positions and mask only."""
        count = len(input_ids)
        bound = self._bound
        if bound is None or bound[0] is not session or bound[1] != count or not bound[3]:
            kept = binding_kept(session, self.graphs.device)
            bound = self._bound = (session, count, self._bind(session, count), kept)
        binding = bound[2]
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("positions", np.ascontiguousarray(positions, dtype=np.int64))
        binding.bind_cpu_input("source_mask", np.ascontiguousarray(source_mask, dtype=bool))
        session.run_with_iobinding(binding)
        return np.asarray(binding.get_outputs()[0].numpy(), dtype=np.float32)  # logits: bound first

    def _bind(self, session: ort.InferenceSession, count: int) -> ort.IOBinding:
        """An IO binding of the step graph to views of the first `count` slots of the buffers."""
        binding = session.io_binding()
        binding.bind_output("logits", "cpu")  # first: read back as the first output
        in_place = cross_in_place(session)
        for name, value in zip(graph_io.cross_names(self.layers), self.cross, strict=True):
            view = [count, *value.shape()[1:]]
            self.graphs.bind_view(binding, name, value, view)
            if in_place:  # cross-attention over each row's own source: its outputs are its inputs' memory
                self.graphs.bind_view(binding, f"present_{name}", value, view, output=True)
        for past, present, value in zip(graph_io.past_names(self.layers), graph_io.present_names(self.layers),
                                        self.cache, strict=True):
            view = [count, *value.shape()[1:]]
            self.graphs.bind_view(binding, past, value, view)
            self.graphs.bind_view(binding, present, value, view, output=True)  # the same memory: in place
        return binding


def _element_type(tensor: Tensor) -> int:
    if isinstance(tensor, ort.OrtValue):
        return int(tensor.element_type())
    return onnx_proto.ONNX_TYPES[np.dtype(tensor.dtype)]
