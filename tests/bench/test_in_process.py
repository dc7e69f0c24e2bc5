"""The in-process ONNX runs: batching and length sorting keep each sentence's output."""

from __future__ import annotations

import random

import pytest

from bench.in_process import run_batches
from service.generation.search import generate


@pytest.mark.parametrize("batch_size", [1, 3, 64])
@pytest.mark.parametrize("sort_by_length", [False, True])
def test_run_batches_keeps_workload_order(tiny_runtime, batch_size: int, sort_by_length: bool) -> None:
    rng = random.Random(0)
    sources = [[rng.randrange(4, 20) for _ in range(rng.randrange(3, 9))] + [tiny_runtime.eos_id]
               for _ in range(7)]
    stats, outputs = run_batches(tiny_runtime, sources, batch_size, sort_by_length=sort_by_length)
    one_by_one = [generate(tiny_runtime, [s], 1, tiny_runtime.max_target_len)[0] for s in sources]
    assert [o.tokens for o in outputs] == [o.tokens for o in one_by_one]
    assert stats.sentences == 7
    assert stats.target_tokens == sum(len(o.tokens) for o in one_by_one)
    assert stats.latency_p50_s is not None and stats.latency_p50_s <= stats.elapsed_s + 1e-4  # elapsed_s is rounded


def test_run_batches_rejects_empty_batches(tiny_runtime) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        run_batches(tiny_runtime, [[tiny_runtime.eos_id]], 0)
