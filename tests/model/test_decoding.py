"""Reference decoding: the cache changes nothing, batching changes nothing, the model learns."""

from __future__ import annotations

import pytest
import torch

from model.decoding import beam_search, greedy_decode, pad_batch


def _sources(examples, n):
    return [s + [3] for s in examples.sources[:n]]  # EOS-terminated


def test_loss_falls_and_the_model_reverses(trained_tiny):
    losses = [loss for _, loss in trained_tiny.result.valid_losses]
    assert losses[-1] < losses[0] * 0.5
    model = trained_tiny.load()
    outputs = greedy_decode(model, pad_batch(_sources(trained_tiny.valid, 50), 0), 12)
    correct = sum(o.tokens == t for o, t in zip(outputs, trained_tiny.valid.targets[:50]))
    assert correct >= 45
    assert all(o.finish_reason == "eos" for o in outputs)


@pytest.mark.parametrize("which", ["trained", "random"])
def test_greedy_with_cache_equals_without(which, trained_tiny, random_tiny):
    model = trained_tiny.load() if which == "trained" else random_tiny
    source = pad_batch(_sources(trained_tiny.valid, 16), 0)
    cached = greedy_decode(model, source, 10, use_cache=True)
    uncached = greedy_decode(model, source, 10, use_cache=False)
    assert [(g.tokens, g.finish_reason) for g in cached] == [(g.tokens, g.finish_reason) for g in uncached]
    assert [g.score for g in cached] == pytest.approx([g.score for g in uncached], abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_mixed_length_batch_equals_rows_alone(trained_tiny, beam_size):
    model = trained_tiny.load()
    sources = _sources(trained_tiny.valid, 12)
    batched = beam_search(model, pad_batch(sources, 0), beam_size, 12)
    alone = [beam_search(model, pad_batch([s], 0), beam_size, 12)[0] for s in sources]
    assert [g.tokens for g in batched] == [g.tokens for g in alone]
    for b, a in zip(batched, alone):
        assert b.finish_reason == a.finish_reason
        assert b.score == pytest.approx(a.score, abs=1e-4)


def test_beam_search_solves_the_task_and_beam_one_is_greedy(trained_tiny):
    model = trained_tiny.load()
    source = pad_batch(_sources(trained_tiny.valid, 30), 0)
    targets = trained_tiny.valid.targets[:30]
    beams = beam_search(model, source, 4, 12)
    greedy = greedy_decode(model, source, 12)
    solved = sum(g.tokens == t for g, t in zip(beams, targets))
    assert solved >= 24 and solved >= sum(g.tokens == t for g, t in zip(greedy, targets))
    assert [g.tokens for g in beam_search(model, source, 1, 12)] == [g.tokens for g in greedy]


def test_max_new_tokens_stops_with_length(trained_tiny):
    model = trained_tiny.load()
    outputs = greedy_decode(model, pad_batch(_sources(trained_tiny.valid, 4), 0), 2)
    assert all(len(o.tokens) == 2 and o.finish_reason == "length" for o in outputs)
    beams = beam_search(model, pad_batch(_sources(trained_tiny.valid, 4), 0), 3, 2)
    assert all(len(o.tokens) <= 2 for o in beams)


def test_pad_batch():
    assert pad_batch([[1, 2, 3], [4]], 0).tolist() == [[1, 2, 3], [4, 0, 0]]
    assert pad_batch([[1]], 9).dtype == torch.long
