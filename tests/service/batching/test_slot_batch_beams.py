"""Beam-search rows in the running batch (`SlotBatch`): a row of beam k decodes in k slots beside
greedy rows and joins and leaves at any step, with the tokens, scores and hypotheses of the
request-level `beam_search` of that row alone (fp32: the same numbers)."""

from __future__ import annotations

import numpy as np
import pytest

from service.batching.slot_batch import SlotBatch
from service.generation.hooks import RowHooks
from service.generation.search import GenerationResult, generate
from service.runtime import ModelRuntime

EOS = 3


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    return [s + [EOS] for s in trained_tiny.valid.sources[:12]] + [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, EOS]]


def _alone(runtime: ModelRuntime, source: list[int], beam: int, limit: int,
           hooks: RowHooks | None = None) -> GenerationResult:
    return generate(runtime, [source], beam, limit, hooks=[hooks] if hooks is not None else None)[0]


def _same(result: GenerationResult, expected: GenerationResult) -> None:
    assert (result.tokens, result.finish_reason) == (expected.tokens, expected.finish_reason)
    if expected.score is None:
        assert result.score is None
    else:
        assert result.score == pytest.approx(expected.score, abs=1e-4)


@pytest.mark.parametrize(("seed", "on_device"), [(0, False), (1, False), (2, True)])
def test_beam_rows_joining_at_any_step_decode_as_alone(tiny_runtime: ModelRuntime, sources, seed: int,
                                                       on_device: bool) -> None:
    """On host slots and on device slots (their tiny graphs on the CPU device here)."""
    rng = np.random.default_rng(seed)
    beams = [int(k) for k in rng.choice([1, 1, 2, 3, 4], size=len(sources))]
    limits = [int(n) for n in rng.integers(3, 14, size=len(sources))]
    batch: SlotBatch[int] = SlotBatch(tiny_runtime, rows=2, capacity=4, quantum=3, on_device=on_device,
                                      keep_bytes=0)
    assert batch.on_device is on_device
    pending = list(range(len(sources)))
    results: dict[int, GenerationResult] = {}
    while pending or len(batch):
        take = [pending.pop(0) for _ in range(min(len(pending), int(rng.integers(0, 3))))]
        if take:
            batch.concatenate([sources[i] for i in take], take, [limits[i] for i in take],
                              beam_sizes=[beams[i] for i in take])
        assert len(batch) == sum(beams[i] for i in batch.owners)  # a slot per beam
        for owner, result in batch.generate_token():
            assert owner not in results  # a beam row's k slots leave with one result
            results[owner] = result
    assert sorted(results) == list(range(len(sources)))
    assert any(k > 1 for k in beams)
    for i, source in enumerate(sources):
        _same(results[i], _alone(tiny_runtime, source, beams[i], limits[i]))


def test_a_beam_takes_a_copy_of_its_parents_cache(tiny_runtime: ModelRuntime, sources) -> None:
    """Beams change parents (the cache of another slot is copied) and still decode as alone."""
    batch: SlotBatch[int] = SlotBatch(tiny_runtime)
    moves: list[tuple[list[int], list[int]]] = []
    batch.concatenate(sources, list(range(len(sources))), [14] * len(sources), beam_sizes=[4] * len(sources))
    assert len(batch) == 4 * len(sources) and batch.owners == sorted(batch.owners, key=lambda i: len(sources[i]))
    slots = batch._slots
    move = slots.move_rows

    def spy(sources_: np.ndarray, targets: np.ndarray, columns: int, cross: bool = True) -> None:
        if not cross:  # a beam's new parent (beams of one source share their cross keys/values);
            moves.append((sources_.tolist(), targets.tolist()))  # with cross: rows filling holes
        move(sources_, targets, columns, cross)

    slots.move_rows = spy  # type: ignore[method-assign]
    results: dict[int, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    assert moves  # some beam's parent was another slot
    for i, source in enumerate(sources):
        _same(results[i], _alone(tiny_runtime, source, 4, 14))


def test_prefix_scores_and_hypotheses_of_a_beam_row(tiny_runtime: ModelRuntime, sources) -> None:
    hooks = RowHooks(prefix=(sources[0][1],), scores=True, hypotheses=3)
    batch: SlotBatch[str] = SlotBatch(tiny_runtime, scores=False)
    batch.concatenate([sources[1], sources[0]], ["greedy", "beam"], [12, 12], [None, hooks], beam_sizes=[1, 3])
    results: dict[str, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    expected = _alone(tiny_runtime, sources[0], 3, 12, RowHooks(prefix=hooks.prefix, scores=True, hypotheses=3))
    _same(results["beam"], expected)
    assert results["beam"].tokens[0] == sources[0][1]
    assert results["beam"].token_scores == pytest.approx(expected.token_scores, abs=1e-4)
    assert results["beam"].hypotheses is not None and expected.hypotheses is not None
    assert [h.tokens for h in results["beam"].hypotheses] == [h.tokens for h in expected.hypotheses]
    assert results["greedy"].tokens == _alone(tiny_runtime, sources[1], 1, 12).tokens


def test_a_cancelled_beam_row_leaves_with_its_best_beam(tiny_runtime: ModelRuntime, sources) -> None:
    hooks = RowHooks()
    batch: SlotBatch[str] = SlotBatch(tiny_runtime)
    longest = sources[-1]
    batch.concatenate([longest, sources[2]], ["beam", "greedy"], [20, 20], [hooks, None], beam_sizes=[4, 1])
    assert len(batch) == 5
    batch.generate_token()
    hooks.cancel.set()
    left = dict(batch.generate_token())
    assert left["beam"].finish_reason == "cancelled" and len(left["beam"].tokens) == 2
    assert len(batch) == 1 and batch.owners == ["greedy"]  # its four slots left at once
    results: dict[str, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    assert results["greedy"].tokens == _alone(tiny_runtime, sources[2], 1, 20).tokens


def test_filter_takes_every_slot_of_a_beam_row(tiny_runtime: ModelRuntime, sources) -> None:
    batch: SlotBatch[str] = SlotBatch(tiny_runtime)
    batch.concatenate(sources[:2], ["a", "b"], [12, 12], beam_sizes=[3, 2])
    batch.generate_token()
    assert batch.filter({"b"}) == ["a"]
    assert batch.owners == ["b"] and len(batch) == 2
    results: dict[str, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    _same(results["b"], _alone(tiny_runtime, sources[1], 2, 12))
