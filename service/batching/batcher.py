"""Dynamic batching for one model: a bounded queue, one future per row, a worker thread.

Requests are admitted row by row (one row per text) into a bounded queue, or refused whole
with `Overloaded` (429). A loop on the event loop takes the oldest row and waits at most
`max_wait_s` for compatible rows (same beam size and token limit) to join it, up to
`max_batch_size` rows and `max_batch_tokens` padded source tokens (times the beams). The batch
is sorted by source length and generated in the model's own single worker thread, so the
event loop never blocks. If generation raises, every row of that batch fails with
`InternalError` and the loop goes on with the next batch. A row may carry a deadline
(`perf_counter` seconds): one still queued when it passes fails with `DeadlineExceeded`
without reaching the model. Other work on the model (attention
maps) runs in the same worker thread between batches, through `run`.

Continuous batching (given a `running_batch` factory, `service.batching.running_batch.RunningBatch`):
greedy rows do not wait for a batch to end. They join the running batch between two decoder
steps (up to `max_batch_size` rows and `max_batch_tokens` padded source tokens in it) and leave
it, their futures resolved, as soon as they finish. A join costs an encoder call and (unless
the newcomers fit in the slots of rows that left) a copy of the batch's state, so rows join in
groups of a quarter of the running batch (at most `join_rows`, a quarter of `max_batch_size`;
at once into a batch of fewer than 4 rows), or
when the oldest has waited `max_join_wait_s` -- unless more rows wait than fit: then they wait
for room for a whole group. With `max_join_age`, rows wait while the batch's oldest row has run
more than `join_age_limit` steps: every row's cache is as long as the oldest row's output, so a
join into an old batch makes every step longer, and under load a shorter cache saves more than a
fuller batch gains. The limit is `max_join_age` for a batch of `join_rows` rows and scales
inversely with the rows, so a small batch (light load) still takes newcomers at once. It
applies only to a running batch that pads (`pads_to_oldest`): on the step graph
(`service.batching.slot_batch.SlotBatch`) each row's cache is its own. The
worker thread steps the running batch until something new arrives (a row, a `run` call, shutdown) or that wait runs out, then the loop decides. A new
running batch starts at once: later rows join it. Beam-search rows still form request-level batches, run
between two steps of the running batch when they are the oldest queued rows.

Every row carries `RowHooks`, and the generation function is called with them (`hooks=`, one
per row): it drops a row from the batch at the next decoder step once its `cancel` is set
(greedy rows leave the running or request-level batch; a beam-search row stops its search), and
calls `on_token` (in the worker thread) for each token of a streamed row as it is decoded.
`cancel(future)` cancels a row wherever it is: a queued row leaves the queue, a running row is
flagged; both are counted in `cancelled_rows_total{stage}`. A request whose wait ends early --
its deadline passed, its client left, another of its rows failed -- cancels its rows that way
(`submit`), so no abandoned row costs more than the step it was in.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from service.batching.in_flight import InFlightBatch
from service.errors import DeadlineExceeded, InternalError, NotReady, Overloaded
from service.generation.hooks import RowHooks
from service.observability import metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Generated(Protocol):
    """What the generation function returns per row (`service.generation.search.GenerationResult`)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def finish_reason(self) -> str: ...


# (sources ending with EOS, beam_size, max_new_tokens) -> one result per source, in order;
# called with `hooks=[RowHooks, ...]` (one per source) by the batcher.
GenerateFn = Callable[..., Sequence[Generated]]


def join_age_limit(max_join_age: int, join_rows: int, rows: int) -> int:
    """The most decoder steps a running batch of `rows` rows may have run (its oldest row) and
    still take newcomers: `max_join_age` at `join_rows` rows, scaled inversely with the rows, so
    that rows x age -- the cached positions each step carries -- stays within the same budget
    (with the defaults, 24 x 16: age 96 at 4 rows, 24 at 16, 6 at 64)."""
    return max_join_age * join_rows // max(rows, 1)


@dataclass(frozen=True)
class BatchLimits:
    """How large a batch may grow, how long it waits to fill, how many rows may queue."""

    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_wait_s: float = 0.005
    max_join_wait_s: float = 0.1  # continuous batching: longest wait to join in a group
    max_join_age: int = 0  # continuous batching: the join age limit of a batch of `join_rows` rows (0: any)
    max_queue_size: int = 256
    retry_after_s: int = 1


@dataclass
class BatchCounters:
    """What the batcher has run since it started."""

    batches: int = 0
    rows: int = 0
    max_batch_rows: int = 0
    cancelled: int = 0


