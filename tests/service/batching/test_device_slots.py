"""`SlotBatch` with its slot buffers on the device (`DeviceSlots`), driven here on the CPU
device through the same graphs as on CUDA: it decodes exactly what the host-buffer batch and
each row alone decode, while rows join at different steps, leave, and the slots, cache columns
and source width grow and shrink; the buffer operations match the host buffers' one by one."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnxruntime as ort
import pytest

from service.batching.slot_batch import SlotBatch, slots_on_device
from service.generation.search import GenerationResult, generate
from service.repository import graph_io
from service.repository.manifest import read_manifest
from service.runtime import CPU, ModelRuntime, device_slots, onnx_proto
from service.runtime.device_slots import (
    DeviceSlots,
    pad_graph,
    slot_graphs,
    zeros_graph,
)
from service.runtime.step_buffers import HostSlots

EOS = 3


@pytest.fixture(scope="module")
def bound(tiny_model_repository) -> ModelRuntime:
    """The tiny repository with IO binding on the CPU: the encoder's cross keys/values come as
    OrtValues, as they do on CUDA."""
    return ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", io_binding=True)


def _schedule(runtime: ModelRuntime, sources: list[list[int]], on_device: bool, seed: int,
              limits: list[int]) -> tuple[dict[int, GenerationResult], list[tuple[int, int, int]]]:
    """Rows join 0-3 at a time at random steps of one batch that starts with 2 slots of 2
    columns (growing by 2); returns every row's result and the (slots, columns, source width) after each step."""
    batch: SlotBatch[int] = SlotBatch(runtime, rows=2, capacity=2, quantum=2, on_device=on_device,
                                      keep_bytes=0)
    assert batch.on_device is on_device
    rng = np.random.default_rng(seed)
    pending = list(range(len(sources)))
    results: dict[int, GenerationResult] = {}
    sizes = []
    while pending or len(batch):
        take = [pending.pop(int(rng.integers(len(pending)))) for _ in range(min(len(pending), int(rng.integers(0, 4))))]
        if take:
            batch.concatenate([sources[i] for i in take], take, [limits[i] for i in take])
        results.update(batch.generate_token())
        sizes.append((batch.slots, batch.capacity, batch.source_len))
    return results, sizes


def _limits(sources: list[list[int]], seed: int) -> list[int]:
    """Each row's max_new_tokens of a schedule."""
    return [int(n) for n in np.random.default_rng(seed + 10).integers(1, 15, len(sources))]


Run = tuple[dict[int, GenerationResult], list[tuple[int, int, int]]]


