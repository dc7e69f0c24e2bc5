"""The ceiling: the service's ONNX models and generation loops called in-process, no HTTP, no
batcher; tuned over a grid as CTranslate2 is (engine, batch size, replicas x threads)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench.stats import RunStats, summarise
from service.batching.slot_batch import generate_running
from service.generation.search import GenerationResult, generate
from service.runtime import CPU, ModelRuntime

T = TypeVar("T")


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


ENGINES = ("batches", "running")


@dataclass(frozen=True)
class InProcessSettings:
    """One in-process run, as a user tunes it: the engine (`batches`: request-level `generate`
    over batches of `size` sources of similar length; `running`: `generate_running`, a running
    batch of `size` slots), `replicas` (threads, each running its own batches, taking the work from
    one shared queue as it goes) and `threads` (intra-op threads of the sessions they share)."""

    engine: str
    size: int
    replicas: int = 1
    threads: int = 1

    def __post_init__(self) -> None:
        if self.engine not in ENGINES or min(self.size, self.replicas, self.threads) < 1:
            raise ValueError(f"engine one of {ENGINES}, size, replicas and threads >= 1: {self}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def thread_grid(cores: int | None = None) -> list[tuple[int, int]]:
    """(replicas, threads) pairs covering `cores` cores: one replica on every core, one
    single-threaded replica per core, and two replicas sharing the cores when there are at least
    four (CTranslate2's grid, `bench.ctranslate2_runs.thread_grid`, without its default)."""
    cores = cores or os.cpu_count() or 1
    pairs = [(1, cores), (cores, 1)]
    if cores >= 4:
        pairs.append((2, cores // 2))
    return list(dict.fromkeys(pairs))


def settings_grid(sizes: Sequence[int] = (32, 64), cores: int | None = None) -> list[InProcessSettings]:
    """Both engines at every size of `sizes` with every pair of `thread_grid`."""
    return [InProcessSettings(engine, size, replicas, threads) for replicas, threads in thread_grid(cores)
            for engine in ENGINES for size in sizes]


class _Shared(Generic[T]):
    """An iterator several threads read from, one item at a time under a lock."""

    def __init__(self, items: Iterable[T]) -> None:
        self._items = iter(items)
        self._lock = threading.Lock()

    def __iter__(self) -> _Shared[T]:
        return self

    def __next__(self) -> T:
        with self._lock:
            return next(self._items)


def run_settings(runtime: ModelRuntime, sources: list[list[int]], settings: InProcessSettings,
                 max_new_tokens: int | None = None) -> tuple[RunStats, list[GenerationResult]]:
    """Greedy outputs of `sources` (in workload order) at `settings` on `runtime` (loaded with
    `settings.threads`), and the run's stats. Latency of a sentence: its batch's wall time
    (`batches`), or from its joining the running batch to its row's end (`running`)."""
    limit = max_new_tokens or runtime.max_target_len
    outputs: dict[int, GenerationResult] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    if settings.engine == "batches":
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        batches = _Shared(order[start:start + settings.size] for start in range(0, len(order), settings.size))

        def replica() -> None:
            for rows in batches:
                started = time.perf_counter()
                generated = generate(runtime, [sources[i] for i in rows], 1, limit, greedy_scores=False)
                took = time.perf_counter() - started
                with lock:
                    latencies.extend([took] * len(rows))
                    outputs.update(zip(rows, generated, strict=True))
    else:
        joined: dict[int, float] = {}

        def timed() -> Iterator[tuple[int, list[int]]]:
            for i, source in enumerate(sources):
                joined[i] = time.perf_counter()
                yield i, source

        feed = _Shared(timed())

        def replica() -> None:
            for i, result in generate_running(runtime, feed, settings.size, limit):
                with lock:
                    latencies.append(time.perf_counter() - joined[i])
                    outputs[i] = result

    started = time.perf_counter()
    with ThreadPoolExecutor(settings.replicas) as pool:
        for future in [pool.submit(replica) for _ in range(settings.replicas)]:
            future.result()
    elapsed = time.perf_counter() - started
    ordered = [outputs[i] for i in range(len(sources))]
    return summarise(latencies, sum(len(o.tokens) for o in ordered), elapsed), ordered


def run_grid(model_dir: Path, sources: list[list[int]], grid: Sequence[InProcessSettings],
             max_new_tokens: int | None = None, variant: str | None = None,
             providers: Sequence[str] = (CPU,)) -> dict[str, Any]:
    """Every point of `grid` (one runtime loaded per thread count; `running` points only for a
    model with a step graph): `points` (settings and stats each) and `best` (the highest
    sentences/s)."""
    points: list[dict[str, Any]] = []
    for threads in dict.fromkeys(s.threads for s in grid):
        runtime = load_runtime(model_dir, threads, variant, providers)
        for settings in (s for s in grid if s.threads == threads and (s.engine == "batches" or runtime.step)):
            stats, _ = run_settings(runtime, sources, settings, max_new_tokens)
            points.append({"settings": settings.to_dict(), **stats.to_dict()})
        del runtime
    return {"points": points, "best": max(points, key=lambda p: p["sentences_per_s"])}
