"""`LoneSlots`: a greedy row that arrives at an empty running batch decodes in the runtime's one
lone slot (the step graph at fixed dimensions; on CUDA replayed as a CUDA graph), and moves into
ordinary device slots when other rows join. Driven here on the CPU device (IO binding, no CUDA
graph): the same tokens as host slots and as each row alone."""

from __future__ import annotations

import numpy as np
import pytest

from service.batching.slot_batch import SlotBatch
from service.generation.search import GenerationResult, generate
from service.runtime import CPU, ModelRuntime, onnx_proto
from service.runtime.device_slots import DeviceSlots
from service.runtime.lone_slots import LoneSlots
from tests.service.batching.test_device_slots import _cuda_available, _limits, _schedule

LIMIT = 20


@pytest.fixture(scope="module")
def lone(tiny_model_repository) -> ModelRuntime:
    runtime = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", io_binding=True,
                                lone_step=True)
    runtime.warmup()  # steps the lone slot too
    return runtime


def _drain(batch: SlotBatch[int]) -> dict[int, GenerationResult]:
    results: dict[int, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    return results


def _free(slots: LoneSlots) -> bool:
    if not slots.take():
        return False
    slots.give_back()
    return True


def test_the_lone_slot_is_built_where_asked_for(tiny_model_repository, lone: ModelRuntime, tiny_runtime) -> None:
    """One row at the model's limits, its session's dimensions fixed; not on the CPU by default."""
    slots = lone.lone
    assert isinstance(slots, LoneSlots)
    assert (slots.rows, slots.capacity, slots.width) == (1, lone.max_target_len, lone.max_source_len)
    assert [i.shape for i in slots.session.get_inputs()][:3] == [[1, 1], [1, 1], [1, lone.max_source_len]]
    assert slots.resized(1, slots.capacity, slots.width, 1, 3) is slots
    narrower = slots.resized(1, 4, slots.width, 0, 0)  # the same cross shape: still a buffer of its own
    assert type(narrower) is DeviceSlots and narrower.cross[0] is not slots.cross[0]
    assert tiny_runtime.lone is None
    assert ModelRuntime.load(tiny_model_repository, [CPU], threads=1, io_binding=True).lone is None


def test_rows_alone_one_after_another_decode_in_the_lone_slot(tiny_runtime: ModelRuntime, lone: ModelRuntime,
                                                              sources) -> None:
    """Each request alone takes the lone slot (the last row's cache and cross keys/values left in
    it are never read), decodes what it decodes alone, and gives the slot back when it leaves."""
    assert lone.lone is not None
    batch: SlotBatch[int] = SlotBatch(lone, rows=4, keep_bytes=0, on_device=True)
    for i, source in enumerate(sorted(sources, key=len, reverse=True)):  # each source narrower than the last
        batch.concatenate([source], [i], [LIMIT])
        assert batch._slots is lone.lone and not _free(lone.lone)
        result = _drain(batch)[i]
        alone = generate(tiny_runtime, [source], 1, LIMIT)[0]
        assert (result.tokens, result.finish_reason) == (alone.tokens, alone.finish_reason)
        assert result.score == pytest.approx(alone.score, abs=1e-5)
        assert _free(lone.lone)


@pytest.mark.parametrize("seed", [1, 6])  # schedules in which a row arrives at an empty batch
def test_rows_joining_a_lone_row_take_it_into_device_slots(tiny_runtime: ModelRuntime, lone: ModelRuntime, sources,
                                                           seed: int, monkeypatch) -> None:
    """Rows joining 0-3 at a time at random steps: a row that arrives alone starts in the lone
    slot, and moves into device slots with its cache when others join; every row decodes the
    host batch's tokens."""
    assert lone.lone is not None
    steps = {"lone": 0, "device": 0}
    lone_step, device_step = LoneSlots.step, DeviceSlots.step

    def counted(kind, original):
        def step(self, *args, **kwargs):
            steps[kind] += 1
            return original(self, *args, **kwargs)
        return step

    monkeypatch.setattr(LoneSlots, "step", counted("lone", lone_step))
    monkeypatch.setattr(DeviceSlots, "step", counted("device", device_step))
    limits = _limits(sources, seed)
    host, _ = _schedule(tiny_runtime, sources, False, seed, limits)
    got, _ = _schedule(lone, sources, True, seed, limits)
    assert {k: (r.tokens, r.finish_reason) for k, r in got.items()} == \
           {k: (r.tokens, r.finish_reason) for k, r in host.items()}
    assert all(got[k].score == pytest.approx(host[k].score, abs=1e-5) for k in host)
    assert steps["lone"] and steps["device"]  # both kinds of slots served the schedule
    assert _free(lone.lone)


def test_a_lone_row_joined_after_some_steps_keeps_its_cache(tiny_runtime: ModelRuntime, lone: ModelRuntime,
                                                             sources) -> None:
    """A row decodes alone for three steps, two rows join (the lone row's cache columns and cross
    keys/values copied into device slots), one more later: each decodes what it decodes alone."""
    assert lone.lone is not None
    batch: SlotBatch[int] = SlotBatch(lone, rows=2, capacity=2, quantum=2, on_device=True, keep_bytes=0)
    batch.concatenate([sources[1]], [1], [LIMIT])
    results: dict[int, GenerationResult] = {}
    for _ in range(3):
        assert batch._slots is lone.lone
        results.update(batch.generate_token())
    batch.concatenate([sources[0], sources[2]], [0, 2], [LIMIT, LIMIT])
    assert type(batch._slots) is DeviceSlots and _free(lone.lone)
    # sized as if the batch had grown from its initial size: 3 rows in 4 slots, the 4 columns the
    # lone row needs next, the widest of the three sources (rounded to 2), not the model's limits
    widest = max(len(sources[i]) for i in (0, 1, 2))
    assert (batch.slots, batch.capacity, batch.source_len) == (4, 4, widest + widest % 2)
    results.update(batch.generate_token())
    batch.concatenate([sources[3]], [3], [LIMIT])
    results.update(_drain(batch))
    for i in range(4):
        alone = generate(tiny_runtime, [sources[i]], 1, LIMIT)[0]
        assert (results[i].tokens, results[i].finish_reason) == (alone.tokens, alone.finish_reason)
        assert results[i].score == pytest.approx(alone.score, abs=1e-5)


def test_a_batch_does_not_wait_for_a_lone_slot_another_holds(tiny_runtime: ModelRuntime, lone: ModelRuntime,
                                                             sources) -> None:
    """Two batches of one runtime: the second lone row steps in its batch's own device slots."""
    assert lone.lone is not None
    first: SlotBatch[int] = SlotBatch(lone, on_device=True)
    second: SlotBatch[int] = SlotBatch(lone, on_device=True)
    first.concatenate([sources[0]], [0], [LIMIT])
    second.concatenate([sources[1]], [1], [LIMIT])
    assert first._slots is lone.lone and type(second._slots) is DeviceSlots
    results = {**_drain(second), **_drain(first)}
    for i in (0, 1):
        alone = generate(tiny_runtime, [sources[i]], 1, LIMIT)[0]
        assert (results[i].tokens, results[i].finish_reason) == (alone.tokens, alone.finish_reason)
    assert _free(lone.lone)


def test_groups_and_beam_rows_step_in_device_slots(lone: ModelRuntime, sources) -> None:
    """Only one greedy row arriving at an empty batch takes the lone slot; a row that left with a
    client that went away (`filter`) gives it back too."""
    assert lone.lone is not None
    batch: SlotBatch[int] = SlotBatch(lone, on_device=True)
    batch.concatenate(sources[:2], [0, 1], [LIMIT, LIMIT])
    assert type(batch._slots) is DeviceSlots and _free(lone.lone)
    _drain(batch)
    batch.concatenate([sources[2]], [2], [LIMIT], beam_sizes=[2])
    assert type(batch._slots) is DeviceSlots and _free(lone.lone)
    _drain(batch)
    batch.concatenate([sources[3]], [3], [LIMIT])
    assert batch._slots is lone.lone and not _free(lone.lone)
    batch.filter([])
    assert not len(batch) and _free(lone.lone)


def test_a_lone_slot_that_cannot_be_made_leaves_lone_requests_to_the_batch(tiny_model_repository, monkeypatch,
                                                                           caplog) -> None:
    """onnxruntime's refusal (here a made-up one) is one warning; the runtime serves without."""
    from service.runtime import model_runtime

    def refuse(*args, **kwargs):
        raise RuntimeError("not every node runs on CUDA")

    monkeypatch.setattr(model_runtime, "lone_session", refuse)
    runtime = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, io_binding=True, lone_step=True)
    assert runtime.lone is None and runtime.step is not None
    assert "no lone-row step graph (RuntimeError: not every node runs on CUDA)" in caplog.text