def _assert_same_rows(device: Run, host: Run) -> None:
    """Two runs of one schedule sized their buffers alike and decoded every row alike."""
    assert device[1] == host[1]
    assert {k: (r.tokens, r.finish_reason) for k, r in device[0].items()} == \
           {k: (r.tokens, r.finish_reason) for k, r in host[0].items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_slots_decode_what_host_slots_and_each_row_alone_decode(
        tiny_runtime: ModelRuntime, bound: ModelRuntime, sources, seed: int) -> None:
    limits = _limits(sources, seed)
    host, host_sizes = _schedule(tiny_runtime, sources, False, seed, limits)
    for runtime in (tiny_runtime, bound):  # the encoder's outputs as host arrays, then as OrtValues
        device, device_sizes = _schedule(runtime, sources, True, seed, limits)
        _assert_same_rows((device, device_sizes), (host, host_sizes))
        for owner, result in device.items():
            assert result.score == pytest.approx(host[owner].score, abs=1e-5)
    slots, columns, widths = zip(*host_sizes, strict=True)
    # the schedule grew and shrank every dimension (else it tests less than it says)
    for sizes in (slots, columns, widths):
        assert max(sizes) > sizes[0] and any(b < a for a, b in itertools.pairwise(sizes))
    for i, source in enumerate(sources):
        alone = generate(tiny_runtime, [source], 1, limits[i])[0]
        assert (host[i].tokens, host[i].finish_reason) == (alone.tokens, alone.finish_reason)


def test_slots_whose_readers_run_elsewhere_bind_the_step_graph_at_every_step(
        bound: ModelRuntime, sources, monkeypatch) -> None:
    """Where a reader of the slots runs on another device (`binding_kept` False: onnxruntime would
    feed a kept binding's first copy of the cache to every later step), device and host slots
    bind the step graph afresh at each step and decode what a kept binding decodes (here on the
    CPU, where both are right)."""
    from service.runtime import step_buffers

    limits = _limits(sources, 0)
    kept = {on_device: _schedule(bound, sources, on_device, 0, limits) for on_device in (True, False)}
    binds = []
    original_bind = DeviceSlots._bind
    monkeypatch.setattr(DeviceSlots, "_bind", lambda self, session, count: binds.append(count)
                        or original_bind(self, session, count))
    made = []
    original_init = step_buffers.StepBinding.__init__
    monkeypatch.setattr(step_buffers.StepBinding, "__init__", lambda self, *a, **k: made.append(1)
                        or original_init(self, *a, **k))
    kept_binds = len(_schedule(bound, sources, True, 0, limits)[1]), len(binds)
    assert kept_binds[1] < kept_binds[0]  # kept: bound again only when the row count changes
    monkeypatch.setattr(device_slots, "binding_kept", lambda session, device: False)
    monkeypatch.setattr(step_buffers, "binding_kept", lambda session, device: False)
    binds.clear()
    device = _schedule(bound, sources, True, 0, limits)
    assert len(binds) == len(device[1])  # one binding per step
    _assert_same_rows(device, kept[True])
    made.clear()
    host = _schedule(bound, sources, False, 0, limits)
    assert len(made) == len(host[1])
    _assert_same_rows(host, kept[False])


def test_a_join_writes_into_the_device_buffers_in_place(bound: ModelRuntime, sources) -> None:
    batch: SlotBatch[int] = SlotBatch(bound, rows=8, on_device=True)
    longest = max(sources, key=len)
    batch.concatenate([longest], [0], [12])
    batch.generate_token()
    slots = batch._slots
    assert isinstance(slots, DeviceSlots)
    addresses = [v.data_ptr() for v in slots.cache + slots.cross]
    assert all(isinstance(v, ort.OrtValue) and v.device_name() == "cpu" for v in slots.cache + slots.cross)
    batch.concatenate(sources[:3], [1, 2, 3], [12, 12, 12])  # room in the slots, sources no wider
    batch.generate_token()
    assert batch._slots is slots and [v.data_ptr() for v in slots.cache + slots.cross] == addresses
    results: dict[int, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    for owner, source in enumerate([longest, *sources[:3]]):
        assert results[owner].tokens == generate(bound, [source], 1, 12)[0].tokens


def test_a_step_binds_the_cross_outputs_to_the_cross_buffers(bound: ModelRuntime, sources, monkeypatch) -> None:
    """The step graph's cross-attention reads each row's own source with the cross keys/values as
    its in-place past: a step binds its `present_cross_*` outputs to the slots' cross buffers,
    so onnxruntime allocates no copy of them."""
    assert bound.step is not None
    layers = bound.manifest.config.n_decoder_layers
    assert set(graph_io.cross_present_names(layers)) <= {o.name for o in bound.step.get_outputs()}
    batch: SlotBatch[int] = SlotBatch(bound, rows=4, on_device=True)
    batch.concatenate(sources[:3], [0, 1, 2], [12, 12, 12])
    bound_outputs: dict[str, int] = {}
    graphs = type(slot_graphs(CPU, "cpu", 0))
    original = graphs.bind_view

    def spy(self, binding, name, value, shape, row=0, output=False) -> None:
        if output:
            bound_outputs[name] = value.data_ptr()
        original(self, binding, name, value, shape, row, output)

    monkeypatch.setattr(graphs, "bind_view", spy)
    batch.generate_token()
    slots = batch._slots
    assert isinstance(slots, DeviceSlots)
    before = [v.numpy().copy() for v in slots.cross]
    assert {n: a for n, a in bound_outputs.items() if n.startswith("present_cross_")} == {
        name: value.data_ptr() for name, value in zip(graph_io.cross_present_names(layers), slots.cross, strict=True)}
    batch.generate_token()
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, slots.cross, strict=True))  # written unchanged


