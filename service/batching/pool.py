"""Several batchers for one model, each with its own worker thread and running batch.

One decoder call leaves a CPU's cores partly idle: its small operators run on one thread, and
the numpy work between two steps (sampling, joins, compaction) holds the worker thread while
onnxruntime waits. Several running batches, each stepped by its own thread on its share of the
cores, keep them busy instead (`bench/results/levers` compares the worker counts).
onnxruntime sessions may be run from several threads at once, so the batchers share the
model's sessions.

A request of one row goes to one batcher with room in its queue. Among those whose work (queued
rows plus running rows, a beam-search row once per beam: `Batcher.load`) is within `length_slack`
rows of the least, it goes to the one whose rows' mean source length is closest to its own (an
idle batcher counts as a match). The batchers thus settle into bands of source length, and as
output length follows source length in translation and summarization, each running batch holds
rows of similar lengths: less source padding, and a shorter self-attention cache (a running
batch's cache is as long as its oldest row's output). With `length_slack` 0 the least loaded
batcher takes it.

A request of several rows (a text split into sentences, a list of texts) that finds two or more
batchers idle (nothing queued or running) is dealt out over them, so that every core works on
it: its rows in order of source length, cut into parts of about equal source tokens, one per
idle batcher. Otherwise it goes whole to one batcher as a one-row request does: a batcher
shared with a large request's rows joins newcomers into a large batch (larger groups, longer
steps), so the small requests beside a large one keep a batcher of their own. When a part
would be refused where it goes, the request goes whole to one batcher too (and is refused
there if it does not fit).

`run` calls (attention maps) go to the least loaded. The batchers share one
admission share (`service.batching.admission.AdmissionShare`). `queue_depth` is published as
the sum over the batchers, and the counters are summed (`max_batch_rows`: the largest).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from service.batching.batcher import BatchCounters, Batcher, Generated, results
from service.batching.policy import BatchLimits
from service.generation.hooks import RowHooks
from service.observability import metrics
from service.observability.timing import RequestTiming

T = TypeVar("T")


class BatcherPool:
    """The batchers of one model, used like one `Batcher`."""

    def __init__(self, model: str, batchers: Sequence[Batcher], length_slack: int = 0) -> None:
        if not batchers:
            raise ValueError("a pool needs at least one batcher")
        self.model = model
        self.batchers = list(batchers)
        self.length_slack = length_slack
        self._owners: dict[asyncio.Future[Any], Batcher] = {}  # enqueued rows not yet done
        self.max_cache_bytes = 0  # the most bytes the batchers' running batches held at once
        self._cache_lock = threading.Lock()  # batchers publish from their worker threads
        for batcher in self.batchers:
            batcher.on_depth = self._publish_depth
            batcher.on_cache = self._publish_cache
            # on the same cores, one admission share: a row late in one is late in all
            batcher.share = self.batchers[0].share

    @property
    def limits(self) -> BatchLimits:
        """One batcher's limits (each has its own queue of `max_queue_size` rows)."""
        return self.batchers[0].limits

    @property
    def depth(self) -> int:
        """Rows admitted and not yet in a batch, over all batchers."""
        return sum(b.depth for b in self.batchers)

    @property
    def running(self) -> int:
        """Rows now generating (not cancelled), over all batchers."""
        return sum(b.running for b in self.batchers)

    @property
    def continuous(self) -> bool:
        return self.batchers[0].continuous

    @property
    def counters(self) -> BatchCounters:
        """What the batchers have run since they started, together."""
        all_counters = [b.counters for b in self.batchers]
        return BatchCounters(
            batches=sum(c.batches for c in all_counters), rows=sum(c.rows for c in all_counters),
            max_batch_rows=max(c.max_batch_rows for c in all_counters),
            cancelled=sum(c.cancelled for c in all_counters),
            max_cache_bytes=self.max_cache_bytes,
        )

    @property
    def cache_bytes(self) -> int:
        """Bytes the running batches' keys/values hold now, over all batchers."""
        return sum(b.cache_bytes for b in self.batchers)

    def start(self) -> None:
        for batcher in self.batchers:
            batcher.start()

    def _pick(self, rows: int, source_len: float | None = None) -> Batcher:
        """The batcher for `rows` new rows of mean length `source_len` (see the module's
        docstring); when none has room in its queue, the least loaded (which refuses them)."""
        with_room = [b for b in self.batchers if b.depth + rows <= b.limits.max_queue_size]
        candidates = with_room or self.batchers
        loads = [b.load for b in candidates]
        least = min(loads)
        if source_len is None or not self.length_slack or not with_room:
            return candidates[loads.index(least)]
        near = [b for b, load in zip(candidates, loads, strict=True) if load <= least + self.length_slack]

        def distance(batcher: Batcher) -> float:
            count, tokens = batcher.source_tokens()
            return abs(tokens / count - source_len) if count else 0.0

        return min(near, key=distance)

    def out_of_reach(self, budget_s: float) -> str | None:
        """Why every batcher would refuse a one-row request with `budget_s` seconds (the first
        batcher's reason), or None when one would take it."""
        reasons = [b.out_of_reach(budget_s) for b in self.batchers]
        return reasons[0] if reasons and all(reasons) else None

    def _pick_for(self, sources: list[list[int]]) -> Batcher:
        return self._pick(len(sources), sum(map(len, sources)) / len(sources) if sources else None)

    def _parts(self, sources: list[list[int]], deadline: float | None) -> list[tuple[Batcher, list[int]]]:
        """Which batcher takes which rows of one request (indices into `sources`; see the
        module's docstring)."""
        idle = [b for b in self.batchers if not b.load] if len(sources) > 1 else []
        if len(idle) < 2:
            return [(self._pick_for(sources), list(range(len(sources))))]
        count = min(len(idle), len(sources))
        total = sum(map(len, sources))
        parts: list[list[int]] = [[] for _ in range(count)]
        before = 0
        for i in sorted(range(len(sources)), key=lambda i: len(sources[i])):
            # each row to the part its middle token falls in: parts of about equal source tokens
            parts[min(count - 1, int(count * (before + len(sources[i]) / 2) / total))].append(i)
            before += len(sources[i])
        dealt = [(b, part) for b, part in zip(idle, parts, strict=False) if part]
        budget_s = None if deadline is None else deadline - time.perf_counter()
        if len(dealt) < 2 or any(b.out_of_reach(budget_s, len(part)) for b, part in dealt):
            return [(self._pick_for(sources), list(range(len(sources))))]
        return dealt

    async def submit(self, sources: list[list[int]], beam_size: int, max_new_tokens: int,
                     deadline: float | None = None,
                     hooks: Sequence[RowHooks | None] | None = None,
                     timing: RequestTiming | None = None) -> list[Generated]:
        """`Batcher.submit` over the pool: the rows dealt out (`enqueue`), the results in order."""
        return await results(self.enqueue(sources, beam_size, max_new_tokens, hooks=hooks, deadline=deadline,
                                          timing=timing), self.cancel)

    def enqueue(self, sources: list[list[int]], beam_size: int, max_new_tokens: int,
                hooks: Sequence[RowHooks | None] | None = None,
                deadline: float | None = None,
                timing: RequestTiming | None = None) -> list[asyncio.Future[Generated]]:
        """`Batcher.enqueue` of each part of the request on its batcher (`_parts`), one future
        per row in the request's order; `cancel` finds each row's batcher again. All rows are
        admitted or none."""
        given = list(hooks) if hooks is not None else [None] * len(sources)
        if len(given) != len(sources):
            raise ValueError(f"{len(given)} hooks for {len(sources)} sources")
        futures: dict[int, asyncio.Future[Generated]] = {}
        try:
            for batcher, part in self._parts(sources, deadline):
                taken = batcher.enqueue([sources[i] for i in part], beam_size, max_new_tokens,
                                        hooks=[given[i] for i in part], deadline=deadline, timing=timing)
                for i, future in zip(part, taken, strict=True):
                    futures[i] = future
                    self._owners[future] = batcher
                    future.add_done_callback(self._forget)
        except BaseException:  # a later part refused after all: the parts admitted leave again
            for future in futures.values():
                self.cancel(future)
            raise
        return [futures[i] for i in range(len(sources))]

    def _forget(self, future: asyncio.Future[Any]) -> None:
        self._owners.pop(future, None)

    def cancel(self, future: asyncio.Future[Generated]) -> str | None:
        """`Batcher.cancel` on the batcher that holds the row (None when it is done)."""
        batcher = self._owners.get(future)
        return batcher.cancel(future) if batcher is not None else None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the worker thread of the least loaded batcher, between its batches."""
        return await self._pick(1).run(fn, *args)

    async def close(self, timeout_s: float) -> None:
        """Drain and stop every batcher (at most `timeout_s`, together)."""
        await asyncio.gather(*(b.close(timeout_s) for b in self.batchers))

    def _publish_depth(self) -> None:
        metrics.QUEUE_DEPTH.labels(self.model).set(self.depth)

    def _publish_cache(self) -> None:
        with self._cache_lock:
            held = self.cache_bytes
            self.max_cache_bytes = max(self.max_cache_bytes, held)
            metrics.BATCH_CACHE_BYTES.labels(self.model).set(held)
