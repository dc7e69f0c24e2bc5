"""`SlotBatch` with a vocabulary shortlist (`service.runtime.shortlist`): steps compute only the
batch's shortlist when no live row needs the whole vocabulary, and decode the same tokens as the
whole vocabulary when the table holds them."""

from __future__ import annotations

import numpy as np
import pytest

from service.batching.slot_batch import SlotBatch
from service.generation.hooks import RowHooks
from service.generation.search import GenerationResult
from service.runtime import CPU, ModelRuntime
from service.runtime.shortlist import Shortlist, ShortlistCounts, ShortlistTable

EOS = 3
TINY_VOCAB = 20


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    return [s + [EOS] for s in trained_tiny.valid.sources[:16]]


@pytest.fixture(scope="module")
def runtime(tiny_model_repository, tiny_shortlist) -> ModelRuntime:
    """The tiny repository's int8 variant with the shortlist (a runtime of its own: the shared
    ones stay without)."""
    loaded = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="int8")
    loaded.shortlist = Shortlist.load(*tiny_shortlist, threads=1)
    return loaded


def _run(runtime: ModelRuntime, sources: list[list[int]], shortlist: bool, seed: int,
         hooks: dict[int, RowHooks] | None = None, shortlist_rows: int = 16, share: float = 1.0,
         live: list[int] | None = None) -> tuple[dict[int, GenerationResult], list[int | None]]:
    """Rows join 0-3 at a time at random steps; every row's result and each step's shortlist
    size (None: the whole vocabulary); each step's live rows appended to `live`. `share` 1.0:
    a shortlist of any length (the tiny vocabulary is 20 pieces)."""
    batch: SlotBatch[int] = SlotBatch(runtime, scores=False, rows=2, shortlist_rows=shortlist_rows if shortlist else 0,
                                      shortlist_share=share)
    assert batch.shortlisted is shortlist
    rng = np.random.default_rng(seed)
    pending = list(range(len(sources)))
    results: dict[int, GenerationResult] = {}
    sizes: list[int | None] = []
    while pending or len(batch):
        take = [pending.pop(0) for _ in range(min(len(pending), int(rng.integers(0, 4))))]
        if take:
            batch.concatenate([sources[i] for i in take], take, [12] * len(take),
                              [(hooks or {}).get(i) for i in take])
        vocab = batch.step_vocab()
        sizes.append(None if vocab is None else len(vocab))
        if live is not None:
            live.append(len(batch))
        results.update(batch.generate_token())
    return results, sizes


def _tokens(results: dict[int, GenerationResult]) -> dict[int, tuple[list[int], str]]:
    return {owner: (r.tokens, r.finish_reason) for owner, r in results.items()}


@pytest.mark.parametrize("seed", [0, 1])
def test_a_shortlist_that_holds_the_outputs_decodes_the_same_tokens(runtime, sources, seed: int) -> None:
    full, full_sizes = _run(runtime, sources, False, seed)
    assert set(full_sizes) == {None}
    assert runtime.shortlist is not None
    table = runtime.shortlist.table
    # the table holds every row's output (its source's candidates and the specials)
    for i, source in enumerate(sources):
        assert np.isin(full[i].tokens, table.shortlist([source])).all()
    short, sizes = _run(runtime, sources, True, seed)
    assert _tokens(short) == _tokens(full)
    assert None not in sizes and min(s for s in sizes if s is not None) < runtime.vocab_size


def test_rows_with_a_prefix_or_scores_keep_the_whole_vocabulary(runtime, sources) -> None:
    hooks = {2: RowHooks(prefix=(5,)), 6: RowHooks(scores=True)}
    full, _ = _run(runtime, sources, False, 0, hooks)
    short, sizes = _run(runtime, sources, True, 0, hooks)
    assert _tokens(short) == _tokens(full)
    assert full[2].tokens[0] == 5 and full[6].token_scores is not None
    assert short[6].token_scores == pytest.approx(full[6].token_scores, abs=1e-6)
    assert None in sizes and any(s is not None for s in sizes)  # whole while those rows live, else the shortlist