def test_the_device_is_chosen_where_the_runtime_keeps_tensors_off_the_cpu(tiny_runtime: ModelRuntime,
                                                                          bound: ModelRuntime) -> None:
    assert not slots_on_device(tiny_runtime) and not slots_on_device(bound)  # the CPU: host buffers
    assert not SlotBatch(bound).on_device
    assert slots_on_device(dataclasses.replace(bound, device="cuda"))
    assert not slots_on_device(dataclasses.replace(tiny_runtime, device="cuda"))  # no IO binding


# -- the buffer operations, one by one, against the host buffers ------------------------------

LAYERS, HEADS, HEAD_DIM = 2, 3, 4


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _same(device: DeviceSlots, host: HostSlots, rows: int, columns: int, cross_dtype: type = np.float32) -> None:
    """The first `rows` slots agree: cache columns 0..columns-1, the whole cross width."""
    assert (device.rows, device.capacity, device.width) == (host.rows, host.capacity, host.width)
    for value, array in zip(device.cache, host.buffers.arrays, strict=True):
        np.testing.assert_array_equal(value.numpy()[:rows, :, :columns], array[:rows, :, :columns])
    for value, array in zip(device.cross, host.cross, strict=True):
        assert value.numpy().dtype == cross_dtype
        np.testing.assert_array_equal(value.numpy()[:rows], array[:rows].astype(cross_dtype))


@pytest.mark.parametrize("cross_dtype", [np.float32, np.float16])
def test_writes_moves_and_resizes_match_the_host_buffers(cross_dtype: type) -> None:
    rng = np.random.default_rng(0)
    graphs = slot_graphs(CPU, "cpu", 0)
    cross_type = onnx_proto.ONNX_TYPES[np.dtype(cross_dtype)]
    device = DeviceSlots(graphs, LAYERS, 4, HEADS, 6, HEAD_DIM, cross_type=cross_type)
    host = HostSlots(LAYERS, 4, HEADS, 6, HEAD_DIM)
    assert all(not v.numpy().any() for v in device.cache)  # allocated as zeros
    device, host = device.resized(4, 6, 5, 0, 0), host.resized(4, 6, 5, 0, 0)  # a source width, nothing kept
    _same(device, host, 4, 6, cross_dtype)
    # newcomers: 3 rows of width 5 into slots 0-2, 1 row of width 2 (as an OrtValue) into slot 3
    first = [_random(rng, (3, HEADS, 5, HEAD_DIM)).astype(cross_dtype) for _ in range(2 * LAYERS)]
    second = [_random(rng, (1, HEADS, 2, HEAD_DIM)).astype(cross_dtype) for _ in range(2 * LAYERS)]
    for row, cross in ((0, first), (3, [ort.OrtValue.ortvalue_from_numpy(a.astype(np.float32)) for a in second])):
        device.write(row, cross)
        host.write(row, cross)
    for value, array in zip(device.cache, host.buffers.arrays, strict=True):  # a step's writes, in place
        written = _random(rng, (4, HEADS, 6, HEAD_DIM))
        array[:] = written
        value.update_inplace(written)
    _same(device, host, 4, 6, cross_dtype)
    assert not device.cross[0].numpy()[3, :, 2:].any()  # zeros past a row's source
    # slot 3 moves into slot 1, slot 2 into slot 0
    device.move_rows(np.array([3, 2]), np.array([1, 0]), 6)
    host.move_rows(np.array([3, 2]), np.array([1, 0]), 6)
    _same(device, host, 4, 6, cross_dtype)
    # slots 2-3 onto slots 0-1: one run of two rows
    device.move_rows(np.array([2, 3]), np.array([0, 1]), 6)
    host.move_rows(np.array([2, 3]), np.array([0, 1]), 6)
    _same(device, host, 4, 6, cross_dtype)
    # beams changing parents: slots swap and one copies onto another, the cache only
    cross_before = [value.numpy().copy() for value in device.cross]
    cache_before = [value.numpy().copy() for value in device.cache]
    device.move_rows(np.array([1, 0, 0]), np.array([0, 1, 2]), 6, cross=False)
    host.move_rows(np.array([1, 0, 0]), np.array([0, 1, 2]), 6, cross=False)
    _same(device, host, 4, 6, cross_dtype)
    assert all((value.numpy() == before).all() for value, before in zip(device.cross, cross_before, strict=True))
    for value, before in zip(device.cache, cache_before, strict=True):
        assert (value.numpy()[[0, 1, 2]] == before[[1, 0, 0]]).all()
    # grow slots, columns and width, keeping 2 rows' first 5 columns; then shrink all three
    for rows, capacity, width, kept_rows, kept_columns in ((8, 12, 7, 2, 5), (2, 4, 3, 2, 4)):
        device = device.resized(rows, capacity, width, kept_rows, kept_columns)
        host = host.resized(rows, capacity, width, kept_rows, kept_columns)
        _same(device, host, kept_rows, kept_columns, cross_dtype)
        for value in device.cache + device.cross:  # zeros past what was kept
            assert not value.numpy()[kept_rows:].any()
        assert not device.cache[0].numpy()[:, :, kept_columns:].any()
        cache_bytes = 2 * LAYERS * rows * HEADS * capacity * HEAD_DIM * 4
        cross_bytes = 2 * LAYERS * rows * HEADS * width * HEAD_DIM * np.dtype(cross_dtype).itemsize
        assert device.nbytes == cache_bytes + cross_bytes
        assert host.nbytes == cache_bytes + 2 * LAYERS * rows * HEADS * width * HEAD_DIM * 4  # float32 cross


