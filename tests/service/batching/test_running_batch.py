"""Continuous batching: rows that join a running batch between decoder steps decode exactly what
they decode alone, finished rows leave at once, and the cache stays as short as its oldest row.
The tests of the contract run on both running batches: over the merged decoder (`RunningBatch`)
and over the step graph (`SlotBatch`, more in test_slot_batch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from service.batching.running_batch import RunningBatch
from service.batching.slot_batch import SlotBatch
from service.generation.hooks import RowHooks
from service.generation.search import GenerationResult, generate
from service.runtime import ModelRuntime

BATCHES = {"merged decoder": RunningBatch, "step graph": SlotBatch}


@pytest.fixture(params=list(BATCHES))
def make_batch(request: pytest.FixtureRequest):  # -> RunningBatch | SlotBatch class
    return BATCHES[request.param]


def _alone(runtime: ModelRuntime, source: list[int], limit: int) -> GenerationResult:
    return generate(runtime, [source], 1, limit)[0]


def _drain(batch: RunningBatch, results: dict, joins: dict[int, list[tuple[int, list[int], int]]]) -> int:
    """Step until empty, adding `joins[step]` (owner, source, limit) before that step; returns steps."""
    steps = 0
    while len(batch) or any(step >= steps for step in joins):
        newcomers = joins.pop(steps, [])
        if newcomers:
            owners, rows, limits = zip(*newcomers, strict=True)
            batch.concatenate(list(rows), list(owners), list(limits))
        for owner, result in batch.generate_token():
            assert owner not in results
            results[owner] = result
        steps += 1
    return steps


def test_staggered_joins_decode_what_each_row_decodes_alone(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    rng = np.random.default_rng(0)
    joins: dict[int, list[tuple[int, list[int], int]]] = {}
    limits = {}
    for owner, source in enumerate(sources):
        limits[owner] = int(rng.integers(2, 14))
        joins.setdefault(int(rng.integers(0, 12)), []).append((owner, source, limits[owner]))
    results: dict[int, GenerationResult] = {}
    _drain(make_batch(tiny_runtime), results, joins)
    assert sorted(results) == list(range(len(sources)))
    for owner, source in enumerate(sources):
        expected = _alone(tiny_runtime, source, limits[owner])
        assert (results[owner].tokens, results[owner].finish_reason) == (expected.tokens, expected.finish_reason)
        assert results[owner].score == pytest.approx(expected.score, abs=1e-4)


def test_without_scores_the_batch_decodes_the_same_tokens(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    """The service's running batch skips the log-softmax: same tokens and reasons, no score."""
    joins = {step: [(owner, sources[owner], 12)] for step, owner in enumerate(range(0, len(sources), 2))}
    results: dict[int, GenerationResult] = {}
    _drain(make_batch(tiny_runtime, scores=False), results, joins)
    for owner, result in results.items():
        expected = _alone(tiny_runtime, sources[owner], 12)
        assert (result.tokens, result.finish_reason, result.score) == (expected.tokens, expected.finish_reason, None)


