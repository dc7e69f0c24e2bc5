"""Shared fixtures: a tiny seeded Transformer trained in seconds on a sequence-reversal task."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from model.batching import ParallelExamples  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.training import TrainConfig, TrainResult, train  # noqa: E402
from model.transformer import Transformer  # noqa: E402

TINY_CONFIG = ModelConfig(
    vocab_size=20, d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=128,
    dropout=0.0, max_source_len=16, max_target_len=16,
)


def reversal_examples(count: int, seed: int) -> ParallelExamples:
    """Random sequences of ids 4..19 (3-8 long) and their reversal."""
    rng = random.Random(seed)
    sources = [[rng.randrange(4, 20) for _ in range(rng.randrange(3, 9))] for _ in range(count)]
    return ParallelExamples(sources, [s[::-1] for s in sources])


@dataclass
class TrainedTiny:
    directory: Path
    result: TrainResult
    valid: ParallelExamples

    def load(self) -> Transformer:
        return load_model(self.directory / "last")


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory: pytest.TempPathFactory) -> TrainedTiny:
    """The tiny model trained for 400 steps (about 15 s on 2 cores)."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-run")
    config = TrainConfig(max_tokens=640, learning_rate=3e-3, warmup_steps=50, max_steps=400,
                         eval_every=100, save_every=400, precision="fp32", seed=0)
    valid = reversal_examples(100, seed=1)
    result = train(TINY_CONFIG, config, reversal_examples(3000, seed=0), valid, directory, progress=False)
    return TrainedTiny(directory, result, valid)


@pytest.fixture
def random_tiny() -> Transformer:
    """An untrained tiny model (seeded), in eval mode."""
    torch.manual_seed(0)
    return Transformer(TINY_CONFIG).eval()
