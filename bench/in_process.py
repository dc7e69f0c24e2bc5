"""The ceiling: the service's ONNX models and generation loop called in-process, no HTTP, no batcher."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from bench.stats import RunStats, summarise
from service.generation import GenerationResult, generate
from service.runtime import CPU, ModelRuntime


def load_runtime(model_dir: Path, threads: int = 0, variant: str | None = None,
                 providers: Sequence[str] = (CPU,)) -> ModelRuntime:
    """The model as the service would load it (its default variant unless `variant` is given)."""
    runtime = ModelRuntime.load(model_dir, list(providers), threads=threads, variant=variant)
    runtime.warmup()
    return runtime


def run_batches(runtime: ModelRuntime, sources: list[list[int]], batch_size: int, beam_size: int = 1,
                max_new_tokens: int | None = None) -> tuple[RunStats, list[GenerationResult]]:
    """Generate for `sources` in consecutive batches of `batch_size` rows, in workload order.

    Latency of a sentence = the wall time of the batch it was in. Tokens exclude EOS.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    limit = max_new_tokens or runtime.max_target_len
    latencies: list[float] = []
    outputs: list[GenerationResult] = []
    started = time.perf_counter()
    for start in range(0, len(sources), batch_size):
        batch = sources[start:start + batch_size]
        batch_started = time.perf_counter()
        outputs += generate(runtime, batch, beam_size, limit)
        latencies += [time.perf_counter() - batch_started] * len(batch)
    elapsed = time.perf_counter() - started
    return summarise(latencies, sum(len(o.tokens) for o in outputs), elapsed), outputs
