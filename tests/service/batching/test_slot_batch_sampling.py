"""Sampled rows on the tiny model, through the running batch (`SlotBatch`) and request-level
`generate`: a seed gives a row the same tokens beside other rows, joining mid-way, as alone; the
greedy rows beside it keep their tokens; top_k 1 is greedy; its scores are the model's
log-probabilities of what it drew."""

from __future__ import annotations

import numpy as np

from service.batching.slot_batch import SlotBatch
from service.generation.hooks import RowHooks
from service.generation.sampling import Sampling
from service.generation.search import GenerationResult, generate
from service.runtime import ModelRuntime


def _sampled(seed: int, row: int = 0, **settings: float) -> RowHooks:
    return RowHooks(sampler=Sampling(settings.pop("temperature", 1.5), seed=seed, **settings).sampler(row))  # type: ignore[arg-type]


def _alone(runtime: ModelRuntime, source: list[int], hooks: RowHooks | None, limit: int = 14) -> GenerationResult:
    return generate(runtime, [source], 1, limit, hooks=[hooks] if hooks is not None else None)[0]


def test_a_sampled_row_draws_the_same_tokens_beside_greedy_rows_as_alone(tiny_runtime: ModelRuntime,
                                                                          sources) -> None:
    batch: SlotBatch[int] = SlotBatch(tiny_runtime)
    sampled = {1: 5, 4: 6, 6: 7}  # owner -> seed
    hooks = [_sampled(sampled[i]) if i in sampled else None for i in range(8)]
    batch.concatenate(sources[:5], list(range(5)), [14] * 5, hooks[:5])
    results: dict[int, GenerationResult] = {}
    results.update(batch.generate_token())
    batch.concatenate(sources[5:8], [5, 6, 7], [14] * 3, hooks[5:8])  # newcomers join mid-way
    while len(batch):
        results.update(batch.generate_token())
    draws = set()
    for owner in range(8):
        alone = _alone(tiny_runtime, sources[owner], _sampled(sampled[owner]) if owner in sampled else None)
        assert (results[owner].tokens, results[owner].finish_reason) == (alone.tokens, alone.finish_reason), owner
        if owner in sampled:
            draws.add(tuple(alone.tokens))
    greedy = [_alone(tiny_runtime, sources[owner], None).tokens for owner in sampled]
    assert any(list(tokens) not in greedy for tokens in draws)  # at temperature 1.5 the draws leave the argmax


def test_top_k_one_is_greedy_and_seeds_change_the_draws(tiny_runtime: ModelRuntime, sources) -> None:
    for source in sources[:4]:
        greedy = _alone(tiny_runtime, source, None).tokens
        assert _alone(tiny_runtime, source, _sampled(1, temperature=3.0, top_k=1)).tokens == greedy
    draws = {tuple(_alone(tiny_runtime, sources[0], _sampled(seed, temperature=3.0)).tokens) for seed in range(8)}
    assert len(draws) > 1


def test_a_sampled_rows_scores_are_the_models_log_probabilities_of_its_draws(tiny_runtime: ModelRuntime,
                                                                              sources) -> None:
    hooks = _sampled(3, temperature=2.0)
    hooks.scores = True
    drawn = _alone(tiny_runtime, sources[2], hooks)
    forced = RowHooks(prefix=tuple(drawn.tokens), scores=True)  # the same tokens, forced: their log-probabilities
    replay = generate(tiny_runtime, [sources[2]], 1, len(drawn.tokens), hooks=[forced])[0]
    assert drawn.token_scores is not None and replay.token_scores is not None
    assert np.allclose(drawn.token_scores, replay.token_scores, atol=1e-5)


def test_a_forced_prefix_comes_first_then_the_draws(tiny_runtime: ModelRuntime, sources) -> None:
    prefix = tuple(_alone(tiny_runtime, sources[3], None).tokens[:2])
    hooks = _sampled(21, temperature=3.0)
    hooks.prefix = prefix
    batch: SlotBatch[str] = SlotBatch(tiny_runtime)
    batch.concatenate([sources[0], sources[3]], ["greedy", "sampled"], [14, 14], [None, hooks])
    results: dict[str, GenerationResult] = {}
    while len(batch):
        results.update(batch.generate_token())
    again = _sampled(21, temperature=3.0)
    again.prefix = prefix
    alone = _alone(tiny_runtime, sources[3], again)
    assert tuple(results["sampled"].tokens[:2]) == prefix and results["sampled"].tokens == alone.tokens
