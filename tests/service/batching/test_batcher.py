"""The batcher on its own, with a fake generation function."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.batching.batcher import Batcher
from service.batching.policy import BatchLimits
from service.core.errors import DeadlineExceeded, InternalError, NotReady, Overloaded
from service.generation.hooks import RowHooks
from service.observability import metrics
from service.observability.timing import RequestTiming
from tests.service.fakes import EOS, UNK, FakeModel, reverse

pytestmark = pytest.mark.anyio


def source(length: int, start: int = 4) -> list[int]:
    return [start + i % 20 for i in range(length)] + [EOS]


def make(model: FakeModel, name: str, **limits: float) -> Batcher:
    batcher = Batcher(name, model.generate, BatchLimits(**limits))  # type: ignore[arg-type]
    batcher.start()
    return batcher


async def test_concurrent_rows_share_a_batch_and_keep_their_order() -> None:
    model = FakeModel(delay_s=0.02)
    batcher = make(model, "b-share", max_wait_s=0.05)
    sources = [source(n) for n in (5, 2, 9, 1, 7, 3)]
    results = await asyncio.gather(*(batcher.submit([s], 1, 50) for s in sources))
    assert [r[0] for r in results] == [reverse(s, 50) for s in sources]
    assert model.batches == [[2, 3, 4, 6, 8, 10]]  # one batch, sorted by length
    assert (batcher.counters.batches, batcher.counters.rows) == (1, 6)
    assert batcher.counters.max_batch_rows == 6
    await batcher.close(1)


async def test_generation_runs_in_the_worker_thread() -> None:
    model = FakeModel()
    batcher = make(model, "b-thread")
    await batcher.submit([source(3)], 1, 10)
    assert model.threads and threading.current_thread().name not in model.threads
    assert all(name.startswith("batch-b-thread") for name in model.threads)
    await batcher.close(1)


@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
async def test_batches_hold_at_most_max_batch_size_rows(max_batch_size: int) -> None:
    model = FakeModel(delay_s=0.01)
    batcher = make(model, f"b-size-{max_batch_size}", max_batch_size=max_batch_size,
                   max_wait_s=0.05)
    await asyncio.gather(*(batcher.submit([source(4)], 1, 10) for _ in range(10)))
    assert max(len(b) for b in model.batches) == min(max_batch_size, 10)
    assert sum(len(b) for b in model.batches) == 10
    await batcher.close(1)


async def test_token_budget_caps_a_batch() -> None:
    model = FakeModel()
    # 4 rows of 10 tokens (9 + EOS) padded: 40 tokens per batch with beam 1, 80 with beam 2.
    batcher = make(model, "b-tokens", max_batch_tokens=40, max_wait_s=0.05)
    await asyncio.gather(*(batcher.submit([source(9)], 1, 10) for _ in range(8)))
    assert [len(b) for b in model.batches] == [4, 4]
    model.batches.clear()
    await asyncio.gather(*(batcher.submit([source(9)], 2, 10) for _ in range(4)))
    assert [len(b) for b in model.batches] == [2, 2]
    await batcher.close(1)


async def test_a_longer_source_than_the_budget_still_runs_alone() -> None:
    model = FakeModel()
    batcher = make(model, "b-alone", max_batch_tokens=5)
    [result] = await batcher.submit([source(12)], 1, 20)
    assert result == reverse(source(12), 20)
    await batcher.close(1)


async def test_rows_with_different_options_are_not_mixed() -> None:
    model = FakeModel()
    batcher = make(model, "b-options", max_wait_s=0.05)
    await asyncio.gather(
        batcher.submit([source(3)], 1, 10), batcher.submit([source(4)], 2, 10),
        batcher.submit([source(5)], 1, 10), batcher.submit([source(6)], 1, 5),
    )
    assert sorted(model.batches) == [[4, 6], [5], [7]]
    await batcher.close(1)


async def test_a_full_queue_refuses_the_whole_request() -> None:
    model = FakeModel(delay_s=0.2)
    batcher = make(model, "b-full", max_queue_size=4, max_batch_size=1, retry_after_s=3)
    before = metrics.REJECTED_TOTAL.labels("b-full", "queue_full")._value.get()
    first = asyncio.ensure_future(batcher.submit([source(2)], 1, 5))
    await asyncio.sleep(0.05)  # the first row is running, the queue is empty again
    waiting = asyncio.ensure_future(batcher.submit([source(2)] * 3, 1, 5))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="full") as refused:
        await batcher.submit([source(2)] * 2, 1, 5)
    assert refused.value.headers() == {"Retry-After": "3"}
    assert metrics.REJECTED_TOTAL.labels("b-full", "queue_full")._value.get() == before + 1
    await batcher.submit([source(2)], 1, 5)  # one more row still fits
    await asyncio.gather(first, waiting)
    await batcher.close(1)


async def test_a_failing_batch_fails_its_rows_and_the_next_batch_runs() -> None:
    model = FakeModel(delay_s=0.02)
    batcher = make(model, "b-fail", max_wait_s=0.05)
    bad = [4, UNK, EOS]
    outcomes = await asyncio.gather(
        batcher.submit([source(3)], 1, 10), batcher.submit([bad], 1, 10),
        return_exceptions=True,
    )
    assert all(isinstance(o, InternalError) for o in outcomes)
    assert await batcher.submit([source(3)], 1, 10) == [reverse(source(3), 10)]
    await batcher.close(1)


async def test_a_cancelled_row_is_skipped() -> None:
    model = FakeModel(delay_s=0.1)
    batcher = make(model, "b-cancel", max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit([source(2)], 1, 5))
    await asyncio.sleep(0.02)
    cancelled = asyncio.ensure_future(batcher.submit([source(8)], 1, 5))
    await asyncio.sleep(0)
    cancelled.cancel()
    await running
    await batcher.submit([source(3)], 1, 5)
    assert model.batches == [[3], [4]]
    await batcher.close(1)


async def test_close_drains_queued_rows_then_refuses() -> None:
    model = FakeModel(delay_s=0.05)
    batcher = make(model, "b-close", max_batch_size=2)
    pending = [asyncio.ensure_future(batcher.submit([source(3)], 1, 10)) for _ in range(5)]
    await asyncio.sleep(0.01)
    await batcher.close(5)
    assert all(p.done() and p.result() == [reverse(source(3), 10)] for p in pending)
    with pytest.raises(NotReady):
        await batcher.submit([source(3)], 1, 10)


async def test_close_fails_what_is_left_after_its_timeout() -> None:
    model = FakeModel(delay_s=0.5)
    batcher = make(model, "b-timeout", max_batch_size=1)
    pending = [asyncio.ensure_future(batcher.submit([source(3)], 1, 10)) for _ in range(2)]
    await asyncio.sleep(0.05)  # one row running, one queued
    await batcher.close(0.1)
    for future in pending:
        with pytest.raises(NotReady):
            await future


async def test_run_uses_the_worker_thread_between_batches_and_is_admitted_like_rows() -> None:
    model = FakeModel(delay_s=0.05)
    batcher = make(model, "b-run", max_queue_size=2, retry_after_s=2)
    events: list[str] = []

    def job(tag: str) -> str:
        events.append(f"{tag} in {threading.current_thread().name}")
        return tag

    generating = asyncio.ensure_future(batcher.submit([source(3)], 1, 10))
    await asyncio.sleep(0.01)  # the batch runs in the worker thread
    assert await batcher.run(job, "maps") == "maps"
    await generating
    assert events == ["maps in " + next(iter(model.threads))]  # the one worker thread
    assert next(iter(model.threads)).startswith("batch-b-run")

    slow = asyncio.ensure_future(batcher.submit([source(3)], 1, 10))
    await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(batcher.submit([source(3)], 1, 10))
    first_job = asyncio.ensure_future(batcher.run(job, "one"))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as refused:  # 1 row queued + 1 job = max_queue_size
        await batcher.run(job, "two")
    assert refused.value.headers() == {"Retry-After": "2"}
    await asyncio.gather(slow, queued, first_job)

    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(InternalError):
        await batcher.run(boom)
    await batcher.close(1)
    with pytest.raises(NotReady):
        await batcher.run(job, "late")


def cancelled_rows(model: str, stage: str) -> float:
    return metrics.CANCELLED_ROWS_TOTAL.labels(model, stage)._value.get()


async def test_hooks_stream_tokens_from_the_worker_and_plain_batches_get_none() -> None:
    model = FakeModel()
    batcher = make(model, "b-hooks", max_wait_s=0.05)
    seen: list[tuple[int, str]] = []
    hooks = RowHooks(on_token=lambda t: seen.append((t, threading.current_thread().name)))
    [streamed], [plain] = await asyncio.gather(
        asyncio.gather(*batcher.enqueue([source(4)], 1, 10, hooks=[hooks])),
        batcher.submit([source(3)], 1, 10),
    )
    assert streamed == reverse(source(4), 10) and plain == reverse(source(3), 10)
    assert [t for t, _ in seen] == streamed.tokens
    assert all(name.startswith("batch-b-hooks") for _, name in seen)
    assert model.batches == [[4, 5]]  # streamed and plain rows share a batch
    with pytest.raises(ValueError, match="hooks"):
        batcher.enqueue([source(4)], 1, 10, hooks=[])
    await batcher.close(1)


async def test_cancel_a_queued_row_and_a_running_row() -> None:
    model = FakeModel(step_delay_s=0.02)
    batcher = make(model, "b-cancel-stages", max_batch_size=1)
    queued_before = cancelled_rows("b-cancel-stages", "queued")
    decoding_before = cancelled_rows("b-cancel-stages", "decoding")
    running_hooks, queued_hooks = RowHooks(), RowHooks()
    [running] = batcher.enqueue([source(30)], 1, 50, hooks=[running_hooks])
    await asyncio.sleep(0.1)  # the first row is decoding (30 steps of 20 ms)
    [queued] = batcher.enqueue([source(5)], 1, 50, hooks=[queued_hooks])
    assert batcher.running == 1 and batcher.depth == 1
    assert batcher.cancel(queued) == "queued"
    assert batcher.depth == 0 and queued.cancelled()
    assert batcher.cancel(running) == "decoding"
    assert running_hooks.cancelled and batcher.running == 0
    for _ in range(100):  # the batch ends at the next step
        if model.steps and len(model.batches) == 1 and batcher._running == []:
            break
        await asyncio.sleep(0.01)
    assert batcher._running == [] and len(model.steps) < 30
    assert batcher.cancel(running) is None  # already cancelled: counted once
    assert batcher.counters.cancelled == 2
    assert cancelled_rows("b-cancel-stages", "queued") == queued_before + 1
    assert cancelled_rows("b-cancel-stages", "decoding") == decoding_before + 1
    assert await batcher.submit([source(3)], 1, 10) == [reverse(source(3), 10)]
    assert model.batches == [[31], [4]]  # the queued row never ran
    await batcher.close(1)


def test_the_drain_rate_is_rows_per_second_over_its_window_once_it_has_enough() -> None:
    from service.batching.admission import DrainRate

    drain = DrainRate(window_s=4.0, min_rows=10)
    assert drain.rate(100.0) is None
    for i in range(8):  # 5 rows every 0.25 s: 20 rows/s
        drain.record(5, 100.0 + 0.25 * i)
    assert drain.rate(101.75) == pytest.approx(40 / 1.75)
    drain.record(5, 102.0)
    assert drain.rate(102.0) == pytest.approx(45 / 2.0)
    assert drain.rate(106.5) is None  # all but the last 2 s of records left the window: too few rows
    few = DrainRate(window_s=4.0, min_rows=10)
    few.record(20, 50.0)
    few.record(20, 50.5)
    assert few.rate(50.5) is None  # 40 rows, but over less than a quarter of the window


def test_the_admission_share_grows_while_rows_finish_early_and_is_cut_when_one_misses() -> None:
    from service.batching.admission import AdmissionShare

    share = AdmissionShare(start=0.5, low=0.25, high=0.9, slack=0.75, step=0.01, cut=0.7, hold_s=1.0)
    share.observe([0.2, 0.6], 10.0)  # all within the slack: one step up
    assert share.value == pytest.approx(0.51)
    share.observe([0.2, 0.8], 10.1)  # one used more than the slack, none missed: held
    assert share.value == pytest.approx(0.51)
    share.observe([0.3, 1.2], 10.2)  # a miss: cut
    assert share.value == pytest.approx(0.51 * 0.7)
    share.observe([0.1], 10.9)  # within the hold after a cut: unchanged
    share.observe([1.5], 11.0)
    assert share.value == pytest.approx(0.51 * 0.7)
    share.observe([0.1], 11.3)  # the hold is over
    assert share.value == pytest.approx(0.51 * 0.7 + 0.01)
    for i in range(10):  # misses a hold apart: down to the floor, no lower
        share.observe([2.0], 20.0 + 2 * i)
    assert share.value == 0.25
    for i in range(100):
        share.observe([0.1], 50.0 + 0.01 * i)
    assert share.value == 0.9
    share.observe([], 60.0)
    assert share.value == 0.9


async def test_the_admission_share_follows_the_rows_outcomes() -> None:
    model = FakeModel(delay_s=0.02)
    batcher = make(model, "b-share-adapts", max_batch_size=4, max_wait_s=0.001)
    gauge = metrics.ADMISSION_SHARE.labels("b-share-adapts")
    start = batcher.share.value
    now = time.perf_counter()
    await asyncio.gather(*(batcher.submit([source(3)], 1, 10, deadline=now + 10.0) for _ in range(12)))
    grown = batcher.share.value
    assert grown > start and gauge._value.get() == grown  # finished with time to spare
    model.delay_s = 0.2  # a batch slower than the next row's deadline: it finishes late
    assert await batcher.submit([source(3)], 1, 10, deadline=time.perf_counter() + 0.05)
    assert batcher.share.value == pytest.approx(grown * batcher.share.cut)
    assert gauge._value.get() == batcher.share.value
    await batcher.close(1)


async def test_a_row_expired_in_the_queue_cuts_the_admission_share() -> None:
    from service.batching.admission import AdmissionQueue, QueuedRow
    from service.batching.policy import RowKey

    queue = AdmissionQueue("q-expire", BatchLimits(), lambda: None)
    loop = asyncio.get_running_loop()
    now = time.perf_counter()
    row = QueuedRow(source(3), RowKey(1, 10), loop.create_future(), deadline=now + 0.01)
    queue.admit([row])
    queue.expire(now)  # not yet
    assert queue.share.value == 0.5 and not row.done
    queue.expire(now + 0.02)
    assert isinstance(row.future.exception(), DeadlineExceeded)
    assert queue.share.value == pytest.approx(0.5 * queue.share.cut)


async def test_rows_that_would_miss_their_deadline_at_the_drain_rate_are_refused_at_once() -> None:
    model = FakeModel(delay_s=0.05)
    batcher = make(model, "b-drain", max_batch_size=2, max_wait_s=0.001)
    await asyncio.gather(*(batcher.submit([source(3)], 1, 10) for _ in range(60)))  # ~40 rows/s for 1.5 s
    rate = batcher._queue.drain.rate(time.perf_counter())
    assert rate is not None and 20 < rate < 60
    refused = metrics.REJECTED_TOTAL.labels("b-drain", "expected_wait")
    before = refused._value.get()
    now = time.perf_counter()
    # ten rows need about a quarter of a second at that rate: a tenth of a second is too short
    with pytest.raises(Overloaded, match="within the deadline"):
        await batcher.submit([source(3)] * 10, 1, 10, deadline=now + 0.1)
    assert refused._value.get() == before + 1
    assert await batcher.submit([source(3)] * 10, 1, 10, deadline=now + 5.0)  # time enough: served
    # what the HTTP layer asks before reading a body: would one row be refused?
    assert batcher.out_of_reach(0.001) == "expected_wait"
    assert batcher.out_of_reach(5.0) is None
    await batcher.close(1)



async def test_a_request_level_batch_times_its_wait_from_queued_to_taken_by_the_worker() -> None:
    model = FakeModel(gate=threading.Event())  # every batch waits for the gate
    batcher = make(model, "timing", max_batch_size=1)
    first = asyncio.ensure_future(batcher.submit([[5, 6, EOS]], 1, 8))
    while not model.batches:  # the first batch holds the worker at the gate
        await asyncio.sleep(0.005)
    timing = RequestTiming(time.perf_counter())
    second = asyncio.ensure_future(batcher.submit([[7, 8, EOS]], 1, 8, timing=timing))
    await asyncio.sleep(0.05)  # queued behind the first batch (its own batch is formed, not taken)
    model.gate.set()
    await asyncio.gather(first, second)
    stages = dict(timing.stages(time.perf_counter()))
    assert list(stages) == ["prepare", "queue", "inference", "total"]  # no join: not a running batch
    assert stages["queue"] >= 40  # until the worker took it, after the gate opened
    assert stages["total"] >= stages["prepare"] + stages["queue"] + stages["inference"]
    await batcher.close(1)
