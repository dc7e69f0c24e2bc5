"""The admission queue of one batcher: rows admitted whole per request, or refused.

A request's rows (one per text) enter together or not at all: `NotReady` (503) once the queue
stops accepting (draining), `Overloaded` (429) when they would exceed `max_queue_size` (calls
of `Batcher.run` waiting count against it too), or when they are expected to take more than
`DEADLINE_SHARE` of the time left to the request's deadline at the rate the batcher has been
finishing rows (`DrainRate`: the rows ahead of them, queued and decoding, and their own,
divided by the rows finished per second over the last seconds). Refusing those at once keeps an overloaded server doing work that meets its
deadlines instead of starting rows that time out. A row may carry a deadline (`perf_counter`
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


# The share of a request's remaining time its rows may be expected to take (`expected_s`); the
# rest is left for what the estimate does not see (reading and answering the request while the
# event loop is busy, a slower step than the recent ones).
DEADLINE_SHARE = 0.5


class DrainRate:
    """Rows a batcher finished per second over the last `window_s` seconds; None until at least
    `min_rows` rows finished in that window, spread over at least a quarter of it (too few to
    tell, e.g. after an idle spell)."""

    def __init__(self, window_s: float = 5.0, min_rows: int = 16) -> None:
        self.window_s = window_s
        self.min_rows = min_rows
        self._finished: deque[tuple[float, int]] = deque()  # (perf_counter, rows)
        self._rows = 0

    def record(self, rows: int, now: float) -> None:
        """`rows` rows finished at `now`."""
        self._finished.append((now, rows))
        self._rows += rows
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """Rows per second, or None (see the class)."""
        self._trim(now)
        if self._rows < self.min_rows:
            return None
        span = now - self._finished[0][0]
        return self._rows / span if span >= self.window_s / 4 else None

    def _trim(self, now: float) -> None:
        while self._finished and self._finished[0][0] < now - self.window_s:
            self._rows -= self._finished.popleft()[1]


class AdmissionQueue:
    """The rows of one batcher waiting for a batch, oldest first."""

    def __init__(self, model: str, limits: BatchLimits, on_change: Callable[[], None]) -> None:
        self.model = model
        self.limits = limits
        self.accepting = True
        self._rows: deque[QueuedRow] = deque()
        self._on_change = on_change  # called whenever the number of queued rows changes
        self.drain = DrainRate()  # the batcher records the rows it finishes

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[QueuedRow]:
        return iter(self._rows)

    @property
    def head(self) -> QueuedRow | None:
        return self._rows[0] if self._rows else None

    def check_room(self, rows: int, reserved: int = 0, deadline: float | None = None,
                   in_flight: int = 0) -> None:
        """Raise (and count) unless `rows` more rows fit beside `reserved` other waiting work,
        and, with a `deadline`, could be done by then behind the queue and the `in_flight` rows
        decoding, at the drain rate."""
        budget_s = None if deadline is None else deadline - time.perf_counter()
        reason = self.refusal(rows, budget_s, in_flight, reserved)
        if reason is None:
            return
        metrics.REJECTED_TOTAL.labels(self.model, reason).inc()
        if reason == "draining":
            raise NotReady("the server is shutting down")
        if reason == "queue_full":
            raise Overloaded(f"the queue of model {self.model!r} is full", self.limits.retry_after_s)
        raise Overloaded(f"model {self.model!r} would not finish these rows within the deadline "
                         f"({len(self._rows) + reserved + in_flight} rows ahead)", self.limits.retry_after_s)

    def refusal(self, rows: int, budget_s: float | None, in_flight: int, reserved: int = 0) -> str | None:
        """Why `rows` more rows would be refused ("draining"; "queue_full" beside `reserved`
        other waiting work; "expected_wait": with `budget_s` seconds left, expected to take more
        than `DEADLINE_SHARE` of them behind the queue and the `in_flight` rows decoding, at the
        drain rate), or None when they would be taken."""
        if not self.accepting:
            return "draining"
        if len(self._rows) + reserved + rows > self.limits.max_queue_size:
            return "queue_full"
        if budget_s is not None:
            expected = self.expected_s(rows, in_flight, time.perf_counter(), reserved)
            if expected is not None and expected > DEADLINE_SHARE * budget_s:
                return "expected_wait"
        return None

    def expected_s(self, rows: int, in_flight: int, now: float, reserved: int = 0) -> float | None:
        """Seconds until `rows` more rows would be done behind the queue and the `in_flight`
        rows decoding, at the drain rate; None while the rate is unknown."""
        rate = self.drain.rate(now)
        return None if rate is None else (len(self._rows) + reserved + in_flight + rows) / rate

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