def test_steps_over_shortlist_rows_compute_the_whole_vocabulary(runtime, sources) -> None:
    full, _ = _run(runtime, sources, False, 0)
    live: list[int] = []
    short, sizes = _run(runtime, sources, True, 0, shortlist_rows=2, live=live)
    assert _tokens(short) == _tokens(full)
    assert [size is None for size in sizes] == [rows > 2 for rows in live]
    assert min(live) <= 2 < max(live)  # both kinds of step ran


def test_a_shortlist_over_its_share_of_the_vocabulary_is_not_used(runtime, sources) -> None:
    _, all_sizes = _run(runtime, sources, True, 0)
    sizes = [s for s in all_sizes if s is not None]
    share = float(np.median(sizes)) / TINY_VOCAB
    full, _ = _run(runtime, sources, False, 0)
    short, capped = _run(runtime, sources, True, 0, share=share)
    assert _tokens(short) == _tokens(full)
    assert [s is None for s in capped] == [s is None or s > share * TINY_VOCAB for s in all_sizes]
    assert None in capped and any(s is not None for s in capped)


def test_a_batch_with_scores_or_device_slots_computes_the_whole_vocabulary(runtime, sources) -> None:
    scored: SlotBatch[int] = SlotBatch(runtime, scores=True, shortlist_rows=8)
    scored.concatenate(sources[:3], [0, 1, 2], [4] * 3)
    assert scored.shortlisted and scored.step_vocab() is None
    on_device: SlotBatch[int] = SlotBatch(runtime, on_device=True, shortlist_rows=8)
    assert not on_device.shortlisted
    never: SlotBatch[int] = SlotBatch(runtime, scores=False)  # shortlist_rows 0: no shortlist
    assert not never.shortlisted


def test_counts_follow_rows_joining_and_leaving() -> None:
    table = ShortlistTable(np.array([[0, 0], [2, 3], [3, 4], [4, 4], [0, 0]]), np.array([0]))
    counts = ShortlistCounts(table)
    first, second = table.row_candidates([1, 2]), table.row_candidates([2, 3])
    assert first.tolist() == [2, 3, 4] and second.tolist() == [3, 4]
    counts.join(first)
    counts.join(second)
    assert counts.vocab.tolist() == [0, 2, 3, 4]
    counts.leave(first)
    assert counts.vocab.tolist() == [0, 3, 4]
    counts.leave(second)
    assert counts.vocab.tolist() == [0]


def test_the_same_rows_step_over_shortlists_of_other_lengths(runtime, sources) -> None:
    """A shortlist that changes while the row count stays (a row leaves, another joins) gives
    logits of its own length: the bound step's logits are not kept from the last shortlist."""
    from service.runtime.step_buffers import HostSlots

    assert runtime.shortlist is not None and runtime.step is not None
    rows = 3
    state = runtime.encode(runtime.pad(sources[:rows]))
    width = state.source_mask.shape[1]

    def slots() -> HostSlots:
        made = HostSlots(runtime.n_decoder_layers, rows, runtime.n_heads, 8, runtime.head_dim, width)
        made.write(0, [t for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair])
        return made

    ids = np.full((rows, 1), runtime.decoder_start_id, dtype=np.int64)
    mask = np.asarray(state.source_mask)
    full, short = slots(), slots()
    for step, vocab in enumerate([np.array([1, 3, 5, 7, 9]), np.array([0, 1, 2, 3, 4, 5, 11, 19]), np.arange(4, 9)]):
        positions = np.full((rows, 1), step, dtype=np.int64)
        logits = full.step(runtime.step, ids, positions, mask).copy()
        columns = runtime.shortlist.columns(vocab)
        shortlisted = short.step(runtime.shortlist.session, ids, positions, mask, columns)
        assert shortlisted.shape == (rows, len(vocab))
        np.testing.assert_allclose(shortlisted, logits[:, vocab], rtol=1e-5, atol=1e-5)
        ids = logits.argmax(axis=-1)[:, None]