def test_a_move_of_scattered_rows_is_one_call_and_matches_the_host_buffers(monkeypatch) -> None:
    """Departures of 10 scattered rows and a beam-like permutation of them (every target a
    source) leave the device buffers as the host buffers, each move one call of the move graph."""
    rng = np.random.default_rng(3)
    rows = 24
    device = DeviceSlots(slot_graphs(CPU, "cpu", 0), LAYERS, rows, HEADS, 6, HEAD_DIM, width=5)
    host = HostSlots(LAYERS, rows, HEADS, 6, HEAD_DIM, width=5)
    cross = [_random(rng, (rows, HEADS, 5, HEAD_DIM)) for _ in range(2 * LAYERS)]
    device.write(0, cross)
    host.write(0, cross)
    for value, array in zip(device.cache, host.buffers.arrays, strict=True):
        written = _random(rng, (rows, HEADS, 6, HEAD_DIM))
        array[:] = written
        value.update_inplace(written)
    calls: list[str] = []
    run = ort.InferenceSession.run_with_iobinding
    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding",
                        lambda session, binding, *args: calls.append("run") or run(session, binding, *args))
    sources, targets = np.arange(23, 3, -2), np.arange(0, 20, 2)
    for slots in (device, host):
        slots.move_rows(sources, targets, 6)
        slots.move_rows(targets, targets[::-1].copy(), 6, cross=False)  # a permutation: every target a source
    assert len(calls) == 2
    _same(device, host, rows, 6)


def test_a_resize_that_keeps_a_shape_keeps_its_buffers() -> None:
    device = DeviceSlots(slot_graphs(CPU, "cpu", 0), LAYERS, 4, HEADS, 6, HEAD_DIM, width=3)
    wider = device.resized(4, 6, 5, 4, 6)
    assert wider.cache is device.cache and wider.cross is not device.cross
    assert (wider.rows, wider.capacity, wider.width) == (4, 6, 5)
    longer = wider.resized(4, 8, 5, 4, 6)
    assert longer.cross is wider.cross and longer.cache is not wider.cache


