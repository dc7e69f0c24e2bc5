"""Continuous batching on the step graph (`SlotBatch`): slots stay dense, the buffers grow and
shrink with copies that keep every row's tokens, and joins never copy the cache. The contract
shared with `RunningBatch` is tested in test_running_batch.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from service.batching.running_batch import RunningBatch
from service.batching.slot_batch import SlotBatch, generate_running
from service.generation.search import GenerationResult, generate
from service.runtime import ModelRuntime

EOS = 3


def _alone(runtime: ModelRuntime, source: list[int], limit: int) -> GenerationResult:
    return generate(runtime, [source], 1, limit)[0]


def _finish(batch: SlotBatch, results: dict) -> None:
    while len(batch):
        results.update(batch.generate_token())


def test_slots_double_columns_and_source_width_grow_by_quantum_and_keep_every_row(
        tiny_runtime: ModelRuntime, sources) -> None:
    batch: SlotBatch[int] = SlotBatch(tiny_runtime, rows=2, capacity=2, quantum=3)
    short = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    batch.concatenate([sources[short[0]]], [short[0]], [14])
    width = batch.source_len
    assert width % 3 == 0 and width >= len(sources[short[0]])
    for _ in range(3):  # 3 steps: the cache outgrows 2 columns
        batch.generate_token()
    assert batch.capacity == 3  # the next multiple of the quantum, not a doubling
    later = short[-5:]  # five longer sources: more rows than slots, a wider source
    batch.concatenate([sources[i] for i in later], later, [14] * 5)
    assert batch.slots == 8 and batch.source_len > width and batch.source_len % 3 == 0
    results: dict[int, GenerationResult] = {}
    _finish(batch, results)
    for owner in [short[0], *later]:
        expected = _alone(tiny_runtime, sources[owner], 14)
        assert (results[owner].tokens, results[owner].finish_reason) == (expected.tokens, expected.finish_reason)


def test_finished_rows_leave_holes_that_the_last_rows_fill(tiny_runtime: ModelRuntime, sources) -> None:
    batch: SlotBatch[str] = SlotBatch(tiny_runtime)
    batch.concatenate(sources[:4], ["a", "b", "c", "d"], [1, 12, 1, 12])
    order = batch.owners  # slot order (sorted by source length)
    finished = [owner for owner, _ in batch.generate_token()]
    assert sorted(finished) == ["a", "c"]
    # survivors in slots 0 and 1: one already there stays, the other moves into the hole
    movers = iter(owner for owner in order[2:] if owner not in finished)
    assert batch.owners == [owner if owner not in finished else next(movers) for owner in order[:2]]
    assert batch._positions[:2].tolist() == [1, 1]  # each with its own position (one step decoded)
    results: dict[str, GenerationResult] = {}
    _finish(batch, results)
    for owner, source in (("b", sources[1]), ("d", sources[3])):
        assert results[owner].tokens == _alone(tiny_runtime, source, 12).tokens


def test_a_join_writes_into_the_buffers_without_copying_them(tiny_runtime: ModelRuntime, sources) -> None:
    batch: SlotBatch[int] = SlotBatch(tiny_runtime, rows=8)
    longest = max(sources, key=len)
    batch.concatenate([longest], [0], [12])
    batch.generate_token()
    assert not batch.on_device  # the CPU: host buffers
    buffers, cross = batch._slots.buffers.arrays[0], batch._slots.cross[0]  # type: ignore[attr-defined]
    batch.concatenate(sources[:3], [1, 2, 3], [12, 12, 12])  # room in the slots, sources no wider
    assert batch._slots.buffers.arrays[0] is buffers and batch._slots.cross[0] is cross  # type: ignore[attr-defined]
    results: dict[int, GenerationResult] = {}
    _finish(batch, results)
    for owner, source in enumerate([longest, *sources[:3]]):
        assert results[owner].tokens == _alone(tiny_runtime, source, 12).tokens


def test_the_buffers_shrink_when_few_rows_are_left(tiny_runtime: ModelRuntime, sources) -> None:
    batch: SlotBatch[int] = SlotBatch(tiny_runtime, rows=2, capacity=4, keep_bytes=0)
    batch.concatenate(sources[:12], list(range(12)), [1] * 11 + [14])
    assert batch.slots == 16
    batch.generate_token()  # eleven rows leave at their token limit
    assert len(batch) == 1 and batch.slots == 2
    results: dict[int, GenerationResult] = {}
    _finish(batch, results)
    assert results[11].tokens == _alone(tiny_runtime, sources[11], 14).tokens


def test_buffers_within_keep_bytes_stay_when_rows_leave(tiny_runtime: ModelRuntime, sources) -> None:
    """Buffers of at most `keep_bytes` are not shrunk: rows that leave (the batch emptied too)
    and a row joining again copy nothing."""
    batch: SlotBatch[int] = SlotBatch(tiny_runtime, rows=2, capacity=4)
    batch.concatenate(sources[:12], list(range(12)), [1] * 11 + [14])
    assert batch.slots == 16 and 0 < batch._slots.nbytes <= batch.keep_bytes
    slots = batch._slots
    batch.generate_token()  # eleven rows leave at their token limit
    assert len(batch) == 1 and batch.slots == 16 and batch._slots is slots
    results: dict[int, GenerationResult] = {}
    _finish(batch, results)
    assert results[11].tokens == _alone(tiny_runtime, sources[11], 14).tokens
    shape, slots = (batch.slots, batch.capacity, batch.source_len), batch._slots  # its columns grew
    assert shape[0] == 16  # the batch is empty: nothing shrunk
    batch.concatenate([sources[0]], [0], [14])
    assert (batch.slots, batch.capacity, batch.source_len) == shape and batch._slots is slots
    _finish(batch, results)
    assert results[0].tokens == _alone(tiny_runtime, sources[0], 14).tokens


def test_the_source_width_shrinks_only_when_a_quarter_of_it_is_in_use(tiny_runtime: ModelRuntime) -> None:
    long, medium, short = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, EOS], [5, 6, 7, EOS], [5, 6, EOS]
    for kept, stays in ((medium, True), (short, False)):
        batch: SlotBatch[str] = SlotBatch(tiny_runtime, quantum=1, keep_bytes=0)
        batch.concatenate([long, kept], ["long", "kept"], [1, 14])
        assert batch.source_len == len(long)
        cross = batch._slots.cross[0]  # type: ignore[attr-defined]
        finished = [owner for owner, _ in batch.generate_token()]  # the long row leaves
        assert finished == ["long"]
        if stays:  # 4 of 12 positions in use: more than a quarter, nothing copied
            assert batch.source_len == len(long) and batch._slots.cross[0] is cross  # type: ignore[attr-defined]
        else:  # 3 of 12: the width shrinks to the rows' own
            assert batch.source_len == len(short)
        results: dict[str, GenerationResult] = {}
        _finish(batch, results)
        assert results["kept"].tokens == _alone(tiny_runtime, kept, 14).tokens


def test_without_a_step_graph_there_is_no_slot_batch(tiny_runtime: ModelRuntime) -> None:
    merged_only = dataclasses.replace(tiny_runtime, step=None)
    with pytest.raises(ValueError, match="step graph"):
        SlotBatch(merged_only)
    from service.core.registry import onnx_running_batch
    from service.core.settings import Settings

    factory = onnx_running_batch(Settings())
    assert isinstance(factory(merged_only)(), RunningBatch)
    assert isinstance(factory(tiny_runtime)(), SlotBatch)


def test_the_step_graph_is_loaded_on_the_cpu_for_each_variant(tiny_model_repository) -> None:
    for variant in ("fp32", "int8"):
        runtime = ModelRuntime.load(tiny_model_repository, providers=["CPUExecutionProvider"], variant=variant)
        assert runtime.step is not None
        assert runtime.manifest.variants[variant].step_decoder.endswith("decoder_step.onnx")
        runtime.warmup()


def test_int8_rows_decode_as_in_the_merged_decoder_batch(tiny_model_repository, sources) -> None:
    """The int8 step graph in a running batch gives the merged int8 decoder's tokens (each row alone)."""
    runtime = ModelRuntime.load(tiny_model_repository, providers=["CPUExecutionProvider"], variant="int8")
    batch: SlotBatch[int] = SlotBatch(runtime)
    rng = np.random.default_rng(1)
    pending = list(range(len(sources)))
    results: dict[int, GenerationResult] = {}
    while pending or len(batch):
        take = [pending.pop() for _ in range(min(len(pending), int(rng.integers(0, 3))))]
        if take:
            batch.concatenate([sources[i] for i in take], take, [12] * len(take))
        results.update(batch.generate_token())
    agree = sum(results[i].tokens == _alone(runtime, sources[i], 12).tokens for i in range(len(sources)))
    # int8 activations are quantized per batch: a neighbour may move a close call, rarely
    assert agree >= len(sources) - 1


