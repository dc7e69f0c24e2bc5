"""Calling the step graph (`decoder_step.onnx`, see `export.step_graph`): one decoder step per
row over that row's own cache, written in place.

`CacheBuffers` holds the keys/values of every decoder layer in fixed (B, h, capacity, d) host
buffers wrapped as OrtValues; `run_step` binds each layer's past and present to the same buffer
(IO binding), so onnxruntime writes each row's new position into it instead of returning a grown
copy. `HostSlots` adds the cross keys/values beside them: the slot buffers of a `SlotBatch`
in host memory (`device_slots.DeviceSlots` keeps them on a device). An int8-cache step graph
takes each row's last source position and the cross keys/values there instead of the source
mask (`graph_io.SOURCE_LAST`, `takes_last_source`): `HostSlots` keeps them beside its slots,
worked out again only after rows join or move (`last_source_columns`). Torch-free.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from service.repository import graph_io
from service.runtime.providers import CUDA, STEP_CACHE_TYPES
from service.runtime.tensors import Tensor, shape, to_numpy


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
        """Copy rows `sources` (their first `columns` columns) onto rows `targets`, in place
        (`copy_rows`)."""
        copy_rows(self.arrays, sources, targets, columns)


def copy_rows(arrays: Sequence[np.ndarray], sources: np.ndarray, targets: np.ndarray,
              columns: int | None = None) -> None:
    """Copy rows `sources` of each (rows, h, columns, d) array onto rows `targets` (each target
    once), their first `columns` columns (all without). A target may be among the sources: every
    source is read before any is written. When none is, each row is copied straight onto its
    target, without the staging copy that reading them all first takes (rows leaving a batch:
    the last rows move into the holes)."""
    kept = slice(None) if columns is None else slice(0, columns)
    pairs = list(zip(sources.tolist(), targets.tolist(), strict=True))
    if {s for s, _ in pairs}.isdisjoint(t for _, t in pairs):
        for array in arrays:
            for source, target in pairs:
                array[target, :, kept] = array[source, :, kept]
        return
    for array in arrays:
        array[targets, :, kept] = array[sources, :, kept]


# per step graph session: whether its cross keys/values are in-place outputs (read once, not per step)
_CROSS_IN_PLACE: weakref.WeakKeyDictionary[ort.InferenceSession, bool] = weakref.WeakKeyDictionary()


def cross_in_place(session: ort.InferenceSession) -> bool:
    """Whether the step graph `session` has its cross keys/values as outputs too
    (`present_cross_*`: a graph whose cross-attention reads each row's own source), to be bound
    to the memory of the inputs of the same name."""
    known = _CROSS_IN_PLACE.get(session)
    if known is None:
        outputs = {o.name for o in session.get_outputs()}
        known = _CROSS_IN_PLACE[session] = graph_io.cross_present_names(1)[0] in outputs  # present_cross_key.0
    return known


def cross_scales(step: ort.InferenceSession) -> list[float] | None:
    """The scales of an int8 step graph's cross keys/values (`graph_io.CROSS_SCALES` in its
    metadata: one per input cross_key.0, cross_value.0, ..., a value being its int8 times the
    scale); None for a float graph."""
    types = {value.name: value.type for value in step.get_inputs()}
    if types.get(graph_io.cross_names(1)[0]) != "tensor(int8)":
        return None
    found = step.get_modelmeta().custom_metadata_map.get(graph_io.CROSS_SCALES)
    if found is None:
        raise ValueError(f"an int8 step graph needs its cross keys/values' scales ({graph_io.CROSS_SCALES})")
    return [float(scale) for scale in json.loads(found)]


# per step graph session: whether it takes each row's last source position (not the source mask)
_LAST_SOURCE: weakref.WeakKeyDictionary[ort.InferenceSession, bool] = weakref.WeakKeyDictionary()


def takes_last_source(session: ort.InferenceSession) -> bool:
    """Whether the step graph `session` takes each row's last source position and the cross
    keys/values there (`graph_io.SOURCE_LAST`, `graph_io.cross_last_names`: an int8-cache graph,
    `export.kv_cache`) instead of `source_mask`."""
    known = _LAST_SOURCE.get(session)
    if known is None:
        known = _LAST_SOURCE[session] = graph_io.SOURCE_LAST in {value.name for value in session.get_inputs()}
    return known


def last_source_arrays(rows: int, cross: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Zeroed arrays for `rows` rows' last source positions and the keys/values there, by input
    name: `source_last` (rows,) int32 and, per cross array (_, h, S, d), its `cross_last_*`
    (rows, 1, h * d) float32."""
    arrays = {graph_io.SOURCE_LAST: np.zeros(rows, dtype=np.int32)}
    for name, array in zip(graph_io.cross_last_names(len(cross) // 2), cross, strict=True):
        arrays[name] = np.zeros((rows, 1, array.shape[1] * array.shape[3]), dtype=np.float32)
    return arrays


def last_source_columns(cross: Sequence[np.ndarray], source_mask: np.ndarray, scales: Sequence[float] | None,
                        out: Mapping[str, np.ndarray], start: int = 0) -> None:
    """Write into rows `start`..len(source_mask)-1 of `out` (`last_source_arrays`) each row's last
    source position (its source length - 1, 0 for an empty source: as the graph clamps it) and,
    per cross array (rows, h, S, d), the key/value there, heads in order: an int8 array's int8
    times its scale from `scales` in float32, as the graph itself would dequantize it."""
    rows = len(source_mask)
    index = np.maximum(source_mask[start:].sum(axis=1), 1) - 1
    out[graph_io.SOURCE_LAST][start:rows] = index
    every = np.arange(start, rows)
    last = [out[name] for name in graph_io.cross_last_names(len(cross) // 2)]
    for i, (array, target) in enumerate(zip(cross, last, strict=True)):
        column = array[every, :, index, :]  # (rows - start, h, d)
        values = column.astype(np.float32)
        if scales is not None:
            values *= np.float32(scales[i])
        target[start:rows, 0] = values.reshape(rows - start, -1)


def last_source_feed(session: ort.InferenceSession, cross: Sequence[np.ndarray],
                     source_mask: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs `source_last` and `cross_last_*` of the step graph `session` for rows of these
    cross keys/values and source mask (`last_source_columns`); empty for a graph that takes the
    source mask."""
    if not takes_last_source(session):
        return {}
    arrays = last_source_arrays(len(source_mask), cross)
    last_source_columns(cross, source_mask, cross_scales(session), arrays)
    return arrays


# the devices that read a step session's bound cache and cross keys/values (`binding_kept`)
_READERS: weakref.WeakKeyDictionary[ort.InferenceSession, frozenset[str]] = weakref.WeakKeyDictionary()


def binding_kept(session: ort.InferenceSession, device: str) -> bool:
    """Whether a binding of the step graph `session` to slot buffers on `device` ("cpu" or
    "cuda") may serve the steps after the one it was made for. onnxruntime copies a bound input
    to the device of the node that reads it when the input is bound (`IOBinding::BindInput`),
    not when the graph runs, so a binding kept over steps would feed every later step that first
    copy of the cache. Kept only when every reader of the bound buffers runs on `device`: the
    cache is read by the attention, which runs on CUDA for a session there when its type has a
    CUDA kernel (`STEP_CACHE_TYPES`) and on the CPU otherwise; the cross keys/values by the
    attention too when it reads each row's own source (`cross_in_place`), else by the session's
    own provider. Each session's readers are worked out once."""
    readers = _READERS.get(session)
    if readers is None:
        on_cuda = session.get_providers()[0] == CUDA
        types = {value.name: value.type for value in session.get_inputs()}

        def attention(kind: str) -> str:
            return "cuda" if on_cuda and kind in STEP_CACHE_TYPES[CUDA] else "cpu"

        cache, cross = graph_io.past_names(1)[0], graph_io.cross_names(1)[0]  # past_key.0, cross_key.0
        readers = _READERS[session] = frozenset({
            attention(types.get(cache, "")),
            attention(types.get(cross, "")) if cross_in_place(session) else "cuda" if on_cuda else "cpu"})
    return readers == {device}


class StepBinding:
    """The step graph bound to the first `count` rows of host buffers: each layer's past and
    present to the same cache buffer, the cross keys/values (and, for a graph whose
    cross-attention reads each row's own source, their `present_cross_*` outputs) to theirs,
    all as OrtValues over the arrays' own memory, so that onnxruntime writes in place. A step
    (`run`) binds only its ids, positions and source mask (and, for the shortlist's step graph,
    its projection columns when they are not the ones bound already).

    Kept for several steps (`reuse_logits`), the binding is made once while the rows stay the
    same, and the logits are written into one array bound after the first step: each step then
    returns that same array, overwritten by the next.

    A graph that takes each row's last source position (`takes_last_source`) has it and the
    cross keys/values there bound from `last` (`last_source_feed`'s arrays, over `count` rows,
    kept up to date by the caller) and is given no source mask."""

    def __init__(self, session: ort.InferenceSession, buffers: CacheBuffers, cross: Sequence[np.ndarray],
                 count: int, reuse_logits: bool = False, last: Mapping[str, np.ndarray] | None = None) -> None:
        self.session = session
        self.count = count
        self.reuse_logits = reuse_logits
        self.kept = binding_kept(session, "cpu")  # else `HostSlots.step` binds the buffers again each step
        self.binding = session.io_binding()
        self.binding.bind_output("logits", "cpu")  # bound first: the first output
        self._logits: np.ndarray | None = None
        self._columns: Mapping[str, np.ndarray] | None = None  # the shortlist's columns bound (kept alive)
        layers = len(buffers.arrays) // 2
        in_place = cross_in_place(session)
        self._values: list[ort.OrtValue] = []  # what the binding reads and writes, kept alive
        self._source_mask = not takes_last_source(session)
        if not self._source_mask:
            if last is None:
                raise ValueError("this step graph takes each row's last source position (source_last)")
            for name, array in last.items():
                self._values.append(ort.OrtValue.ortvalue_from_numpy(array))  # shares the memory
                self.binding.bind_ortvalue_input(name, self._values[-1])
        for name, array in zip(graph_io.cross_names(layers), cross, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))  # shares the memory
            self.binding.bind_ortvalue_input(name, value)
            if in_place:  # a graph whose cross-attention writes into the cross keys/values' buffers
                self.binding.bind_ortvalue_output(f"present_{name}", value)
            self._values.append(value)
        for past, present, value in zip(graph_io.past_names(layers), graph_io.present_names(layers),
                                        buffers.ortvalues(count), strict=True):
            self.binding.bind_ortvalue_input(past, value)
            self.binding.bind_ortvalue_output(present, value)  # the same buffer: written in place
            self._values.append(value)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, source_mask: np.ndarray,
            columns: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """One step (`run_step`'s inputs); the (count, vocab) logits."""
        binding = self.binding
        if columns is not None and columns is not self._columns:  # a new shortlist, of another length maybe:
            for name, array in columns.items():
                binding.bind_cpu_input(name, array)
            binding.bind_output("logits", "cpu")  # the logits onnxruntime allocated for the last one go
            self._columns = columns
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("positions", np.ascontiguousarray(positions, dtype=np.int64))
        if self._source_mask:
            binding.bind_cpu_input("source_mask", np.ascontiguousarray(source_mask, dtype=bool))
        self.session.run_with_iobinding(binding)
        if self._logits is not None:
            return self._logits
        logits: np.ndarray = binding.get_outputs()[0].numpy()  # logits: bound first
        if self.reuse_logits and columns is None:  # the next steps write into an array of ours
            self._logits = np.empty_like(logits)
            self._values.append(ort.OrtValue.ortvalue_from_numpy(self._logits))
            binding.bind_ortvalue_output("logits", self._values[-1])
        return logits


def run_step(session: ort.InferenceSession, input_ids: np.ndarray, positions: np.ndarray,
             source_mask: np.ndarray, cross: list[np.ndarray], buffers: CacheBuffers,
             columns: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """One step of B rows (the first B of `buffers`): (B, 1) ids and positions (each row's
    cached length, < capacity), (B, S) source mask, cross keys/values (cross_key.0,
    cross_value.0, ...: (B, h, S, d)). Writes each row's new key/value into `buffers` at column
    positions[b]; returns the (B, vocab) logits. With `columns`, the shortlist step graph's
    projection inputs (`service.runtime.shortlist.Shortlist.columns` of V' ids): the (B, V')
    logits of those ids. A graph whose
    cross-attention reads each row's own source has the cross keys/values as outputs too
    (`present_cross_*`): they are bound to the same memory as the inputs (`StepBinding`). A graph
    that takes each row's last source position gets it worked out here (`last_source_feed`)."""
    last = last_source_feed(session, cross, source_mask)
    return StepBinding(session, buffers, cross, len(input_ids), last=last or None).run(
        input_ids, positions, source_mask, columns)


class HostSlots:
    """The slot buffers of a `SlotBatch` in host memory: the cache (`CacheBuffers`) and, per
    decoder layer, the cross keys/values (rows, h, width, d) as numpy arrays; slot b's source
    in cross columns 0..its source length-1 (zeros after). The interface `SlotBatch` uses, as
    `device_slots.DeviceSlots` offers it on a device. The cache is of `cache_dtype` and the cross
    keys/values of `cross_dtype` (the step graph's input types); newcomers' cross keys/values of
    another float type are cast as they are written, and with an int8 step graph
    (`export.kv_cache`) quantized to `cross_scales` (the graph quantizes the cache's new
    positions itself)."""

    def __init__(self, layers: int, rows: int, heads: int, capacity: int, head_dim: int, width: int = 0,
                 cache_dtype: type = np.float32, cross_dtype: type = np.float32,
                 cross_scales: Sequence[float] | None = None) -> None:
        self.buffers = CacheBuffers(layers, rows, heads, capacity, head_dim, cache_dtype)
        # cross_key.0, cross_value.0, ...: (slots, h, S, d); the padding past a row's source is masked
        self.cross: list[np.ndarray] = [np.zeros((rows, heads, width, head_dim), dtype=cross_dtype) for _ in range(2 * layers)]
        # int8 cross keys/values: each array's scale (`device_slots.cross_scales`), newcomers quantized to it
        self.cross_scales = list(cross_scales) if cross_scales is not None else None
        if np.issubdtype(cross_dtype, np.integer) and (self.cross_scales is None or len(self.cross_scales) != 2 * layers):
            raise ValueError(f"int8 cross keys/values need {2 * layers} scales, got {cross_scales}")
        self._binding: StepBinding | None = None  # the step graph bound to these buffers (`step`)
        self._clear_last_source()

    def _clear_last_source(self) -> None:
        """No last source positions kept yet (`_last_source`)."""
        self._last: dict[str, np.ndarray] | None = None  # source_last, cross_last_*: over every slot
        self._last_rows = 0  # the first slots they hold (those before any slot written since)

    @property
    def rows(self) -> int:
        return self.buffers.rows

    @property
    def capacity(self) -> int:
        return self.buffers.capacity

    @property
    def width(self) -> int:
        return int(self.cross[0].shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the cache and cross buffers together."""
        return sum(array.nbytes for array in (*self.buffers.arrays, *self.cross))

    def write(self, row: int, cross: Sequence[Tensor]) -> None:
        """Write a group of newcomers' cross keys/values (cross_key.0, cross_value.0, ...:
        (count, h, w, d), w <= width) into slots row..row+count-1, zeros past w."""
        for index, (target, new) in enumerate(zip(self.cross, cross, strict=True)):
            count, _, w, _ = shape(new)
            values = to_numpy(new)
            if self.cross_scales is not None:  # int8: the nearest multiple of the array's scale
                values = np.clip(np.rint(values / self.cross_scales[index]), -127, 127)
            target[row:row + count, :, :w] = values
            target[row:row + count, :, w:] = 0
        self._last_rows = min(self._last_rows, row)

    def move_rows(self, sources: np.ndarray, targets: np.ndarray, columns: int, cross: bool = True) -> None:
        """Copy slots `sources` onto slots `targets` (each target once; a target may be among
        the sources: numpy reads every source before it writes): their first `columns` cache
        columns and, with `cross`, their cross keys/values (without: slots of one source,
        whose cross keys/values are the same already) and the last source positions kept
        beside them (`_last_source`)."""
        self.buffers.move_rows(sources, targets, columns)
        if not cross or not len(targets):
            return
        copy_rows(self.cross, sources, targets)
        if self._last is not None and int(sources.max()) < self._last_rows:  # every source holds them
            for array in self._last.values():
                array[targets] = array[sources]
        else:
            self._last_rows = min(self._last_rows, int(targets.min()))

    def resized(self, rows: int, capacity: int, width: int, kept_rows: int, kept_columns: int) -> HostSlots:
        """Buffers of `rows` slots, `capacity` cache columns and source width `width`, holding
        the first `kept_rows` slots of these: their first `kept_columns` cache columns and their
        cross keys/values up to the narrower width (one copy). A buffer whose shape does not
        change is kept as it is (not copied)."""
        new = HostSlots.__new__(HostSlots)
        new._binding = None
        new._clear_last_source()
        new.cross_scales = self.cross_scales
        new.buffers = self.buffers
        if (rows, capacity) != (self.rows, self.capacity):
            new.buffers = self.buffers.resized(rows, capacity, kept_rows, kept_columns)
        new.cross = self.cross
        if (rows, width) == (self.rows, self.width):
            return new
        kept = min(width, self.width)
        new.cross = []
        for old in self.cross:
            array = np.zeros((rows, old.shape[1], width, old.shape[3]), dtype=old.dtype)
            array[:kept_rows, :, :kept] = old[:kept_rows, :, :kept]
            new.cross.append(array)
        return new

    def step(self, session: ort.InferenceSession, input_ids: np.ndarray, positions: np.ndarray,
             source_mask: np.ndarray, columns: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """One step of the first B slots (`run_step`, B = len(input_ids)); the (B, vocab) logits,
        or with `columns` (the shortlist step graph's projection inputs) the (B, V') logits.
        The graph stays bound to the slots while B and `session` stay the same and every reader
        of the slots runs on the CPU (`StepBinding`, `binding_kept`);
        without `columns` the logits are one array that the next such step overwrites. A graph
        that takes each row's last source position reads it from arrays beside the slots
        (`_last_source`)."""
        count = len(input_ids)
        last = self._last_source(count, source_mask) if takes_last_source(session) else None
        bound = self._binding
        if bound is None or bound.session is not session or bound.count != count or not bound.kept:
            views = None if last is None else {name: array[:count] for name, array in last.items()}
            bound = self._binding = StepBinding(session, self.buffers, [c[:count] for c in self.cross], count,
                                                reuse_logits=True, last=views)
        return bound.run(input_ids, positions, source_mask, columns)

    def _last_source(self, count: int, source_mask: np.ndarray) -> dict[str, np.ndarray]:
        """The arrays of every slot's last source position and cross keys/values there
        (`last_source_columns`), worked out from `source_mask` for those of the first `count` slots
        that do not hold them already (slots written since; slots moved take theirs along).
        Allocated once per buffers, so a binding to them stays valid as they are rewritten."""
        if self._last is None:
            self._last = last_source_arrays(self.rows, self.cross)
        if count > self._last_rows:
            last_source_columns([c[:count] for c in self.cross], source_mask, self.cross_scales, self._last,
                                start=self._last_rows)
            self._last_rows = count
        return self._last
