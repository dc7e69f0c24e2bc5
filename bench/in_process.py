"""The ceiling: the service's ONNX models and generation loop called in-process, no HTTP, no batcher."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from bench.stats import RunStats, summarise
from service.generation.search import GenerationResult, generate
from service.runtime import CPU, ModelRuntime


def load_runtime(model_dir: Path, threads: int = 0, variant: str | None = None,
                 providers: Sequence[str] = (CPU,)) -> ModelRuntime:
    """The model as the service would load it (its default variant unless `variant` is given)."""
    runtime = ModelRuntime.load(model_dir, list(providers), threads=threads, variant=variant)
    runtime.warmup()
    return runtime


def run_batches(runtime: ModelRuntime, sources: list[list[int]], batch_size: int, beam_size: int = 1,
                max_new_tokens: int | None = None,
                sort_by_length: bool = False) -> tuple[RunStats, list[GenerationResult]]:
    """Generate for `sources` in consecutive batches of `batch_size` rows; outputs in workload order.

    `sort_by_length` batches sources of similar length together (less padding), the lever the
    service's batcher could use. Latency of a sentence = the wall time of its batch. Tokens exclude EOS.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    limit = max_new_tokens or runtime.max_target_len
    order = list(range(len(sources)))
    if sort_by_length:
        order.sort(key=lambda i: len(sources[i]))
    latencies: list[float] = []
    outputs: dict[int, GenerationResult] = {}
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch_started = time.perf_counter()
        generated = generate(runtime, [sources[i] for i in rows], beam_size, limit, greedy_scores=False)
        latencies += [time.perf_counter() - batch_started] * len(rows)
        outputs.update(zip(rows, generated, strict=True))
    elapsed = time.perf_counter() - started
    ordered = [outputs[i] for i in range(len(sources))]
    return summarise(latencies, sum(len(o.tokens) for o in ordered), elapsed), ordered