@dataclass(frozen=True)
class _Key:
    """Rows batch together only when they share these generation options."""

    beam_size: int
    max_new_tokens: int


@dataclass(eq=False)
class _Row:
    """One queued source and the future its request awaits."""

    source: list[int]
    key: _Key
    future: asyncio.Future[Generated]
    hooks: RowHooks = field(default_factory=RowHooks)
    enqueued_at: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # perf_counter seconds
    started_at: float = 0.0  # when it joined a batch


class Batcher:
    """Groups concurrent rows of one model into batches and runs them in a worker thread."""

    def __init__(self, model: str, generate_fn: GenerateFn, limits: BatchLimits,
                 running_batch: Callable[[], InFlightBatch[Any]] | None = None,
                 thread_name: str | None = None) -> None:
        self.model = model
        self.limits = limits
        self.counters = BatchCounters()
        self._generate = generate_fn
        # continuous batching of greedy rows; touched only in the worker thread while it steps
        self._batch = running_batch() if running_batch is not None else None
        self._interrupt = threading.Event()  # tells the worker to hand back between two steps
        self._inbox: list[_Row] = []  # rows admitted to the running batch, not yet added by the worker
        self._inbox_lock = threading.Lock()
        self._stepping: asyncio.Future[None] | None = None  # the worker stepping the running batch
        self._queue: deque[_Row] = deque()
        self._running: list[_Row] = []  # the request-level batch now generating
        self._decoding: list[_Row] = []  # the rows of the running batch (continuous batching)
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._jobs = 0  # calls of `run` admitted and not finished
        self._jobs_done = asyncio.Event()
        self._jobs_done.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name or f"batch-{model}")
        self._task: asyncio.Task[None] | None = None
        # publishes `queue_depth` when the queue changes; a `BatcherPool` sets it to publish
        # the sum over the model's batchers
        self.on_depth: Callable[[], None] | None = None

    @property
    def depth(self) -> int:
        """Rows admitted and not yet in a batch."""
        return len(self._queue)

    def source_tokens(self) -> tuple[int, int]:
        """(rows, their source tokens) queued or generating: what `BatcherPool` routes by."""
        rows = [*self._queue, *self._running, *self._decoding]
        return len(rows), sum(len(row.source) for row in rows)

    def _publish_depth(self) -> None:
        if self.on_depth is not None:
            self.on_depth()
        else:
            metrics.QUEUE_DEPTH.labels(self.model).set(len(self._queue))

    @property
    def continuous(self) -> bool:
        """Whether greedy rows join a running batch between decoder steps."""
        return self._batch is not None

    @property
    def running(self) -> int:
        """Rows of the batch now generating that are not cancelled."""
        return sum(1 for row in [*self._running, *self._decoding] if not row.hooks.cancelled)

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"batcher-{self.model}"
            )

    async def submit(
        self, sources: list[list[int]], beam_size: int, max_new_tokens: int,
        deadline: float | None = None,
    ) -> list[Generated]:
        """Generate for every source (ids ending with EOS); results in the same order.

        Raises `Overloaded` when the rows do not fit in the queue, `NotReady` while draining,
        `DeadlineExceeded` when a row was still queued at `deadline` (`perf_counter`),
        `InternalError` when the batch of any row failed.
        """
        futures = self.enqueue(sources, beam_size, max_new_tokens, deadline=deadline)
        if not futures:
            return []
        try:
            # `wait`, not `gather`: cancelling this wait leaves the rows' futures to `cancel`
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            for future in futures:
                if future.done() and not future.cancelled() and future.exception() is not None:
                    future.result()  # the first failure, raised
            return [future.result() for future in futures]
        except BaseException:  # cancelled (deadline, disconnect) or a row failed
            for future in futures:
                if not future.done():
                    self.cancel(future)  # leaves the queue, or the batch at the next step
                elif not future.cancelled():
                    future.exception()  # retrieved: no "never retrieved" warning
            raise

    def enqueue(
        self,
        sources: list[list[int]],
        beam_size: int,
        max_new_tokens: int,
        hooks: Sequence[RowHooks | None] | None = None,
        deadline: float | None = None,
    ) -> list[asyncio.Future[Generated]]:
        """Admit all rows of one request, or none; returns one future per row.

        `hooks`, one per source, make rows streamed (`RowHooks`); a row without gets its own
        (its cancel flag).
        """
        if not self._accepting:
            metrics.REJECTED_TOTAL.labels(self.model, "draining").inc()
            raise NotReady("the server is shutting down")
        if len(self._queue) + len(sources) > self.limits.max_queue_size:
            metrics.REJECTED_TOTAL.labels(self.model, "queue_full").inc()
            raise Overloaded(
                f"the queue of model {self.model!r} is full", self.limits.retry_after_s
            )
        loop = asyncio.get_running_loop()
        key = _Key(beam_size, max_new_tokens)
        given = list(hooks) if hooks is not None else [None] * len(sources)
        if len(given) != len(sources):
            raise ValueError(f"{len(given)} hooks for {len(sources)} sources")
        rows = [
            _Row(list(source), key, loop.create_future(), hook or RowHooks(), deadline=deadline)
            for source, hook in zip(sources, given, strict=True)
        ]
        self._queue.extend(rows)
        self._publish_depth()
        self._idle.clear()
        self._arrived.set()
        return [row.future for row in rows]

    def cancel(self, future: asyncio.Future[Generated]) -> str | None:
        """Cancel the row of `future`; returns where it was ("queued" or "decoding").

        A queued row leaves the queue; a running row has its hooks' `cancel` set, so the
        generation loop drops it at the next decoder step. None when the row already finished
        or is unknown.
        """
        if future.done():
            return None
        stage: str | None = None
        for row in self._queue:
            if row.future is future:
                self._queue.remove(row)
                self._publish_depth()
                stage = "queued"
                break
        else:
            for row in [*self._running, *self._decoding]:
                if row.future is future:
                    row.hooks.cancel.set()
                    stage = "decoding"
                    break
        future.cancel()
        if stage is not None:
            self.counters.cancelled += 1
            metrics.CANCELLED_ROWS_TOTAL.labels(self.model, stage).inc()
        return stage

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the model's worker thread, between batches (never beside one).

        Admitted like rows: `NotReady` while draining, `Overloaded` when the queue and the
        calls waiting fill `max_queue_size`; `InternalError` when `fn` raises (logged).
        """
        if not self._accepting:
            metrics.REJECTED_TOTAL.labels(self.model, "draining").inc()
            raise NotReady("the server is shutting down")
        if len(self._queue) + self._jobs + 1 > self.limits.max_queue_size:
            metrics.REJECTED_TOTAL.labels(self.model, "queue_full").inc()
            raise Overloaded(
                f"the queue of model {self.model!r} is full", self.limits.retry_after_s
            )
        self._jobs += 1
        self._jobs_done.clear()
        self._interrupt.set()  # the running batch hands the worker over between two steps
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except Exception as error:
            logger.error("model %s: %s failed", self.model, getattr(fn, "__name__", fn),
                         exc_info=error)
            raise InternalError("inference failed") from None
        finally:
            self._jobs -= 1
            if not self._jobs:
                self._jobs_done.set()

    async def close(self, timeout_s: float) -> None:
        """Stop admitting, let queued and running rows finish (up to `timeout_s`), stop."""
        self._accepting = False
        self._arrived.set()
        self._interrupt.set()
        try:
            await asyncio.wait_for(
                asyncio.gather(self._idle.wait(), self._jobs_done.wait()), timeout_s
            )
        except TimeoutError:
            logger.error("model %s: %d rows still queued after %.0fs of draining",
                         self.model, len(self._queue), timeout_s)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for row in [*self._running, *self._decoding, *self._queue]:  # left when draining timed out
            if not row.future.done():
                row.future.set_exception(NotReady("the server is shutting down"))
        self._queue.clear()
        self._publish_depth()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        """Form batches forever: wait for a row, let the batch fill, run it; or admit rows to
        the running batch and keep the worker stepping it."""
        while True:
            self._expire()
            self._drop_cancelled_head()
            stepping = self._stepping is not None and not self._stepping.done()
            if not self._queue and not self._decoding and not stepping:
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
                continue
            head = self._queue[0] if self._queue else None
            if head is not None and not self._joins_running_batch(head):
                if stepping:  # pause the running batch between two steps
                    self._interrupt.set()
                    await self._stop_stepping()
                await self._fill_and_run(head, wait=not self._decoding)
                continue
            self._admit(self._take_joiners())
            if self._decoding and not stepping:
                self._start_stepping()
            await self._wait_for_news()

    async def _fill_and_run(self, head: _Row, wait: bool = True) -> None:
        """A request-level batch: wait up to `max_wait_s` for rows of `head`'s key (not while
        a running batch is paused for it), run it."""
        flush_at = head.enqueued_at + self.limits.max_wait_s
        while wait and self._accepting and not self._select(head.key)[1]:
            remaining = flush_at - time.perf_counter()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        self._expire()
        rows = self._take(head.key)
        if rows:
            await self._run(rows)

    def _expire(self) -> None:
        """Fail the queued rows whose deadline has passed (they never reach the model)."""
        now = time.perf_counter()
        for row in self._queue:
            if row.deadline is not None and now >= row.deadline and not row.future.done():
                row.future.set_exception(
                    DeadlineExceeded("the deadline passed while the request was queued")
                )

    def _drop_cancelled_head(self) -> None:
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()
        self._publish_depth()

    def _select(self, key: _Key) -> tuple[list[_Row], bool]:
        """The rows the next batch of `key` would take, oldest first, and whether it is full."""
        chosen: list[_Row] = []
        longest = 0
        for row in self._queue:
            if row.key != key or row.future.done():
                continue
            if len(chosen) == self.limits.max_batch_size:
                return chosen, True
            width = max(longest, len(row.source))
            tokens = (len(chosen) + 1) * width * key.beam_size
            if chosen and tokens > self.limits.max_batch_tokens:
                return chosen, True
            chosen.append(row)
            longest = width
        return chosen, len(chosen) == self.limits.max_batch_size

    def _joins_running_batch(self, row: _Row) -> bool:
        return self._batch is not None and row.key.beam_size == 1

    @property
    def join_rows(self) -> int:
        """The largest group rows join the running batch in (a quarter of `max_batch_size`)."""
        return max(1, self.limits.max_batch_size // 4)

    def _take_joiners(self) -> list[_Row]:
        """Remove from the queue the greedy rows that fit in the running batch, oldest first,
        when they may join now (see the module's docstring); else none."""
        assert self._batch is not None
        if (self.limits.max_join_age and self._batch.pads_to_oldest and self._decoding
                and self._batch.oldest_age > join_age_limit(self.limits.max_join_age, self.join_rows,
                                                            len(self._decoding))):
            return []  # the newcomers' cache would be padded to the old row's length: wait
        room = self.limits.max_batch_size - len(self._decoding)
        longest = max((len(row.source) for row in self._decoding), default=0)
        rows = len(self._decoding)
        chosen: list[_Row] = []
        left_behind = False  # a greedy row waits that the room or the token budget kept out
        for row in self._queue:
            if row.future.done() or not self._joins_running_batch(row):
                continue
            width = max(longest, len(row.source))
            if len(chosen) == room or (rows and (rows + 1) * width > self.limits.max_batch_tokens):
                left_behind = True
                break
            chosen.append(row)
            rows, longest = rows + 1, width
        waited = time.perf_counter() - chosen[0].enqueued_at if chosen else 0.0
        group = min(self.join_rows, len(self._decoding) // 4)  # 0 when the batch is (nearly) empty
        # A small group waits for companions, up to max_join_wait_s; behind a backlog it waits
        # for room instead (joining a few rows per finished row would copy the batch per row).
        if chosen and len(chosen) < group and (left_behind or waited < self.limits.max_join_wait_s):
            return []  # let a group form
        if chosen:
            taken = set(map(id, chosen))
            self._queue = deque(
                row for row in self._queue if id(row) not in taken and not row.future.done()
            )
            self._publish_depth()
        return chosen

    def _admit(self, joiners: list[_Row]) -> None:
        """Hand `joiners` to the worker: it adds them to the running batch before its next step."""
        if not joiners:
            return
        started = time.perf_counter()
        for row in joiners:
            row.started_at = started
            metrics.QUEUE_DURATION_SECONDS.labels(self.model).observe(started - row.enqueued_at)
        self.counters.batches += 1
        self.counters.rows += len(joiners)
        self._decoding.extend(joiners)
        self.counters.max_batch_rows = max(self.counters.max_batch_rows, len(self._decoding))
        with self._inbox_lock:
            self._inbox.extend(joiners)

    def _start_stepping(self) -> None:
        loop = asyncio.get_running_loop()
        self._interrupt.clear()
        self._stepping = asyncio.ensure_future(
            loop.run_in_executor(self._executor, self._step_until_interrupted, loop))

    async def _stop_stepping(self) -> None:
        """Wait for the worker to hand back; fail every row of the running batch if it raised."""
        if self._stepping is None:
            return
        stepping, self._stepping = self._stepping, None
        try:
            await stepping
        except Exception:
            logger.exception("model %s: the running batch of %d rows failed", self.model,
                             len(self._decoding))
            assert self._batch is not None
            self._batch.filter(())  # the worker is done with it: safe here
            with self._inbox_lock:
                self._inbox.clear()
            failed, self._decoding = self._decoding, []
            for row in failed:
                if not row.future.done():
                    row.future.set_exception(InternalError("inference failed"))

    async def _wait_for_news(self) -> None:
        """Sleep until a row arrives, a row finishes, the worker hands back, or the oldest
        greedy row waiting for a group may join."""
        timeout = None
        if len(self._decoding) < self.limits.max_batch_size:
            oldest = next((r for r in self._queue if self._joins_running_batch(r)
                           and not r.future.done()), None)
            join_at = oldest.enqueued_at + self.limits.max_join_wait_s if oldest else 0.0
            if join_at > time.perf_counter():  # past it, it waits for room: a finish wakes us
                timeout = join_at - time.perf_counter()
        self._arrived.clear()
        arrived = asyncio.ensure_future(self._arrived.wait())
        waiting: set[asyncio.Future[Any]] = {arrived}
        if self._stepping is not None:
            waiting.add(self._stepping)
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrived.cancel()
        if self._stepping is not None and self._stepping.done():
            await self._stop_stepping()

    def _step_until_interrupted(self, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: add the rows handed over, step; until interrupted or empty."""
        batch = self._batch
        assert batch is not None
        while True:
            with self._inbox_lock:
                joiners, self._inbox = self._inbox, []
            if joiners:
                batch.concatenate([row.source for row in joiners], joiners,
                                  [row.key.max_new_tokens for row in joiners], [row.hooks for row in joiners])
                metrics.BATCH_SIZE.labels(self.model).observe(len(batch))
            if not len(batch) or self._interrupt.is_set():
                return
            finished = batch.generate_token()
            if finished:
                loop.call_soon_threadsafe(self._finish, list(finished), time.perf_counter())

    def _finish(self, finished: Sequence[tuple[_Row, Generated]], now: float) -> None:
        """Event loop: resolve the futures of rows that left the running batch."""
        done = set(map(id, (row for row, _ in finished)))
        self._decoding = [row for row in self._decoding if id(row) not in done]
        for row, result in finished:
            self._observe(row, result, now - row.started_at)
            if not row.future.done():
                row.future.set_result(result)
        self._arrived.set()  # room in the running batch: the loop may admit waiting rows

    def _take(self, key: _Key) -> list[_Row]:
        """Remove the next batch of `key` from the queue (and rows cancelled meanwhile)."""
        chosen, _ = self._select(key)
        taken = set(map(id, chosen))
        self._queue = deque(
            row for row in self._queue if id(row) not in taken and not row.future.done()
        )
        self._publish_depth()
        return chosen

    async def _run(self, rows: list[_Row]) -> None:
        """Generate one batch in the worker thread and resolve its rows' futures."""
        started = time.perf_counter()
        key = rows[0].key
        for row in rows:
            metrics.QUEUE_DURATION_SECONDS.labels(self.model).observe(started - row.enqueued_at)
        metrics.BATCH_SIZE.labels(self.model).observe(len(rows))
        self.counters.batches += 1
        self.counters.rows += len(rows)
        self.counters.max_batch_rows = max(self.counters.max_batch_rows, len(rows))
        rows = sorted(rows, key=lambda row: len(row.source))
        sources = [row.source for row in rows]
        loop = asyncio.get_running_loop()
        self._running = rows  # failed by `close` if the loop is cancelled while they run
        generate = functools.partial(self._generate, hooks=[row.hooks for row in rows])
        try:
            results = await loop.run_in_executor(
                self._executor, generate, sources, key.beam_size, key.max_new_tokens
            )
            if len(results) != len(rows):
                raise RuntimeError(f"{len(results)} results for {len(rows)} rows")
        except Exception:
            self._running = []
            logger.exception("model %s: a batch of %d rows failed", self.model, len(rows))
            for row in rows:
                if not row.future.done():
                    row.future.set_exception(InternalError("inference failed"))
            return
        self._running = []
        elapsed = time.perf_counter() - started
        for row, result in zip(rows, results, strict=True):
            self._observe(row, result, elapsed)
            if not row.future.done():
                row.future.set_result(result)

    def _observe(self, row: _Row, result: Generated, elapsed: float) -> None:
        generated = len(result.tokens)
        metrics.INFERENCE_DURATION_SECONDS.labels(self.model).observe(elapsed)
        metrics.INPUT_TOKENS_TOTAL.labels(self.model).inc(len(row.source))
        metrics.GENERATED_TOKENS_TOTAL.labels(self.model).inc(generated)
        if generated:
            metrics.TIME_PER_OUTPUT_TOKEN_SECONDS.labels(self.model).observe(elapsed / generated)
