"""Where one request's time went, answered in its `Server-Timing` response header.

The route starts a `RequestTiming` when it begins, the batcher records its rows' passage (queued,
taken into a batch by the model's worker thread, the continuous batch's joins that added them,
finished), and the route writes the header (W3C Server Timing: `name;dur=<ms>`) on a successful
answer, when the response is built; a streamed answer, whose headers leave before the work, gives
the same stages in its final event:

- `prepare`: the route's checks, sentence splitting and tokenization, until the rows are queued;
- `queue`: the longest any of its rows waited until the worker thread took it into a batch
  (behind other rows, a join group, the worker's current decoder step or other work);
- `join`: worker-thread time of the joins that added its rows to the running batch (their
  encoder calls and slot writes; each join counted once; a request dealt over several batch
  workers counts the worker that spent the most; absent for request-level batches);
- `inference`: from its first row taken into a batch to its last row finishing (`join` is part
  of it);
- `total`: from the route's start to the response built (before its serialization and sending).

The stages overlap (`join` within `inference`; a row still queued while another decodes), so they
do not add up. Request parsing and validation before the route, and writing the response, are not
in them: the client's own latency minus `total` is what those and the network took.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

SERVER_TIMING = "Server-Timing"  # the response header


@dataclass(eq=False)
class RequestTiming:
    """One request's stage times (`perf_counter` seconds). The event loop records queueing and
    finishing, the model's worker threads taking rows into batches and joins (under the lock);
    all of it happens before the rows' futures resolve, so the route reads a complete record once
    every row is done."""

    started: float  # the route began
    enqueued: float | None = None  # its rows entered the batcher's queue
    first_admitted: float | None = None  # its first row was taken into a batch
    longest_wait_s: float = 0.0  # the longest a row waited in the queue
    finished: float | None = None  # its last row finished
    _joins: dict[int, float] = field(default_factory=dict, repr=False)  # worker thread -> join seconds
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def join_s(self) -> float:
        """Seconds of the joins that added its rows, on the worker that spent the most."""
        with self._lock:
            return max(self._joins.values(), default=0.0)

    def queued(self, now: float) -> None:
        """Its rows (or the first part of them, dealt over several batchers) entered the queue."""
        with self._lock:
            if self.enqueued is None:
                self.enqueued = now

    def admitted(self, now: float, enqueued_at: float) -> None:
        """One of its rows, queued at `enqueued_at`, was taken into a batch at `now` (any thread)."""
        with self._lock:
            if self.first_admitted is None or now < self.first_admitted:
                self.first_admitted = now
            self.longest_wait_s = max(self.longest_wait_s, now - enqueued_at)

    def joined(self, seconds: float) -> None:
        """A join in the calling worker thread that added some of its rows took `seconds` (call
        once per join)."""
        worker = threading.get_ident()
        with self._lock:
            self._joins[worker] = self._joins.get(worker, 0.0) + seconds

    def finished_at(self, now: float) -> None:
        """One of its rows finished at `now`."""
        with self._lock:
            if self.finished is None or now > self.finished:
                self.finished = now

    def stages(self, ended: float) -> list[tuple[str, float]]:
        """(name, milliseconds) of each stage the request went through, as the module lists them."""
        join_s = self.join_s
        stages: list[tuple[str, float]] = []
        if self.enqueued is not None:
            stages.append(("prepare", self.enqueued - self.started))
            if self.first_admitted is not None:
                stages.append(("queue", self.longest_wait_s))
                if join_s > 0:
                    stages.append(("join", join_s))
                if self.finished is not None:
                    stages.append(("inference", self.finished - self.first_admitted))
        stages.append(("total", ended - self.started))
        return [(name, max(seconds, 0.0) * 1000) for name, seconds in stages]

    def intervals(self) -> list[tuple[str, float, float]]:
        """(name, start, end) in `perf_counter` seconds of the stages with a place in time, for a
        trace: `prepare`, `queue` (from the rows' queueing, as long as the longest wait) and
        `inference`; those the request did not reach are left out."""
        intervals: list[tuple[str, float, float]] = []
        if self.enqueued is not None:
            intervals.append(("prepare", self.started, self.enqueued))
            if self.first_admitted is not None:
                intervals.append(("queue", self.enqueued, self.enqueued + self.longest_wait_s))
                if self.finished is not None:
                    intervals.append(("inference", self.first_admitted, self.finished))
        return intervals

    def milliseconds(self, ended: float) -> dict[str, float]:
        """The stages at `ended` by name, in milliseconds to the microsecond (a streamed answer's
        final event carries them)."""
        return {name: round(ms, 3) for name, ms in self.stages(ended)}

    def header(self, ended: float) -> str:
        """The `Server-Timing` header's value at `ended`: `prepare;dur=0.412, queue;dur=0.103, ...`."""
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in self.stages(ended))