def test_a_host_resize_that_keeps_a_shape_keeps_its_buffers() -> None:
    host = HostSlots(LAYERS, 4, HEADS, 6, HEAD_DIM, width=3)
    host.cross[0][:] = 1.0
    wider = host.resized(4, 6, 5, 4, 6)
    assert wider.buffers is host.buffers and wider.cross[0] is not host.cross[0]
    assert (wider.rows, wider.capacity, wider.width) == (4, 6, 5) and wider.cross[0][:, :, :3].all()
    longer = wider.resized(4, 8, 5, 4, 6)  # more cache columns only: the cross keys/values stay where they are
    assert longer.cross is wider.cross and longer.buffers is not wider.buffers
    assert (longer.rows, longer.capacity, longer.width) == (4, 8, 5)


def test_the_slot_graphs_are_valid_onnx() -> None:
    onnx = pytest.importorskip("onnx")
    types = (onnx_proto.FLOAT, onnx_proto.FLOAT16)
    for graph in (pad_graph(types), pad_graph(types, (onnx_proto.FLOAT16, onnx_proto.FLOAT16)),
                  zeros_graph(types)):
        onnx.checker.check_model(onnx.load_from_string(graph), full_check=True)


def test_the_step_graph_is_served_where_its_attention_has_a_kernel(tiny_model_repository) -> None:
    """onnxruntime's CUDA GroupQueryAttention takes float16 caches only: a float32 step graph is
    left out on CUDA unless asked for, kept on the CPU; `step_graph=False` leaves it out anywhere."""
    from service.runtime import CUDA
    from service.runtime.model_runtime import _usable_step

    runtime = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32")
    assert runtime.step is not None
    assert _usable_step("tiny", runtime.step, CPU, None) is runtime.step
    assert _usable_step("tiny", runtime.step, CUDA, None) is None
    assert _usable_step("tiny", runtime.step, CUDA, True) is runtime.step
    assert ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", step_graph=False).step is None


def test_cuda_serves_a_float16_step_graph_by_default(monkeypatch) -> None:
    """A float16 step graph, whose attention has a CUDA kernel, is served on CUDA unless told
    not to (`step_graph=False`), and only when asked for where `STEP_GRAPH_BY_DEFAULT` says no."""
    from types import SimpleNamespace

    from service.runtime import CUDA, model_runtime
    from service.runtime.model_runtime import _usable_step

    class Graph:
        def get_inputs(self) -> list[SimpleNamespace]:
            return [SimpleNamespace(name="past_key.0", type="tensor(float16)")]

        def get_outputs(self) -> list[SimpleNamespace]:
            return [SimpleNamespace(name="logits", type="tensor(float16)")]

    graph = Graph()
    assert _usable_step("m", graph, CUDA, None) is graph
    assert _usable_step("m", graph, CUDA, False) is None
    monkeypatch.setitem(model_runtime.STEP_GRAPH_BY_DEFAULT, CUDA, False)
    assert _usable_step("m", graph, CUDA, None) is None
    assert _usable_step("m", graph, CUDA, True) is graph


def test_a_step_graph_whose_cross_attention_has_no_kernel_is_left_out(monkeypatch) -> None:
    """Cross-attention over each row's own source is `GroupQueryAttention` too: on CUDA both its
    cache and its cross keys/values must be float16 (what `_usable_step` reads of a session:
    its inputs' and outputs' names and types). Checked as if CUDA served step graphs by default."""
    from types import SimpleNamespace

    from service.runtime import CUDA, model_runtime
    from service.runtime.model_runtime import _usable_step

    monkeypatch.setitem(model_runtime.STEP_GRAPH_BY_DEFAULT, CUDA, True)

    class Graph:  # a session's inputs and outputs (weak-referenceable, as sessions are)
        def __init__(self, cache: str, cross: str, cross_outputs: bool) -> None:
            self.inputs = [SimpleNamespace(name="past_key.0", type=cache), SimpleNamespace(name="cross_key.0", type=cross)]
            self.outputs = [SimpleNamespace(name=n, type=cross)
                            for n in ["logits", *(["present_cross_key.0"] * cross_outputs)]]

        def get_inputs(self) -> list[SimpleNamespace]:
            return self.inputs

        def get_outputs(self) -> list[SimpleNamespace]:
            return self.outputs

    half, single = "tensor(float16)", "tensor(float)"
    assert _usable_step("m", (both := Graph(half, half, True)), CUDA, None) is both
    assert _usable_step("m", Graph(half, single, True), CUDA, None) is None  # its cross-attention would leave the GPU
    assert _usable_step("m", (masked := Graph(half, single, False)), CUDA, None) is masked  # products: any type
    assert _usable_step("m", (mixed := Graph(half, single, True)), CPU, None) is mixed



