"""Throughput and latency numbers of one benchmark run: percentiles, sentences/s, tokens/s; and
the seconds spent in one method of given objects (`timed_calls`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RunStats:
    """What every run reports, whichever system it measured."""

    sentences: int
    target_tokens: int
    elapsed_s: float
    sentences_per_s: float
    tokens_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentiles(values: Sequence[float], points: Sequence[float] = (50, 95, 99)) -> list[float | None]:
    """Linear-interpolated percentiles of `values` (None each when there are none)."""
    if not values:
        return [None for _ in points]
    return [float(v) for v in np.percentile(np.asarray(values, dtype=np.float64), list(points))]


def summarise(latencies_s: Sequence[float], target_tokens: int, elapsed_s: float, errors: int = 0,
              sentences: int | None = None) -> RunStats:
    """RunStats of a run that completed `sentences` (default: one per latency) in `elapsed_s`."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed_s must be > 0, got {elapsed_s}")
    done = len(latencies_s) if sentences is None else sentences
    p50, p95, p99 = percentiles(latencies_s)
    return RunStats(done, target_tokens, round(elapsed_s, 4), done / elapsed_s, target_tokens / elapsed_s,
                    p50, p95, p99, errors)


@contextlib.contextmanager
def timed_calls(owners: Sequence[Any], method: str,
                clock: Callable[[], float] = time.perf_counter) -> Iterator[list[float]]:
    """Time every call of `method` on each of `owners` while the block runs: yields a list of
    the seconds summed over those calls (by `clock`: wall time, or e.g. `time.thread_time` for
    the calling thread's CPU) and their count. Each owner's method is wrapped as an attribute of
    the instance, and afterwards the instance has what it had before: the class's method again,
    or the wrapper of an enclosing `timed_calls` of the same method (they nest)."""
    seconds: list[float] = [0.0, 0]

    def wrapped(run: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return run(*args, **kwargs)
            finally:
                seconds[0] += clock() - started
                seconds[1] += 1
        return timed

    before = [vars(owner).get(method) for owner in owners]  # an enclosing block's wrapper, or None
    for owner in owners:
        setattr(owner, method, wrapped(getattr(owner, method)))
    try:
        yield seconds
    finally:
        for owner, previous in zip(owners, before, strict=True):
            if previous is None:
                delattr(owner, method)
            else:
                setattr(owner, method, previous)