def test_a_row_joining_a_long_running_batch_is_not_disturbed(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    """A short source joins late next to a long one that runs to its token limit, and the reverse."""
    long_source, short_source = sources[-2], sources[0]
    results: dict[int, GenerationResult] = {}
    _drain(make_batch(tiny_runtime), results, {0: [(0, long_source, 20)], 7: [(1, short_source, 20)],
                                                 9: [(2, long_source, 5)]})
    for owner, (source, limit) in enumerate([(long_source, 20), (short_source, 20), (long_source, 5)]):
        expected = _alone(tiny_runtime, source, limit)
        assert (results[owner].tokens, results[owner].finish_reason) == (expected.tokens, expected.finish_reason)


def test_finished_rows_leave_and_unused_columns_are_trimmed(tiny_runtime: ModelRuntime, sources) -> None:
    batch: RunningBatch[str] = RunningBatch(tiny_runtime)
    batch.concatenate([sources[-1]], ["long"], [3])
    batch.generate_token()
    batch.generate_token()
    batch.concatenate([sources[0]], ["late"], [30])
    assert (len(batch), batch.cache_len, batch.source_len) == (2, 2, len(sources[-1]))
    assert [owner for owner, _ in batch.generate_token()] == ["long"]  # its third token: the limit
    # only the late row is left: one cached position (its own), its own source length
    assert (batch.owners, batch.cache_len, batch.source_len) == (["late"], 1, len(sources[0]))


def test_newcomers_take_dead_slots_in_place_and_decode_what_they_decode_alone(
        tiny_runtime: ModelRuntime, sources) -> None:
    batch: RunningBatch[str] = RunningBatch(tiny_runtime, compact_fraction=0.9)
    longest = max(sources[:6], key=len)
    batch.concatenate([longest, *sources[:3]], ["long", "a", "b", "c"], [12, 1, 1, 12])
    assert sorted(owner for owner, _ in batch.generate_token()) == ["a", "b"]  # token limit 1: two dead slots
    cross_keys = batch._cross_keys[0]
    batch.concatenate([sources[4], sources[5]], ["d", "e"], [12, 12])
    assert batch.slots == 4 and batch._cross_keys[0] is cross_keys  # written in place, not copied
    results: dict[str, GenerationResult] = {}
    _drain(batch, results, {})
    for owner, source in {"d": sources[4], "e": sources[5]}.items():
        expected = _alone(tiny_runtime, source, 12)
        assert (results[owner].tokens, results[owner].finish_reason) == (expected.tokens, expected.finish_reason)
        assert results[owner].score == pytest.approx(expected.score, abs=1e-4)


def test_a_longer_source_or_columns_to_trim_rebuild_the_batch(tiny_runtime: ModelRuntime, sources) -> None:
    batch: RunningBatch[str] = RunningBatch(tiny_runtime, compact_fraction=0.9, trim_slack=0)
    short = min(sources, key=len)
    batch.concatenate([short, short], ["a", "b"], [1, 30])
    batch.generate_token()  # "a" leaves a dead slot
    cross_keys = batch._cross_keys[0]
    batch.concatenate([max(sources, key=len)], ["long"], [5])  # longer than the batch's sources
    assert batch._cross_keys[0] is not cross_keys and batch.slots == 2  # compacted, then appended
    assert batch.source_len == len(max(sources, key=len))


def test_token_limit_one_and_eos_first(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    batch = make_batch(tiny_runtime)
    batch.concatenate(sources[:3], [0, 1, 2], [1, 1, 1])
    finished = dict(batch.generate_token())
    assert len(batch) == 0 and sorted(finished) == [0, 1, 2]
    for owner in range(3):
        assert len(finished[owner].tokens) <= 1
        assert finished[owner].tokens == _alone(tiny_runtime, sources[owner], 1).tokens


def test_hooks_stream_tokens_and_cancel_a_row(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    seen: list[int] = []
    streamed = RowHooks(on_token=seen.append)
    cancelled = RowHooks()
    batch = make_batch(tiny_runtime)
    batch.concatenate([sources[-1], sources[-2]], ["streamed", "cancelled"], [6, 30], [streamed, cancelled])
    cancelled.cancel.set()
    results = dict(batch.generate_token())
    assert results["cancelled"].finish_reason == "cancelled" and len(results["cancelled"].tokens) == 1
    while len(batch):
        results.update(batch.generate_token())
    assert seen == results["streamed"].tokens == _alone(tiny_runtime, sources[-1], 6).tokens


def test_filter_of_no_owners_empties_the_batch(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    batch = make_batch(tiny_runtime)
    batch.concatenate(sources[:4], [0, 1, 2, 3], [9] * 4)
    batch.generate_token()
    assert sorted(batch.filter(())) == [0, 1, 2, 3] and len(batch) == 0 and batch.generate_token() == []


def test_filter_keeps_the_rows_asked_for_and_they_decode_as_alone(tiny_runtime: ModelRuntime, sources,
                                                                  make_batch) -> None:
    """Rows taken out by `filter` leave at once; the kept ones go on to their own tokens."""
    batch = make_batch(tiny_runtime)
    batch.concatenate(sources[:5], [0, 1, 2, 3, 4], [12] * 5)
    batch.generate_token()
    assert sorted(batch.filter({1, 3})) == [0, 2, 4]
    assert sorted(batch.owners) == [1, 3]
    results = {}
    while len(batch):
        results.update(batch.generate_token())
    assert set(results) == {1, 3}
    for owner in (1, 3):
        assert results[owner].tokens == _alone(tiny_runtime, sources[owner], 12).tokens


def test_bad_rows_are_refused(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    batch = make_batch(tiny_runtime)
    with pytest.raises(ValueError):
        batch.concatenate([[]], [0], [4])
    with pytest.raises(ValueError):
        batch.concatenate([sources[0]], [0], [0])
    with pytest.raises(ValueError):
        batch.concatenate([sources[0]], [0, 1], [4])
    assert len(batch) == 0


def test_io_binding_runtime_gives_the_same_tokens(tiny_model_repository, sources) -> None:
    bound = ModelRuntime.load(tiny_model_repository, providers=["CPUExecutionProvider"], io_binding=True)
    plain = ModelRuntime.load(tiny_model_repository, providers=["CPUExecutionProvider"], io_binding=False)
    results: dict[int, GenerationResult] = {}
    _drain(RunningBatch(bound), results, {0: [(0, sources[0], 10)], 2: [(1, sources[-1], 10)]})
    assert results[0].tokens == _alone(plain, sources[0], 10).tokens
    assert results[1].tokens == _alone(plain, sources[-1], 10).tokens



def test_newcomers_are_encoded_in_groups_of_similar_length() -> None:
    from service.batching.in_flight import _length_groups

    assert _length_groups([3, 3, 4, 4], 1.25) == [[0, 1, 2, 3]]  # 16 padded for 14 real tokens
    assert _length_groups([2, 2, 2, 10, 11], 1.25) == [[0, 1, 2], [3, 4]]
    assert _length_groups([5], 1.25) == [[0]] and _length_groups([], 1.25) == []
    groups = _length_groups(list(range(1, 60)), 1.25)
    assert sorted(i for g in groups for i in g) == list(range(59))
    for group in groups:  # each group pads at most 25% over its real tokens
        lengths = [i + 1 for i in group]
        assert len(lengths) * max(lengths) <= 1.25 * sum(lengths)


@pytest.mark.parametrize("scored", [False, True])
def test_the_service_scores_greedy_results_only_when_set(tiny_runtime: ModelRuntime, sources, scored: bool) -> None:
    from service.core.registry import onnx_generator, onnx_running_batch
    from service.core.settings import Settings

    settings = Settings(greedy_scores=scored)
    generated = onnx_generator(settings)(tiny_runtime)([sources[0]], 1, 8)[0]
    batch = onnx_running_batch(settings)(tiny_runtime)()
    batch.concatenate([sources[0]], ["row"], [8])
    stepped = []
    while len(batch):
        stepped += batch.generate_token()
    assert stepped[0][1].tokens == generated.tokens
    assert (generated.score is not None, stepped[0][1].score is not None) == (scored, scored)


def test_cache_bytes_count_every_slot_s_keys_and_values(tiny_runtime: ModelRuntime, sources, make_batch) -> None:
    """Each slot, finished or not, holds keys and values per decoder layer over its cache
    columns (the step graph's capacity, the merged decoder's cache length) and its source
    width."""
    batch = make_batch(tiny_runtime)
    per_column = (2 * tiny_runtime.n_decoder_layers * tiny_runtime.n_heads * tiny_runtime.head_dim
                  * np.dtype(tiny_runtime.cache_dtype).itemsize)

    def expected() -> int:
        columns = batch.capacity if isinstance(batch, SlotBatch) else batch.cache_len
        return batch.slots * per_column * (columns + batch.source_len)

    batch.concatenate(sources[:2], [0, 1], [30, 30])
    batch.generate_token()
    small = batch.cache_bytes
    assert small == expected() > 0
    batch.concatenate(sources[2:12], list(range(2, 12)), [30] * 10)
    for _ in range(3):
        batch.generate_token()
    assert batch.cache_bytes == expected() > small