def test_a_lone_rows_source_is_encoded_straight_into_the_slot(lone: ModelRuntime, sources, monkeypatch) -> None:
    """The lone slot's own encoder (one row, the source width fixed) writes the row's cross
    keys/values into the slot's buffers: the batch encoder is not called, the buffers hold what
    it gives over the source's columns, and the row decodes what it decodes alone (above)."""
    slots = lone.lone
    assert slots is not None and slots.encoder is not None
    assert [i.shape for i in slots.encoder.get_inputs()] == [[1, slots.width]]
    source = max(sources, key=len)
    expected = lone.encode(lone.pad([source]))
    calls: list[int] = []
    batch_encode = lone.encode
    monkeypatch.setattr(lone, "encode", lambda *args, **kwargs: calls.append(1) or batch_encode(*args, **kwargs))
    batch: SlotBatch[int] = SlotBatch(lone, rows=4, keep_bytes=0, on_device=True)
    batch.concatenate([source], [0], [LIMIT])
    assert batch._slots is slots and not calls
    for buffer, tensor in zip(slots.cross, [t for pair in zip(expected.cross_keys, expected.cross_values) for t in pair],
                              strict=True):
        wanted = tensor.numpy() if hasattr(tensor, "numpy") else tensor
        assert np.allclose(buffer.numpy()[:, :, :len(source)], wanted, atol=1e-5)
    assert batch._source_mask[0].sum() == len(source)
    _drain(batch)
    assert slots.encodes([source]) and not slots.encodes([source, source])
    assert not slots.encodes([[lone.eos_id] * (slots.width + 1)])  # wider than the slot: the batch encoder