# -- a float16 step graph: the cache type CUDA's attention kernel takes -----------------------

def _fp16_step(repository, providers: list, profile_prefix: str | None = None) -> ort.InferenceSession:
    """The repository's step graph with float16 weights, cache and cross keys/values (graph I/O
    in float16 but ids, positions and mask), as a session of `providers`."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from export.step_graph import STEP_DECODER_FILE
    from export.storage import load_graph

    converted = convert_float_to_float16(load_graph(repository / STEP_DECODER_FILE), keep_io_types=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(converted.SerializeToString(), options, providers=providers)


def _agreeing(results: dict[int, GenerationResult], runtime: ModelRuntime, sources, limits) -> int:
    """Rows whose tokens are those of the float32 merged decoder decoding each row alone."""
    return sum(results[i].tokens == generate(runtime, [s], 1, limits[i])[0].tokens for i, s in enumerate(sources))


def test_float16_slots_hold_what_a_float16_step_graph_takes(tiny_runtime: ModelRuntime, bound: ModelRuntime,
                                                            tiny_model_repository, sources) -> None:
    """Device slots of the step graph's cache and cross types (float16): the encoder's float32
    cross keys/values are cast as they are written; the rows decode the float32 tokens (float16
    arithmetic may move a close call, rarely)."""
    step = _fp16_step(tiny_model_repository, [CPU])
    runtime = dataclasses.replace(bound, step=step)
    limits = [12] * len(sources)
    results, _ = _schedule(runtime, sources, True, 0, limits)
    batch: SlotBatch[int] = SlotBatch(runtime, on_device=True)
    slots = batch._slots
    assert isinstance(slots, DeviceSlots)
    assert (slots.cache_type, slots.cross_type) == (onnx_proto.FLOAT16, onnx_proto.FLOAT16)
    assert _agreeing(results, tiny_runtime, sources, limits) >= len(sources) - 1


def test_the_fp16_variants_step_graph_drives_device_slots_on_the_cpu(tiny_runtime: ModelRuntime,
                                                                      tiny_fp16_repository, sources) -> None:
    """The fp16 variant's own step graph (`decoder_step.fp16.onnx`) with its slots on the "cpu"
    device, fed the fp16 encoder's float32 cross keys/values as OrtValues (IO binding, as on
    CUDA): float16 slots, the tokens of host slots of the same graph through the same joins,
    departures and resizes, and the float32 tokens on most rows."""
    fp16 = ModelRuntime.load(tiny_fp16_repository, [CPU], threads=1, variant="fp16", step_graph=True,
                             io_binding=True)
    assert fp16.step is not None and fp16.device == "cpu"
    batch: SlotBatch[int] = SlotBatch(fp16, on_device=True)
    slots = batch._slots
    assert isinstance(slots, DeviceSlots)
    assert (slots.cache_type, slots.cross_type) == (onnx_proto.FLOAT16, onnx_proto.FLOAT16)
    host_batch: SlotBatch[int] = SlotBatch(fp16, on_device=False)
    assert host_batch._slots.cross[0].dtype == np.float16  # type: ignore[attr-defined]
    for seed in (0, 1):
        limits = _limits(sources, seed)
        device = _schedule(fp16, sources, True, seed, limits)
        _assert_same_rows(device, _schedule(fp16, sources, False, seed, limits))
        assert _agreeing(device[0], tiny_runtime, sources, limits) >= len(sources) - 1


# -- on CUDA (`make gpu-check` runs these; they skip without onnxruntime's CUDA build and a GPU) --

def _cuda_available() -> bool:
    from service.runtime import CUDA

    return ort.get_device() == "GPU" and CUDA in ort.get_available_providers()


def _memcpy_shapes(profile: str) -> list[list[int]]:
    """The shapes of every tensor a Memcpy node (host <-> device) of onnxruntime's profile moved."""
    import json
    from pathlib import Path

    shapes = []
    for event in json.loads(Path(profile).read_text()):
        args = event.get("args", {})
        if event.get("cat") == "Node" and "Memcpy" in str(args.get("op_name", "")):
            for typed in args.get("input_type_shape", []):
                shapes += [list(dims) for dims in typed.values()]
    return shapes


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu with CUDAExecutionProvider")
def test_device_slots_on_cuda_decode_what_host_slots_decode(tiny_runtime: ModelRuntime, tiny_model_repository,
                                                            sources) -> None:
    """The float32 step graph with its slots on the GPU (asked for: its attention runs on the
    CPU there) decodes the CPU host batch's tokens, through joins, departures, growth and
    shrinking: on all rows but one at most, scores within 1e-3 (CUDA multiplies in float32, TF32
    off, but sums in another order than the CPU: the tiny model's close calls may go the other way)."""
    from service.runtime import CUDA

    cuda = ModelRuntime.load(tiny_model_repository, [CUDA], variant="fp32", step_graph=True)
    assert (cuda.provider, cuda.device, cuda.io_binding) == (CUDA, "cuda", True) and cuda.step is not None
    cuda.warmup()
    batch: SlotBatch[int] = SlotBatch(cuda)
    assert batch.on_device and all(v.device_name() == "cuda" for v in batch._slots.cache)  # type: ignore[attr-defined]
    for seed in (0, 1):
        limits = _limits(sources, seed)
        device, _ = _schedule(cuda, sources, True, seed, limits)
        host, _ = _schedule(tiny_runtime, sources, False, seed, limits)
        same = [i for i in host if (device[i].tokens, device[i].finish_reason) == (host[i].tokens, host[i].finish_reason)]
        assert len(same) >= len(sources) - 1
        worst = max(abs(device[i].score - host[i].score) for i in same)
        assert worst <= 1e-3, f"seed {seed}: a score departs from the host's by {worst:.2g}"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu with CUDAExecutionProvider")
