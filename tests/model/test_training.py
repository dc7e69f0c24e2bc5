"""Training pipeline: schedule, batching, checkpoints without pickle, exact resume."""

from __future__ import annotations

import json

import pytest
import torch

from model.batching import make_batch, token_budget_batches
from model.checkpoint import WEIGHTS_FILE, load_model, save_weights, unique_state_dict
from model.decoding import greedy_decode, pad_batch
from model.training import TrainConfig, learning_rate_at, train
from tests.conftest import TINY_CONFIG, reversal_examples


def test_learning_rate_warms_up_then_decays():
    config = TrainConfig(learning_rate=1e-3, warmup_steps=100, max_steps=1000)
    assert learning_rate_at(1, config) == pytest.approx(1e-5)
    assert learning_rate_at(100, config) == pytest.approx(1e-3)
    assert learning_rate_at(400, config) == pytest.approx(5e-4)  # inverse sqrt: 1e-3 * sqrt(100/400)
    cosine = TrainConfig(learning_rate=1e-3, warmup_steps=100, max_steps=1000, schedule="cosine")
    assert learning_rate_at(1000, cosine) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate_at(550, cosine) == pytest.approx(5e-4)


def test_token_budget_batches_cover_everything_once_within_budget():
    examples = reversal_examples(500, seed=3)
    batches = token_budget_batches(examples, max_tokens=100, seed=7)
    flat = sorted(i for batch in batches for i in batch)
    assert flat == list(range(500))
    for batch in batches:
        longest = max(max(len(examples.sources[i]), len(examples.targets[i])) + 1 for i in batch)
        assert longest * len(batch) <= 100
    assert batches == token_budget_batches(examples, max_tokens=100, seed=7)
    assert batches != token_budget_batches(examples, max_tokens=100, seed=8)


def test_make_batch_adds_bos_and_eos():
    batch = make_batch([[5, 6], [7]], [[8], [9, 10]], pad_id=0, bos_id=2, eos_id=3)
    assert batch.source.tolist() == [[5, 6, 3], [7, 3, 0]]
    assert batch.target_input.tolist() == [[2, 8, 0], [2, 9, 10]]
    assert batch.target_output.tolist() == [[8, 3, 0], [9, 10, 3]]
    assert batch.n_target_tokens == 5


def test_weights_round_trip_in_bf16_without_pickle(random_tiny, tmp_path):
    save_weights(random_tiny, tmp_path, dtype=torch.bfloat16)
    assert (tmp_path / WEIGHTS_FILE).read_bytes()[:8] != b"\x80\x02"  # not a pickle
    loaded = load_model(tmp_path)
    for name, tensor in unique_state_dict(loaded).items():
        expected = unique_state_dict(random_tiny)[name].to(torch.bfloat16).float()
        torch.testing.assert_close(tensor, expected)
    # tied embeddings are stored once and re-tied on load
    assert loaded.output_projection.weight is loaded.source_embedding.tokens.weight
    source = pad_batch([[5, 6, 7, 3]], 0)
    assert greedy_decode(loaded, source, 5)[0].finish_reason in {"eos", "length"}


def test_resume_continues_exactly_where_it_stopped(tmp_path):
    """Training 30 steps, stopping at 15 and resuming, equals 30 steps in one go."""
    train_set, valid_set = reversal_examples(400, seed=0), reversal_examples(20, seed=1)
    common = {"max_tokens": 200, "learning_rate": 2e-3, "warmup_steps": 5, "eval_every": 10, "save_every": 10,
              "precision": "fp32", "seed": 0}
    torch.manual_seed(0)
    train(TINY_CONFIG, TrainConfig(max_steps=30, **common), train_set, valid_set, tmp_path / "straight", progress=False)
    torch.manual_seed(0)
    first = train(TINY_CONFIG, TrainConfig(max_steps=15, **common), train_set, valid_set, tmp_path / "resumed", progress=False)
    assert first.step == 15
    second = train(TINY_CONFIG, TrainConfig(max_steps=30, **common), train_set, valid_set, tmp_path / "resumed", progress=False)
    assert second.step == 30
    straight = unique_state_dict(load_model(tmp_path / "straight" / "last"))
    resumed = unique_state_dict(load_model(tmp_path / "resumed" / "last"))
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=1e-6, rtol=1e-5)
    state = json.loads((tmp_path / "resumed" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 30
    assert [s for s, _ in state["valid_losses"]] == [10, 20, 30]


def test_time_limit_stops_with_a_checkpoint(tmp_path):
    config = TrainConfig(max_tokens=200, warmup_steps=5, max_steps=10_000, eval_every=1000, save_every=1000, precision="fp32")
    result = train(TINY_CONFIG, config, reversal_examples(200, 0), reversal_examples(10, 1), tmp_path, max_minutes=0.01, progress=False)
    assert result.stopped == "time_limit"
    assert 0 < result.step < 10_000
    assert json.loads((tmp_path / "last" / "trainer_state.json").read_text())["step"] == result.step