def test_an_fp16_lone_slot_casts_its_encoders_float32_outputs(tiny_fp16_repository, sources) -> None:
    """The fp16 graphs keep float32 outputs and the fp16 step graph's cache is float16: the lone
    encoder writes into float32 buffers of its own, cast into the slot's by one call, and a lone
    row decodes what it decodes in ordinary device slots."""
    runtime = ModelRuntime.load(tiny_fp16_repository, [CPU], threads=1, variant="fp16", step_graph=True,
                                io_binding=True, lone_step=True)
    slots = runtime.lone
    assert slots is not None and slots.encoder is not None and slots._encoded is not None
    assert slots.cross[0].element_type() == onnx_proto.FLOAT16 and slots._encoded[0].element_type() == onnx_proto.FLOAT
    source = max(sources, key=len)
    expected = runtime.encode(runtime.pad([source]))
    batch: SlotBatch[int] = SlotBatch(runtime, rows=4, keep_bytes=0, on_device=True)
    batch.concatenate([source], [0], [LIMIT])
    assert batch._slots is slots
    for buffer, tensor in zip(slots.cross, [t for pair in zip(expected.cross_keys, expected.cross_values) for t in pair],
                              strict=True):
        wanted = tensor.numpy() if hasattr(tensor, "numpy") else tensor
        assert np.allclose(buffer.numpy()[:, :, :len(source)].astype(np.float32), wanted, rtol=1e-2, atol=1e-2)
    got = _drain(batch)[0]
    assert slots.take()  # held: this batch steps its lone row in its own device slots
    plain: SlotBatch[int] = SlotBatch(runtime, rows=4, keep_bytes=0, on_device=True)
    plain.concatenate([source], [0], [LIMIT])
    assert plain._slots is not slots
    expected_row = _drain(plain)[0]
    slots.give_back()
    assert (got.tokens, got.finish_reason) == (expected_row.tokens, expected_row.finish_reason)


