"""The admission queue of one batcher: rows admitted whole per request, or refused.

A request's rows (one per text) enter together or not at all: `NotReady` (503) once the queue
stops accepting (draining), `Overloaded` (429) when they would exceed `max_queue_size` (calls
of `Batcher.run` waiting count against it too). A row may carry a deadline (`perf_counter`
seconds): one still queued when it passes fails with `DeadlineExceeded` and never reaches the
model. Rows leave the queue when a batch takes them, when their request cancels them, or, done
already, when they reach its head.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from service.batching.policy import BatchLimits, RowKey
from service.core.errors import DeadlineExceeded, NotReady, Overloaded
from service.generation.hooks import RowHooks
from service.observability import metrics


@dataclass(eq=False)
class QueuedRow:
    """One source, the options it is generated with, and the future its request awaits."""

    source: list[int]
    key: RowKey
    future: asyncio.Future[Any]
    hooks: RowHooks = field(default_factory=RowHooks)
    enqueued_at: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # perf_counter seconds
    started_at: float = 0.0  # when it joined a batch

    @property
    def done(self) -> bool:
        """Its future is resolved: failed, cancelled or answered."""
        return self.future.done()


class AdmissionQueue:
    """The rows of one batcher waiting for a batch, oldest first."""

    def __init__(self, model: str, limits: BatchLimits, on_change: Callable[[], None]) -> None:
        self.model = model
        self.limits = limits
        self.accepting = True
        self._rows: deque[QueuedRow] = deque()
        self._on_change = on_change  # called whenever the number of queued rows changes

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[QueuedRow]:
        return iter(self._rows)

    @property
    def head(self) -> QueuedRow | None:
        return self._rows[0] if self._rows else None

    def check_room(self, rows: int, reserved: int = 0) -> None:
        """Raise (and count) unless `rows` more rows fit beside `reserved` other waiting work."""
        if not self.accepting:
            metrics.REJECTED_TOTAL.labels(self.model, "draining").inc()
            raise NotReady("the server is shutting down")
        if len(self._rows) + reserved + rows > self.limits.max_queue_size:
            metrics.REJECTED_TOTAL.labels(self.model, "queue_full").inc()
            raise Overloaded(f"the queue of model {self.model!r} is full", self.limits.retry_after_s)

    def admit(self, rows: list[QueuedRow]) -> None:
        """Append one request's rows (after `check_room`)."""
        self._rows.extend(rows)
        self._on_change()

    def cancel(self, future: asyncio.Future[Any]) -> bool:
        """Remove the row of `future`; False when it is not queued."""
        for row in self._rows:
            if row.future is future:
                self._rows.remove(row)
                self._on_change()
                return True
        return False

    def expire(self, now: float) -> None:
        """Fail the queued rows whose deadline has passed."""
        for row in self._rows:
            if row.deadline is not None and now >= row.deadline and not row.done:
                row.future.set_exception(DeadlineExceeded("the deadline passed while the request was queued"))

    def drop_done_head(self) -> None:
        """Remove the resolved rows at the head, so `head` is a row still waiting."""
        while self._rows and self._rows[0].done:
            self._rows.popleft()
        self._on_change()

    def take(self, chosen: Collection[QueuedRow]) -> None:
        """Remove the rows a batch took, and every resolved row."""
        taken = set(map(id, chosen))
        self._rows = deque(row for row in self._rows if id(row) not in taken and not row.done)
        self._on_change()

    def clear(self) -> list[QueuedRow]:
        """Remove and return every row (shutdown)."""
        rows, self._rows = list(self._rows), deque()
        self._on_change()
        return rows