def test_host_slots_keep_the_step_bound_while_the_rows_stay(tiny_runtime: ModelRuntime, sources) -> None:
    """`HostSlots.step` binds the graph once per row count and reuses its logits array; each
    step equals a fresh `run_step` over a copy of the same buffers, writes between steps included."""
    from service.runtime.step_buffers import HostSlots, run_step

    assert tiny_runtime.step is not None
    runtime = tiny_runtime
    state = runtime.encode(runtime.pad(sources[:2]))
    cross = [t for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair]
    width = state.source_mask.shape[1]
    kept = HostSlots(runtime.n_decoder_layers, 2, runtime.n_heads, 8, runtime.head_dim, width)
    fresh = HostSlots(runtime.n_decoder_layers, 2, runtime.n_heads, 8, runtime.head_dim, width)
    for slots in (kept, fresh):
        slots.write(0, cross)
    ids = np.full((2, 1), runtime.decoder_start_id, dtype=np.int64)
    seen = []
    for position, count in ((0, 2), (1, 2), (2, 2), (3, 1), (4, 1)):
        if position == 2:  # a newcomer's source written into slot 1 between two steps, in place
            other = runtime.encode(runtime.pad([sources[5]]))
            newcomer = [t for pair in zip(other.cross_keys, other.cross_values, strict=True) for t in pair]
            for slots in (kept, fresh):
                slots.write(1, newcomer)
        positions = np.full((count, 1), position, dtype=np.int64)
        mask = np.ones((count, width), dtype=bool)
        logits = kept.step(runtime.step, ids[:count], positions, mask)
        expected = run_step(runtime.step, ids[:count], positions, mask, [c[:count] for c in fresh.cross],
                            fresh.buffers)
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
        seen.append(logits)
    assert seen[1] is seen[2] and seen[4] is not seen[2]  # one array per row count, from its second step


