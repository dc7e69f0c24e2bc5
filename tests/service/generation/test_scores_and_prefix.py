"""Scores, n-best hypotheses and forced target prefixes in the decoding loops (greedy and beam
search, `service.generation.search`; the in-flight batches on the step graph and on the merged
decoder), checked against log-probabilities computed independently: one teacher-forced decoder
pass over the output."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from service.batching.running_batch import RunningBatch
from service.batching.slot_batch import SlotBatch
from service.generation.hooks import RowHooks
from service.generation.search import GenerationResult, generate, log_softmax, pick, token_log_probs
from service.runtime import ModelRuntime

EOS = 3


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    return [s + [EOS] for s in trained_tiny.valid.sources[:8]] + [[19] * 10 + [EOS]]


def teacher_forced(runtime: ModelRuntime, source: list[int], tokens: list[int]) -> np.ndarray:
    """(len(tokens) + 1, V) log-probabilities of each position of `<s>` + tokens (float64)."""
    state = runtime.encode(np.asarray([source], dtype=np.int64))
    step = runtime.decode(np.asarray([[runtime.bos_id, *tokens]], dtype=np.int64), state)
    logits = np.asarray(step.logits[0], dtype=np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


def check_scores(runtime: ModelRuntime, source: list[int], result: GenerationResult) -> None:
    """`token_scores` are the tokens' log-probabilities and `log_prob` their sum, with EOS's
    when the row ended with it."""
    reference = teacher_forced(runtime, source, result.tokens)
    expected = [reference[i, t] for i, t in enumerate(result.tokens)]
    assert result.token_scores is not None and result.log_prob is not None
    assert list(result.token_scores) == pytest.approx(expected, abs=1e-4)
    eos = reference[len(result.tokens), EOS] if result.finish_reason == "eos" else 0.0
    assert result.log_prob == pytest.approx(sum(expected) + eos, abs=1e-3)


def drain(batch, rows: list[tuple[list[int], int, RowHooks | None]]) -> list[GenerationResult]:
    """Every row joined at once, stepped to the end; results in row order."""
    batch.concatenate([r[0] for r in rows], list(range(len(rows))), [r[1] for r in rows], [r[2] for r in rows])
    results: dict[int, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    return [results[i] for i in range(len(rows))]


def test_pick_scores_only_the_rows_that_need_it() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 11)).astype(np.float32)
    reference = log_softmax(logits)
    best, chosen = pick(logits.copy(), False, [], [])
    assert chosen is None and best.tolist() == logits.argmax(-1).tolist()
    best, chosen = pick(logits.copy(), False, [(2, 5)], [1, 2])
    assert best[2] == 5 and chosen is not None
    assert np.isnan(chosen[[0, 3]]).all()
    assert chosen[[1, 2]] == pytest.approx([reference[1, best[1]], reference[2, 5]], abs=1e-6)
    best, chosen = pick(logits.copy(), True, [(0, 7)], [])
    assert chosen is not None and chosen == pytest.approx(reference[np.arange(4), best], abs=1e-6)
    assert token_log_probs(logits, np.asarray([1, 2, 3, 4])) == pytest.approx(reference[np.arange(4), [1, 2, 3, 4]],
                                                                             abs=1e-6)


def test_greedy_token_scores_are_the_teacher_forced_log_probabilities(tiny_runtime: ModelRuntime,
                                                                     sources) -> None:
    hooks = [RowHooks(scores=i % 2 == 0) for i in range(len(sources))]
    scored = generate(tiny_runtime, sources, 1, 6, hooks=hooks, greedy_scores=False)  # some cut at 6
    plain = generate(tiny_runtime, sources, 1, 6, greedy_scores=False)
    assert [g.tokens for g in scored] == [g.tokens for g in plain]
    for i, (source, result) in enumerate(zip(sources, scored, strict=True)):
        if i % 2:
            assert result.token_scores is None and result.log_prob is None and result.score is None
        else:
            check_scores(tiny_runtime, source, result)
    assert {g.finish_reason for g in scored[::2]} == {"eos", "length"}


@pytest.mark.parametrize("kind", [SlotBatch, RunningBatch])
def test_in_flight_batches_score_the_rows_that_ask(tiny_runtime: ModelRuntime, sources, kind) -> None:
    rows = [(s, 12, RowHooks(scores=True) if i % 3 == 0 else None) for i, s in enumerate(sources)]
    results = drain(kind(tiny_runtime, scores=False), rows)
    for (source, _, hook), result in zip(rows, results, strict=True):
        assert result.tokens == generate(tiny_runtime, [source], 1, 12)[0].tokens
        if hook is None:
            assert result.token_scores is None and result.score is None
        else:
            check_scores(tiny_runtime, source, result)


def test_beam_scores_hypotheses_and_their_rank(tiny_runtime: ModelRuntime, sources) -> None:
    hooks = [RowHooks(scores=True, hypotheses=3) for _ in sources]
    asked = generate(tiny_runtime, sources, 3, 12, hooks=hooks)
    plain = generate(tiny_runtime, sources, 3, 12)
    for source, result, alone in zip(sources, asked, plain, strict=True):
        assert (result.tokens, result.finish_reason, result.score) == (alone.tokens, alone.finish_reason, alone.score)
        assert alone.token_scores is None and alone.hypotheses is None and alone.log_prob is not None
        assert result.hypotheses is not None and 1 <= len(result.hypotheses) <= 3
        assert result.hypotheses[0] == dataclasses.replace(result, hypotheses=None)
        for hypothesis in result.hypotheses:
            check_scores(tiny_runtime, source, hypothesis)
            length = len(hypothesis.tokens) + (hypothesis.finish_reason == "eos")
            assert hypothesis.score == pytest.approx(hypothesis.log_prob / length, abs=1e-5)
        ranks = [h.score for h in result.hypotheses]
        assert ranks == sorted(ranks, reverse=True)
    assert any(len(r.hypotheses or ()) == 3 for r in asked)


def test_a_prefix_the_model_would_choose_changes_nothing(tiny_runtime: ModelRuntime, sources) -> None:
    reference = generate(tiny_runtime, sources, 1, 12, hooks=[RowHooks(scores=True) for _ in sources])
    hooks = [RowHooks(prefix=tuple(g.tokens[:2]), scores=True) for g in reference]
    forced = generate(tiny_runtime, sources, 1, 12, hooks=hooks)
    for ref, got in zip(reference, forced, strict=True):
        assert (got.tokens, got.finish_reason) == (ref.tokens, ref.finish_reason)
        assert got.token_scores == pytest.approx(ref.token_scores, abs=1e-5)
        assert got.log_prob == pytest.approx(ref.log_prob, abs=1e-5)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_forced_prefix_starts_every_output(tiny_runtime: ModelRuntime, sources, beam_size: int) -> None:
    prefix = (7, 7, 12)  # not what the reversal model would write
    hooks = [RowHooks(prefix=prefix if i % 2 == 0 else (), scores=True, hypotheses=beam_size)
             for i in range(len(sources))]
    results = generate(tiny_runtime, sources, beam_size, 12, hooks=hooks)
    plain = generate(tiny_runtime, sources, beam_size, 12)
    for i, (source, result) in enumerate(zip(sources, results, strict=True)):
        if i % 2:  # rows without a prefix, batched with prefixed ones: as alone
            assert result.tokens == plain[i].tokens
            continue
        every = result.hypotheses or (result,)
        assert all(tuple(h.tokens[:3]) == prefix for h in every)
        assert len(result.tokens) > 3 or result.finish_reason == "eos"
        for hypothesis in every:
            check_scores(tiny_runtime, source, hypothesis)


@pytest.mark.parametrize("kind", [SlotBatch, RunningBatch])
def test_prefixed_rows_join_the_running_batch_and_decode_as_alone(tiny_runtime: ModelRuntime, sources,
                                                                  kind) -> None:
    prefixes = [(7, 12), (), (9,), (), (15, 15, 15, 15), (), (8,), (), ()]
    seen: dict[int, list[int]] = {i: [] for i in range(len(sources))}
    hooks = [RowHooks(on_token=seen[i].append, prefix=p, scores=bool(p)) for i, p in enumerate(prefixes)]
    batch = kind(tiny_runtime, scores=False)
    # half join at once, the others after two steps: a prefix row starts beside running rows
    batch.concatenate(sources[::2], list(range(0, len(sources), 2)), [12] * len(sources[::2]), hooks[::2])
    results: dict[int, GenerationResult] = {}
    for _ in range(2):
        results.update(batch.generate_token())
    batch.concatenate(sources[1::2], list(range(1, len(sources), 2)), [12] * len(sources[1::2]), hooks[1::2])
    while len(batch):
        results.update(batch.generate_token())
    for i, (source, prefix) in enumerate(zip(sources, prefixes, strict=True)):
        [alone] = generate(tiny_runtime, [source], 1, 12, hooks=[RowHooks(prefix=prefix, scores=bool(prefix))])
        assert (results[i].tokens, results[i].finish_reason) == (alone.tokens, alone.finish_reason)
        assert tuple(results[i].tokens[:len(prefix)]) == prefix
        assert seen[i] == results[i].tokens  # the prefix is streamed first, as decoded
        if prefix:
            check_scores(tiny_runtime, source, results[i])


def test_a_cancelled_prefixed_row_stops_inside_its_prefix(tiny_runtime: ModelRuntime, sources) -> None:
    hook = RowHooks(prefix=(7, 7, 7, 7), scores=True)
    batch = SlotBatch(tiny_runtime)
    batch.concatenate([sources[0]], ["row"], [12], [hook])
    batch.generate_token()
    hook.cancel.set()
    [(_, result)] = batch.generate_token()
    assert result.finish_reason == "cancelled" and result.tokens == [7, 7]