def test_no_step_copies_the_cache_between_host_and_device(tiny_runtime: ModelRuntime, tiny_model_repository,
                                                          sources, tmp_path) -> None:
    """A float16 step graph on CUDA (its attention has a CUDA kernel; served when asked) with its
    slots on the GPU: onnxruntime's profiler of the step session sees no Memcpy node move a
    cache or cross key/value tensor (4-D, heads by head_dim), and only a few small copies per
    step (the ids, positions, mask and logits cross by IO binding, not by Memcpy nodes)."""
    from service.runtime import CUDA
    from service.runtime.model_runtime import _usable_step

    cuda = ModelRuntime.load(tiny_model_repository, [CUDA], variant="fp32", step_graph=False)
    step = _fp16_step(tiny_model_repository, [(CUDA, {"device_id": str(cuda.device_id)}), CPU],
                      str(tmp_path / "step"))
    assert _usable_step("tiny", step, CUDA, True) is step
    runtime = dataclasses.replace(cuda, step=step)
    runtime.warmup()
    limits = [12] * len(sources)
    batch: SlotBatch[int] = SlotBatch(runtime)
    assert batch.on_device
    rng = np.random.default_rng(0)
    pending, results, steps = list(range(len(sources))), {}, 0
    while pending or len(batch):
        take = [pending.pop() for _ in range(min(len(pending), int(rng.integers(0, 4))))]
        if take:
            batch.concatenate([sources[i] for i in take], take, [limits[i] for i in take])
        results.update(batch.generate_token())
        steps += 1
    copies = _memcpy_shapes(step.end_profiling())
    heads, head_dim = runtime.n_heads, runtime.head_dim
    cache_copies = [s for s in copies if len(s) == 4 and s[1] == heads and s[3] == head_dim]
    assert not cache_copies, f"{len(cache_copies)} copies of cache tensors in {steps} steps"
    steps += 2  # the warm-up's
    layers = runtime.n_decoder_layers
    assert len(copies) < 2 * layers * steps, f"{len(copies)} host-device copies in {steps} steps"
    assert _agreeing(results, tiny_runtime, sources, limits) >= len(sources) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu with CUDAExecutionProvider")
