"""The worker-thread side of continuous batching: step the running batch between arrivals.

The event loop hands rows over (`hand_over`); the worker adds them to the running batch
(`concatenate`; the joiners' `RequestTiming` told when and for how long) before its next decoder step,
steps (`generate_token`), and reports the rows that finished to the event loop, until the batch is empty or the loop interrupts it (a row the
batch cannot take, a `run` call, shutdown). Only the worker touches the batch while it steps.
After rows join or leave it reads the bytes the batch's keys/values hold (`cache_bytes`) and,
when they changed, calls `on_cache` (from the worker thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from service.batching.admission import QueuedRow
from service.batching.in_flight import InFlightBatch
from service.observability import metrics

# (rows that left the batch with their results, perf_counter when they left), on the event loop
OnFinished = Callable[[Sequence[tuple[QueuedRow, Any]], float], None]


class Stepper:
    """Steps one running batch in the model's worker thread."""

    def __init__(self, model: str, batch: InFlightBatch[QueuedRow], executor: Executor) -> None:
        self.model = model
        self.batch = batch
        self._executor = executor
        self._interrupt = threading.Event()
        self._inbox: list[QueuedRow] = []  # rows handed over, not yet added by the worker
        self._inbox_lock = threading.Lock()
        self.future: asyncio.Future[None] | None = None  # the worker's turn, while it steps
        self.cache_bytes = 0  # the batch's `cache_bytes` when rows last joined or left
        self.on_cache: Callable[[], None] | None = None  # called when `cache_bytes` changes

    @property
    def stepping(self) -> bool:
        return self.future is not None and not self.future.done()

    def hand_over(self, rows: Sequence[QueuedRow]) -> None:
        """Rows the worker adds to the batch before its next step."""
        with self._inbox_lock:
            self._inbox.extend(rows)

    def interrupt(self) -> None:
        """Ask the worker to hand back between two steps."""
        self._interrupt.set()

    def start(self, on_finished: OnFinished) -> None:
        """Give the worker a turn of stepping (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self._interrupt.clear()
        self.future = asyncio.ensure_future(
            loop.run_in_executor(self._executor, self._step_until_interrupted, loop, on_finished))

    async def stop(self) -> None:
        """Wait for the worker to hand back. If stepping raised, the batch and the rows handed
        over are emptied and the error is raised."""
        if self.future is None:
            return
        turn, self.future = self.future, None
        try:
            await turn
        except Exception:
            self.batch.filter(())  # the worker is done with it: safe here
            with self._inbox_lock:
                self._inbox.clear()
            self._read_cache()
            raise

    def _step_until_interrupted(self, loop: asyncio.AbstractEventLoop, on_finished: OnFinished) -> None:
        """Worker thread: add the rows handed over, step; until interrupted or empty."""
        batch = self.batch
        while True:
            with self._inbox_lock:
                joiners, self._inbox = self._inbox, []
            if joiners:
                started = time.perf_counter()
                timings = {id(row.timing): row.timing for row in joiners if row.timing is not None}
                for row in joiners:
                    if row.timing is not None:
                        row.timing.admitted(started, row.enqueued_at)
                batch.concatenate([row.source for row in joiners], joiners,
                                  [row.key.max_new_tokens for row in joiners], [row.hooks for row in joiners],
                                  beam_sizes=[row.key.beam_size for row in joiners])
                took = time.perf_counter() - started
                for timing in timings.values():
                    timing.joined(took)
                metrics.BATCH_SIZE.labels(self.model).observe(len(batch))
                self._read_cache()
            if not len(batch) or self._interrupt.is_set():
                return
            finished = batch.generate_token()
            if finished:
                self._read_cache()  # before the rows' requests learn they are done
                loop.call_soon_threadsafe(on_finished, list(finished), time.perf_counter())

    def _read_cache(self) -> None:
        held = self.batch.cache_bytes
        if held != self.cache_bytes:
            self.cache_bytes = held
            if self.on_cache is not None:
                self.on_cache()
