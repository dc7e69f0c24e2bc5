"""The admission queue of one batcher: rows admitted whole per request, or refused.

A request's rows (one per text) enter together or not at all: `NotReady` (503) once the queue
stops accepting (draining), `Overloaded` (429) when they would exceed `max_queue_size` (calls
of `Batcher.run` waiting count against it too), or when they are expected to take more than
a share of the time left to the request's deadline at the rate the batcher has been finishing
rows (`DrainRate`: the rows ahead of them, queued and decoding, and their own, divided by the
rows finished per second over the last seconds). Refusing those at once keeps an overloaded
server doing work that meets its deadlines instead of starting rows that time out. The share
adapts to the rows' outcomes (`AdmissionShare`): it grows while rows finish with time to spare,
so that the batch fills, and is cut when a row misses its deadline. A row may carry a deadline (`perf_counter`
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
from service.observability.timing import RequestTiming


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
    timing: RequestTiming | None = None  # its request's stage times (`Server-Timing`)

    @property
    def done(self) -> bool:
        """Its future is resolved: failed, cancelled or answered."""
        return self.future.done()


class AdmissionShare:
    """The share of a request's remaining time its rows may be expected to take (`expected_s`):
    the rest is left for what the estimate does not see (reading and answering the request
    while the event loop is busy, steps slower than the recent ones).

    Additive increase, multiplicative decrease on the outcomes of rows with a deadline, each
    as the time it took from admission over the time it had (`observe`): when one of the rows
    finished together missed its deadline the share is cut by `cut` and then held for `hold_s`
    (the rows admitted under the old share finish meanwhile); when all took at most `slack` of
    their time it grows by `step`; otherwise it stays. Always within [`low`, `high`].
    """

    def __init__(self, start: float = 0.5, low: float = 0.25, high: float = 0.9, slack: float = 0.75,
                 step: float = 0.01, cut: float = 0.7, hold_s: float = 1.0) -> None:
        self.value = start
        self.low, self.high, self.slack = low, high, slack
        self.step, self.cut, self.hold_s = step, cut, hold_s
        self._held_until = float("-inf")

    def observe(self, used: Collection[float], now: float) -> None:
        """Rows finished at `now`, each having used this share of its time (over 1: missed)."""
        if not used or now < self._held_until:
            return
        worst = max(used)
        if worst > 1.0:
            self.value = max(self.low, self.value * self.cut)
            self._held_until = now + self.hold_s
        elif worst <= self.slack:
            self.value = min(self.high, self.value + self.step)


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
        self.drain = DrainRate()  # the batcher records the rows it finishes (`finished`)
        self.share = AdmissionShare()
        self._publish_share()

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
        than the share (`AdmissionShare`) of them behind the queue and the `in_flight` rows decoding, at the
        drain rate), or None when they would be taken."""
        if not self.accepting:
            return "draining"
        if len(self._rows) + reserved + rows > self.limits.max_queue_size:
            return "queue_full"
        if budget_s is not None:
            expected = self.expected_s(rows, in_flight, time.perf_counter(), reserved)
            if expected is not None and expected > self.share.value * budget_s:
                return "expected_wait"
        return None

    def finished(self, rows: Collection[QueuedRow], now: float, cancelled: Collection[QueuedRow] = ()) -> None:
        """`rows` left their batch at `now` (`cancelled` of them cancelled by their request):
        the drain rate counts them all, the share the outcomes of those with a deadline (a row
        cancelled before its deadline -- its client went away -- tells nothing)."""
        self.drain.record(len(rows), now)
        gone = set(map(id, cancelled))
        used = [(now - row.enqueued_at) / max(row.deadline - row.enqueued_at, 1e-9)
                for row in rows if row.deadline is not None
                and (id(row) not in gone or now > row.deadline)]
        self.share.observe(used, now)
        self._publish_share()

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
        """Fail the queued rows whose deadline has passed (misses: `AdmissionShare`)."""
        expired = [row for row in self._rows
                   if row.deadline is not None and now >= row.deadline and not row.done]
        for row in expired:
            row.future.set_exception(DeadlineExceeded("the deadline passed while the request was queued"))
        if expired:
            self.share.observe([float("inf")], now)
            self._publish_share()

    def _publish_share(self) -> None:
        metrics.ADMISSION_SHARE.labels(self.model).set(self.share.value)

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