def test_a_lone_encoder_that_cannot_be_made_leaves_the_slot_copying(tiny_model_repository, tiny_runtime, monkeypatch,
                                                                    caplog, sources) -> None:
    """A refused lone encoder is one warning: the lone slot stays, its row's source encoded as a
    batch's and copied in, decoding what it decodes alone."""
    def refuse(self, session, pad_id):
        raise ValueError("the encoder's cross outputs are not of the slot's buffers' type")

    monkeypatch.setattr(LoneSlots, "attach_encoder", refuse)
    runtime = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", io_binding=True,
                                lone_step=True)
    assert runtime.lone is not None and runtime.lone.encoder is None
    assert "no lone-row encoder (ValueError: the encoder's cross outputs" in caplog.text
    batch: SlotBatch[int] = SlotBatch(runtime, rows=4, keep_bytes=0, on_device=True)
    batch.concatenate([sources[0]], [0], [LIMIT])
    assert batch._slots is runtime.lone
    result = _drain(batch)[0]
    alone = generate(tiny_runtime, [sources[0]], 1, LIMIT)[0]
    assert (result.tokens, result.finish_reason) == (alone.tokens, alone.finish_reason)


def test_the_lone_session_takes_the_model_sessions_providers() -> None:
    """On CUDA the lone session's provider options are the model sessions' (the memory cap, TF32
    off) plus its device and the graph capture; on the CPU the same plain provider."""
    from service.runtime import CUDA
    from service.runtime.lone_slots import lone_providers
    from service.runtime.providers import execution_providers

    ((name, options), cpu) = lone_providers(CUDA, cuda_graph=True, device_id=1, gpu_memory_limit_mb=512)
    model_options = execution_providers(CUDA, 512)[0][1]  # type: ignore[index]
    assert (name, cpu) == (CUDA, CPU) and options == {**model_options, "device_id": "1", "enable_cuda_graph": "1"}
    assert "enable_cuda_graph" not in lone_providers(CUDA)[0][1]  # type: ignore[index]
    assert lone_providers(CPU, gpu_memory_limit_mb=512) == execution_providers(CPU) == [CPU]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu with CUDAExecutionProvider")
def test_on_cuda_a_lone_row_replays_a_cuda_graph(tiny_fp16_repository, sources) -> None:
    """The fp16 variant on CUDA has a lone slot whose step and encoder sessions replay CUDA
    graphs; rows alone decode in it what they decode in device slots (the same kernels, captured;
    the source padded to the slot's width)."""
    from service.runtime import CUDA

    cuda = ModelRuntime.load(tiny_fp16_repository, [CUDA, CPU], variant="fp16", step_graph=True,
                             gpu_memory_limit_mb=256)
    assert cuda.lone is not None and cuda.lone.graphs.device == "cuda"
    options = cuda.lone.session.get_provider_options()[CUDA]
    assert options.get("enable_cuda_graph") == "1" and options["gpu_mem_limit"] == str(256 * 2**20)
    assert cuda.lone.encoder is not None  # the lone row's encoder, replayed as a CUDA graph too
    assert cuda.lone.encoder.get_provider_options()[CUDA].get("enable_cuda_graph") == "1"
    lone: SlotBatch[int] = SlotBatch(cuda)
    plain: SlotBatch[int] = SlotBatch(cuda)
    assert cuda.lone.take()  # held: `plain` steps its lone rows in its own device slots
    same = 0
    for i, source in enumerate(sources):
        plain.concatenate([source], [i], [LIMIT])
        expected = _drain(plain)[i]
        cuda.lone.give_back()
        lone.concatenate([source], [i], [LIMIT])
        assert lone._slots is cuda.lone
        got = _drain(lone)[i]
        assert cuda.lone.take()
        same += (got.tokens, got.finish_reason) == (expected.tokens, expected.finish_reason)
    cuda.lone.give_back()
    assert same >= len(sources) - 1


def test_a_lone_row_whose_encoding_fails_gives_the_slot_back(lone: ModelRuntime, sources, monkeypatch) -> None:
    from service.batching import slot_batch

    def fail(*args, **kwargs):
        raise RuntimeError("the encoder failed")

    assert lone.lone is not None
    batch: SlotBatch[int] = SlotBatch(lone, on_device=True)
    monkeypatch.setattr(slot_batch, "encode_newcomers", fail)
    with pytest.raises(RuntimeError, match="the encoder failed"):
        batch.concatenate([sources[0]], [0], [LIMIT])
    assert not len(batch) and _free(lone.lone)
