"""Dynamic batching for one model: admission, batch formation and the worker thread.

Requests are admitted row by row (one row per text) into the bounded `AdmissionQueue`, or
refused whole; a request's rows enter in order of source length, shortest first (results keep
the request's order), so the rows that join or batch together pad little. A loop on the event
loop takes the oldest row and forms its batch by the rules of `service.batching.policy`: a
request-level batch waits at most `max_wait_s` for rows of the same key, is sorted by source
length and generated in the model's own single worker thread, so the event loop never blocks. If generation raises, every row of that batch fails with
`InternalError` and the loop goes on. Other work on the model (attention maps) runs in the
same worker thread between two steps of the running batch, through `run`.

Continuous batching (given a `running_batch` factory, an `InFlightBatch`): greedy rows join the
running batch between two decoder steps, when `policy.joiners` lets them, and leave it, their
futures resolved, as soon as they finish. The `Stepper` steps the running batch in the worker
thread until something new arrives (a row, a `run` call, shutdown) or a join falls due, then
the loop decides. Beam-search rows join it too when it takes them (`takes_beams`: the step
graph's `SlotBatch`, one row per beam); otherwise they form request-level batches, run one at
a time in a second worker thread beside the running batch, which keeps stepping: a beam request
never pauses the greedy rows (onnxruntime sessions take calls from several threads at once).

Every row carries `RowHooks`, and the generation function is called with them (`hooks=`, one
per row): a row whose `cancel` is set leaves its batch at the next decoder step (a beam-search
row stops its search), and `on_token` is called in the worker thread for each token of a
streamed row. `cancel(future)` cancels a row wherever it is, counted in
`cancelled_rows_total{stage}`. A request whose wait ends early (its deadline passed, its client
left, another of its rows failed) cancels its rows that way (`submit`), so no abandoned row
costs more than the step it was in. `close` drains: it stops admitting and lets queued and
running rows finish, up to a timeout.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from service.batching import policy
from service.batching.admission import AdmissionQueue, AdmissionShare, QueuedRow
from service.batching.in_flight import InFlightBatch
from service.batching.policy import BatchLimits, RowKey
from service.batching.stepper import Stepper
from service.core.errors import InternalError, NotReady
from service.generation.hooks import RowHooks
from service.observability import metrics
from service.observability.timing import RequestTiming

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


async def results(futures: list[asyncio.Future[Generated]],
                  cancel: Callable[[asyncio.Future[Generated]], object]) -> list[Generated]:
    """The results of one request's rows, in order. When the wait ends early (cancelled: the
    deadline passed or the client left; or a row failed, whose error is raised) every row not
    done is cancelled with `cancel`: it leaves the queue, or its batch at the next step."""
    if not futures:
        return []
    try:
        # `wait`, not `gather`: cancelling this wait leaves the rows' futures to `cancel`
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()  # the first failure, raised
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            if not future.done():
                cancel(future)
            elif not future.cancelled():
                future.exception()  # retrieved: no "never retrieved" warning
        raise


@dataclass
class BatchCounters:
    """What the batcher has run since it started."""

    batches: int = 0
    rows: int = 0
    max_batch_rows: int = 0
    cancelled: int = 0
    max_cache_bytes: int = 0  # the most bytes its running batch's keys/values held at once


class Batcher:
    """Groups concurrent rows of one model into batches and runs them in a worker thread."""

    def __init__(self, model: str, generate_fn: GenerateFn, limits: BatchLimits,
                 running_batch: Callable[[], InFlightBatch[QueuedRow]] | None = None,
                 thread_name: str | None = None) -> None:
        self.model = model
        self.limits = limits
        self.counters = BatchCounters()
        self._generate = generate_fn
        self._queue = AdmissionQueue(model, limits, self._publish_depth)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name or f"batch-{model}")
        # continuous batching of greedy rows, and request-level batches beside the running batch
        self._stepper = Stepper(model, running_batch(), self._executor) if running_batch is not None else None
        self._beside: ThreadPoolExecutor | None = None
        if running_batch is not None:
            self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{thread_name or f'batch-{model}'}-beam")
        self._request_batch: asyncio.Task[None] | None = None  # the request-level batch beside
        self._running: list[QueuedRow] = []  # the request-level batch now generating
        self._decoding: list[QueuedRow] = []  # the rows of the running batch (continuous batching)
        # counted when the rows in flight change (`_recount`), read per request and per event
        self._live = 0  # rows of the two not cancelled (`running`)
        self._live_beams = 0  # the same, a beam-search row counted once per beam (`load`)
        self._longest = 0  # the longest source of `_decoding`
        self._decoding_rows = 0  # rows of the running batch `_decoding` takes (one per beam)
        self._in_flight_tokens = 0  # source tokens of the two
        self._arrived = asyncio.Event()
        self._filling = asyncio.Event()  # an arrival, for a request-level batch that fills
        self._idle = asyncio.Event()
        self._idle.set()
        self._jobs = 0  # calls of `run` admitted and not finished
        self._jobs_done = asyncio.Event()
        self._jobs_done.set()
        self._task: asyncio.Task[None] | None = None
        # publishes `queue_depth` when the queue changes; a `BatcherPool` sets it to publish
        # the sum over the model's batchers
        self.on_depth: Callable[[], None] | None = None
        # publishes `batch_cache_bytes` when the running batch's keys/values change size (from
        # the worker thread); a `BatcherPool` sets it to publish the sum
        self.on_cache: Callable[[], None] | None = None
        if self._stepper is not None:
            self._stepper.on_cache = self._publish_cache

    @property
    def share(self) -> AdmissionShare:
        """The admission share of its queue (`AdmissionShare`; a pool's batchers share one)."""
        return self._queue.share

    @share.setter
    def share(self, share: AdmissionShare) -> None:
        self._queue.share = share

    @property
    def depth(self) -> int:
        """Rows admitted and not yet in a batch."""
        return len(self._queue)

    def source_tokens(self) -> tuple[int, int]:
        """(rows, their source tokens) queued or generating: what `BatcherPool` routes by."""
        queued = sum(len(row.source) for row in self._queue)
        return (len(self._queue) + len(self._running) + len(self._decoding),
                queued + self._in_flight_tokens)

    def _publish_depth(self) -> None:
        if self.on_depth is not None:
            self.on_depth()
        else:
            metrics.QUEUE_DEPTH.labels(self.model).set(len(self._queue))

    @property
    def cache_bytes(self) -> int:
        """Bytes its running batch's keys/values hold now (`InFlightBatch.cache_bytes`; 0
        without continuous batching: a request-level batch's cache lives only while it runs)."""
        return self._stepper.cache_bytes if self._stepper is not None else 0

    def _publish_cache(self) -> None:
        held = self.cache_bytes
        self.counters.max_cache_bytes = max(self.counters.max_cache_bytes, held)
        if self.on_cache is not None:
            self.on_cache()
        else:
            metrics.BATCH_CACHE_BYTES.labels(self.model).set(held)

    @property
    def continuous(self) -> bool:
        """Whether greedy rows join a running batch between decoder steps."""
        return self._stepper is not None

    @property
    def join_rows(self) -> int:
        """The largest group rows join the running batch in (a quarter of `max_batch_size`)."""
        return self.limits.join_rows

    def out_of_reach(self, budget_s: float | None, rows: int = 1) -> str | None:
        """Why a request of `rows` rows with `budget_s` seconds (None: no deadline) would be
        refused now (`AdmissionQueue.refusal`), or None."""
        return self._queue.refusal(rows, budget_s, self.running)

    @property
    def running(self) -> int:
        """Rows of the batch now generating that are not cancelled."""
        return self._live

    @property
    def load(self) -> int:
        """Rows queued, and rows generating counted once per beam (a beam-search row is that
        many rows of work in a step): what `BatcherPool` balances."""
        return len(self._queue) + self._live_beams

    def _recount(self) -> None:
        """The figures of the rows in flight, after they changed or one was cancelled."""
        in_flight = [*self._running, *self._decoding]
        self._live = sum(1 for row in in_flight if not row.hooks.cancelled)
        self._live_beams = sum(row.key.beam_size for row in in_flight if not row.hooks.cancelled)
        self._in_flight_tokens = sum(len(row.source) for row in in_flight)
        self._longest = max((len(row.source) for row in self._decoding), default=0)
        self._decoding_rows = sum(row.key.beam_size for row in self._decoding)

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"batcher-{self.model}"
            )

    async def submit(
        self, sources: list[list[int]], beam_size: int, max_new_tokens: int,
        deadline: float | None = None, hooks: Sequence[RowHooks | None] | None = None,
        timing: RequestTiming | None = None,
    ) -> list[Generated]:
        """Generate for every source (ids ending with EOS); results in the same order; `hooks`,
        one per source, carry what each row asks of the decoding (`RowHooks`).

        Raises `Overloaded` when the rows do not fit in the queue, `NotReady` while draining,
        `DeadlineExceeded` when a row was still queued at `deadline` (`perf_counter`),
        `InternalError` when the batch of any row failed. `timing` records the rows' passage
        (`RequestTiming`).
        """
        return await results(self.enqueue(sources, beam_size, max_new_tokens, hooks=hooks, deadline=deadline,
                                          timing=timing), self.cancel)

    def enqueue(
        self,
        sources: list[list[int]],
        beam_size: int,
        max_new_tokens: int,
        hooks: Sequence[RowHooks | None] | None = None,
        deadline: float | None = None,
        timing: RequestTiming | None = None,
    ) -> list[asyncio.Future[Generated]]:
        """Admit all rows of one request, or none; returns one future per row.

        `hooks`, one per source, make rows streamed (`RowHooks`); a row without gets its own
        (its cancel flag).
        """
        self._queue.check_room(len(sources), deadline=deadline, in_flight=self.running)
        loop = asyncio.get_running_loop()
        key = RowKey(beam_size, max_new_tokens)
        given = list(hooks) if hooks is not None else [None] * len(sources)
        if len(given) != len(sources):
            raise ValueError(f"{len(given)} hooks for {len(sources)} sources")
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # shortest first
        rows = [QueuedRow(list(sources[i]), key, loop.create_future(), given[i] or RowHooks(), deadline=deadline,
                          timing=timing)
                for i in order]
        self._queue.admit(rows)
        if timing is not None and rows:
            timing.queued(rows[0].enqueued_at)
        self._idle.clear()
        self._arrived.set()
        self._filling.set()
        futures: list[asyncio.Future[Generated]] = [None] * len(rows)  # type: ignore[list-item]
        for i, row in zip(order, rows, strict=True):
            futures[i] = row.future
        return futures

    def cancel(self, future: asyncio.Future[Generated]) -> str | None:
        """Cancel the row of `future`; returns where it was ("queued" or "decoding").

        A queued row leaves the queue; a running row has its hooks' `cancel` set, so the
        generation loop drops it at the next decoder step. None when the row already finished
        or is unknown.
        """
        if future.done():
            return None
        stage: str | None = None
        if self._queue.cancel(future):
            stage = "queued"
        else:
            for row in [*self._running, *self._decoding]:
                if row.future is future:
                    row.hooks.cancel.set()
                    stage = "decoding"
                    self._recount()
                    break
        future.cancel()
        if stage is not None:
            self.counters.cancelled += 1
            metrics.CANCELLED_ROWS_TOTAL.labels(self.model, stage).inc()
        return stage

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the model's worker thread, between two steps of the running batch.

        Admitted like rows: `NotReady` while draining, `Overloaded` when the queue and the
        calls waiting fill `max_queue_size`; `InternalError` when `fn` raises (logged).
        """
        self._queue.check_room(1, reserved=self._jobs)
        self._jobs += 1
        self._jobs_done.clear()
        if self._stepper is not None:
            self._stepper.interrupt()  # the running batch hands the worker over between two steps
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
        """Drain: stop admitting, let queued and running rows finish (up to `timeout_s`), stop."""
        self._queue.accepting = False
        self._arrived.set()
        self._filling.set()
        if self._stepper is not None:
            self._stepper.interrupt()
        try:
            await asyncio.wait_for(
                asyncio.gather(self._idle.wait(), self._jobs_done.wait()), timeout_s
            )
        except TimeoutError:
            logger.error("model %s: %d rows still queued after %.0fs of draining",
                         self.model, len(self._queue), timeout_s)
        for task in (self._task, self._request_batch):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for row in [*self._running, *self._decoding, *self._queue.clear()]:  # left when draining timed out
            if not row.future.done():
                row.future.set_exception(NotReady("the server is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._beside is not None:
            self._beside.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        """Form batches forever: wait for a row, let the batch fill, run it; or admit rows to
        the running batch and keep the worker stepping it."""
        while True:
            self._queue.expire(time.perf_counter())
            self._queue.drop_done_head()
            stepping = self._stepper is not None and self._stepper.stepping
            head = self._queue.head
            if self._stepper is None:  # request-level batches only, in the worker thread
                if head is None:
                    self._idle.set()
                    self._arrived.clear()
                    await self._arrived.wait()
                else:
                    await self._fill_and_run(head, self._executor)
                continue
            beside = self._request_batch is not None and not self._request_batch.done()
            if head is None and not self._decoding and not stepping and not beside:
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if not beside:
                running = self._running_state()
                oldest = next((row for row in self._queue if not policy.joins(row.key, running) and not row.done),
                              None)
                if oldest is not None:
                    self._request_batch = asyncio.ensure_future(self._beside_batch(oldest))
            self._admit(policy.joiners(self._queue, self._running_state(), self.limits, time.perf_counter()))
            if self._decoding and not stepping:
                self._stepper.start(self._finish)
            await self._wait_for_news()

    def _running_state(self) -> policy.RunningState:
        assert self._stepper is not None
        batch = self._stepper.batch
        return policy.RunningState(
            rows=self._decoding_rows,
            longest=self._longest,
            # only a batch padded to its oldest row is limited by its age (`policy.joiners`)
            oldest_age=batch.oldest_age if self._decoding and batch.pads_to_oldest else 0,
            pads_to_oldest=batch.pads_to_oldest,
            takes_beams=batch.takes_beams,
        )

    async def _fill_and_run(self, head: QueuedRow, executor: ThreadPoolExecutor) -> None:
        """A request-level batch: wait up to `max_wait_s` for rows of `head`'s key, run it in
        `executor`'s thread."""
        flush_at = head.enqueued_at + self.limits.max_wait_s
        while self._queue.accepting and not policy.request_batch(self._queue, head.key, self.limits)[1]:
            remaining = flush_at - time.perf_counter()
            if remaining <= 0:
                break
            self._filling.clear()
            try:
                await asyncio.wait_for(self._filling.wait(), remaining)
            except TimeoutError:
                break
        self._queue.expire(time.perf_counter())
        rows, _ = policy.request_batch(self._queue, head.key, self.limits)
        self._queue.take(rows)
        if rows:
            await self._run(rows, executor)

    async def _beside_batch(self, head: QueuedRow) -> None:
        """The request-level batch of `head` in the second worker thread; wakes the loop when
        it ends, so that the next one may start."""
        assert self._beside is not None
        try:
            await self._fill_and_run(head, self._beside)
        finally:
            self._arrived.set()

    def _admit(self, joiners: list[QueuedRow]) -> None:
        """Hand `joiners` to the worker: it adds them to the running batch before its next step."""
        if not joiners:
            return
        assert self._stepper is not None
        self._queue.take(joiners)
        started = time.perf_counter()
        for row in joiners:
            row.started_at = started
            metrics.QUEUE_DURATION_SECONDS.labels(self.model).observe(started - row.enqueued_at)
        self.counters.batches += 1
        self.counters.rows += len(joiners)
        self._decoding.extend(joiners)
        self._recount()
        self.counters.max_batch_rows = max(self.counters.max_batch_rows, len(self._decoding))
        self._stepper.hand_over(joiners)

    async def _stop_stepping(self) -> None:
        """Wait for the worker to hand back; fail every row of the running batch if it raised."""
        assert self._stepper is not None
        try:
            await self._stepper.stop()
        except Exception:
            logger.exception("model %s: the running batch of %d rows failed", self.model,
                             len(self._decoding))
            failed, self._decoding = self._decoding, []
            self._recount()
            for row in failed:
                if not row.future.done():
                    row.future.set_exception(InternalError("inference failed"))

    async def _wait_for_news(self) -> None:
        """Sleep until a row arrives, a row finishes, the worker hands back, or the oldest
        greedy row waiting for a group may join."""
        assert self._stepper is not None
        timeout = policy.join_due(self._queue, self._running_state(), self.limits, time.perf_counter())
        self._arrived.clear()
        arrived = asyncio.ensure_future(self._arrived.wait())
        waiting: set[asyncio.Future[Any]] = {arrived}
        if self._stepper.future is not None:
            waiting.add(self._stepper.future)
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrived.cancel()
        if self._stepper.future is not None and self._stepper.future.done():
            await self._stop_stepping()

    def _finish(self, finished: Sequence[tuple[QueuedRow, Generated]], now: float) -> None:
        """Event loop: resolve the futures of rows that left the running batch."""
        done = set(map(id, (row for row, _ in finished)))
        self._queue.finished([row for row, _ in finished], now,
                             [row for row, result in finished if result.finish_reason == "cancelled"])
        self._decoding = [row for row in self._decoding if id(row) not in done]
        self._recount()
        for row, result in finished:
            self._observe(row, result, now - row.started_at)
            if row.timing is not None:
                row.timing.finished_at(now)
            if not row.future.done():
                row.future.set_result(result)
        self._arrived.set()  # room in the running batch: the loop may admit waiting rows

    async def _run(self, rows: list[QueuedRow], executor: ThreadPoolExecutor) -> None:
        """Generate one batch in `executor`'s thread and resolve its rows' futures."""
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
        self._recount()
        generate = functools.partial(self._generate_taken, rows)
        try:
            results = await loop.run_in_executor(executor, generate, sources, key.beam_size, key.max_new_tokens)
            if len(results) != len(rows):
                raise RuntimeError(f"{len(results)} results for {len(rows)} rows")
        except Exception:
            self._running = []
            self._recount()
            logger.exception("model %s: a batch of %d rows failed", self.model, len(rows))
            for row in rows:
                if not row.future.done():
                    row.future.set_exception(InternalError("inference failed"))
            return
        self._running = []
        self._recount()
        elapsed = time.perf_counter() - started
        self._queue.finished(rows, started + elapsed,
                             [row for row, result in zip(rows, results, strict=True)
                              if result.finish_reason == "cancelled"])
        for row, result in zip(rows, results, strict=True):
            self._observe(row, result, elapsed)
            if row.timing is not None:
                row.timing.finished_at(started + elapsed)
            if not row.future.done():
                row.future.set_result(result)

    def _generate_taken(self, rows: list[QueuedRow], sources: list[list[int]], beam_size: int,
                        max_new_tokens: int) -> Sequence[Generated]:
        """Worker thread: the rows' request-level batch, their `RequestTiming` told when the
        worker took them."""
        taken = time.perf_counter()
        for row in rows:
            if row.timing is not None:
                row.timing.admitted(taken, row.enqueued_at)
        return self._generate(sources, beam_size, max_new_tokens, hooks=[row.hooks for row in rows])

    def _observe(self, row: QueuedRow, result: Generated, elapsed: float) -> None:
        generated = len(result.tokens)
        metrics.INFERENCE_DURATION_SECONDS.labels(self.model).observe(elapsed)
        metrics.INPUT_TOKENS_TOTAL.labels(self.model).inc(len(row.source))
        metrics.GENERATED_TOKENS_TOTAL.labels(self.model).inc(generated)
        if generated:
            metrics.TIME_PER_OUTPUT_TOKEN_SECONDS.labels(self.model).observe(elapsed / generated)