@pytest.mark.parametrize("rows, join_at", [(1, 1), (3, 1), (4, 3), (64, 1)])
def test_generate_running_gives_each_source_its_own_tokens(tiny_runtime: ModelRuntime, sources,
                                                           rows: int, join_at: int) -> None:
    taken: list[int] = []

    def feed():  # counts what the batch has taken, to show it reads as slots free up
        for i, source in enumerate(sources):
            taken.append(i)
            yield i, source

    results: dict[int, GenerationResult] = {}
    for owner, result in generate_running(tiny_runtime, feed(), rows=rows, max_new_tokens=14, join_at=join_at):
        assert len(taken) - len(results) <= rows  # never more sources in flight than slots
        results[owner] = result
    assert sorted(results) == list(range(len(sources)))
    for owner, source in enumerate(sources):
        expected = _alone(tiny_runtime, source, 14)
        assert (results[owner].tokens, results[owner].finish_reason) == (expected.tokens, expected.finish_reason)


def test_generate_running_rejects_an_empty_batch(tiny_runtime: ModelRuntime, sources) -> None:
    with pytest.raises(ValueError, match="rows and join_at"):
        next(generate_running(tiny_runtime, enumerate(sources), rows=0))
    assert list(generate_running(tiny_runtime, [], rows=4)) == []