def test_the_fp16_variant_batches_on_its_step_graph_on_cuda(tiny_runtime: ModelRuntime, tiny_fp16_repository,
                                                             sources) -> None:
    """CUDA prefers the fp16 variant, and its step graph (its float16 cache has a CUDA attention
    kernel) runs with the slots on the GPU; the rows decode the float32 tokens on most rows."""
    from service.runtime import CUDA

    cuda = ModelRuntime.load(tiny_fp16_repository, [CUDA, CPU], variant="fp16", step_graph=True)
    assert (cuda.provider, cuda.device, cuda.variant) == (CUDA, "cuda", "fp16")
    assert cuda.step is not None and CUDA in cuda.step.get_providers()
    cuda.warmup()
    batch: SlotBatch[int] = SlotBatch(cuda)
    assert batch.on_device and all(v.device_name() == "cuda" for v in batch._slots.cache)  # type: ignore[attr-defined]
    limits = [12] * len(sources)
    results, _ = _schedule(cuda, sources, True, 0, limits)
    assert _agreeing(results, tiny_runtime, sources, limits) >= len(sources) - 1
    if read_manifest(tiny_fp16_repository).variants["fp16"].servable:  # measured within 1 point of fp32
        default = ModelRuntime.load(tiny_fp16_repository)
        assert (default.provider, default.variant) == (CUDA, "fp16") and default.step is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu with CUDAExecutionProvider")
def test_host_slots_of_a_cuda_step_graph_decode_what_device_slots_decode(tiny_fp16_repository, sources) -> None:
    """The fp16 step graph on CUDA with its slots in host memory (its attention reads them on the
    GPU, so each step binds them afresh: `binding_kept`) decodes what its slots on the GPU decode,
    through joins, departures and resizes."""
    from service.runtime import CUDA

    cuda = ModelRuntime.load(tiny_fp16_repository, [CUDA, CPU], variant="fp16", step_graph=True)
    assert cuda.provider == CUDA and cuda.step is not None
    for seed in (0, 1):
        limits = _limits(sources, seed)
        device = _schedule(cuda, sources, True, seed, limits)
        host = _schedule(cuda, sources, False, seed, limits)
        same = [i for i in host[0] if (host[0][i].tokens, host[0][i].finish_reason)
                == (device[0][i].tokens, device[0][i].finish_reason)]
        assert len(same) >= len(sources) - 1  # the same kernels; fp16 rounding may tip one close call


def test_newcomers_to_device_slots_are_encoded_in_one_call(tiny_runtime: ModelRuntime, bound: ModelRuntime,
                                                           sources) -> None:
    """On a device an encoder call costs its launches, not its padding: a join's newcomers are
    encoded together there, in groups of similar length with host slots."""
    from service.batching.in_flight import encode_newcomers

    newcomers = [[4, 5, EOS], *sources[:6], [19] * 30 + [EOS]]
    owners, limits = list(range(len(newcomers))), [4] * len(newcomers)
    on_device = SlotBatch(bound, on_device=True)
    host = SlotBatch(tiny_runtime)
    assert not host.on_device
    device_groups, _ = encode_newcomers(bound, newcomers, owners, limits, None, on_device.padding_slack)
    host_groups, _ = encode_newcomers(tiny_runtime, newcomers, owners, limits, None, host.padding_slack)
    assert len(device_groups) == 1 and len(host_groups) > 1
    on_device.concatenate(newcomers, owners, limits)
    host.concatenate(newcomers, owners, limits)
    finished = {}
    while len(on_device) or len(host):
        finished.update({("device", o): r.tokens for o, r in on_device.generate_token()})
        finished.update({("host", o): r.tokens for o, r in host.generate_token()})
    assert all(finished[("device", o)] == finished[("host", o)] for o in owners)
