"""Several batchers of one model (`BatcherPool`), with a fake generation function."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from unittest import mock

import pytest

from service.batching.batcher import Batcher
from service.batching.policy import BatchLimits
from service.batching.pool import BatcherPool
from service.core.errors import Overloaded
from service.core.settings import CPU_PROVIDER, Settings, cpu_cores
from service.generation.hooks import RowHooks
from service.observability import metrics
from service.observability.timing import RequestTiming
from tests.service.fakes import EOS, ROW_CACHE_BYTES, FakeModel, FakeRunningBatch, reverse

pytestmark = pytest.mark.anyio


def source(length: int) -> list[int]:
    return [4 + i % 20 for i in range(length)] + [EOS]


def make_pool(model: FakeModel, name: str, workers: int = 2, **limits: float) -> BatcherPool:
    pool = BatcherPool(name, [Batcher(name, model.generate, BatchLimits(**limits),  # type: ignore[arg-type]
                                      thread_name=f"batch-{name}-{index}") for index in range(workers)])
    pool.start()
    return pool


async def held_pool(name: str, **limits: float) -> tuple[FakeModel, BatcherPool, list[asyncio.Future[Any]]]:
    """Two batchers of one row per batch, each holding a row until `model.gate` is set."""
    model = FakeModel()
    model.gate = threading.Event()
    pool = make_pool(model, name, max_wait_s=0.0, max_batch_size=1, **limits)
    running = [asyncio.ensure_future(pool.submit([source(2)], 1, 5)) for _ in range(2)]
    await asyncio.sleep(0.05)  # one row running in each batcher
    return model, pool, running


def queue_depth(name: str) -> float:
    return metrics.REGISTRY.get_sample_value("attnserve_queue_depth", {"model": name}) or 0.0


def rejected(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "attnserve_rejected_total", {"model": name, "reason": "queue_full"}) or 0.0


async def test_requests_spread_over_the_batchers_and_run_at_once() -> None:
    model = FakeModel()
    model.gate = threading.Event()
    pool = make_pool(model, "pool-spread", max_wait_s=0.0)
    first = asyncio.ensure_future(pool.submit([source(3)], 1, 10))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(pool.submit([source(5)], 1, 10))
    await asyncio.sleep(0.05)
    assert sorted(len(b) for b in model.batches) == [1, 1]  # both run while the first is held
    assert len(model.threads) == 2  # each in its own batcher's worker thread
    assert [b.counters.rows for b in pool.batchers] == [1, 1] and pool.running == 2
    model.gate.set()
    assert await first == [reverse(source(3), 10)] and await second == [reverse(source(5), 10)]
    counters = pool.counters
    assert (counters.batches, counters.rows, counters.max_batch_rows) == (2, 2, 1)
    await pool.close(1)


async def test_queue_depth_is_the_sum_over_the_batchers() -> None:
    model, pool, busy = await held_pool("pool-depth")
    queued = [asyncio.ensure_future(pool.submit([source(2)], 1, 5)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert pool.depth == 3 and sorted(b.depth for b in pool.batchers) == [1, 2]
    assert queue_depth("pool-depth") == 3
    model.gate.set()
    await asyncio.gather(*busy, *queued)
    assert queue_depth("pool-depth") == 0
    await pool.close(1)


def running_pool(name: str, **running: float) -> BatcherPool:
    """Two batchers of continuous batching over `FakeRunningBatch(**running)`, started."""
    model = FakeModel()
    pool = BatcherPool(name, [
        Batcher(name, model.generate, BatchLimits(max_wait_s=0.0),  # type: ignore[arg-type]
                lambda: FakeRunningBatch(**running), thread_name=f"batch-{name}-{index}")
        for index in range(2)])
    pool.start()
    return pool


async def test_cache_bytes_are_the_sum_over_the_batchers_and_the_most_is_kept() -> None:
    pool = running_pool("pool-cache", step_delay_s=0.01)
    rows = [asyncio.ensure_future(pool.submit([source(30)], 1, 50)) for _ in range(3)]
    await asyncio.sleep(0.1)  # all three decoding, in both batchers
    assert sorted(b.cache_bytes for b in pool.batchers) == [ROW_CACHE_BYTES, 2 * ROW_CACHE_BYTES]
    assert metrics.REGISTRY.get_sample_value("attnserve_batch_cache_bytes", {"model": "pool-cache"}) == 3 * ROW_CACHE_BYTES
    await asyncio.gather(*rows)
    assert pool.cache_bytes == 0
    assert metrics.REGISTRY.get_sample_value("attnserve_batch_cache_bytes", {"model": "pool-cache"}) == 0
    assert pool.counters.max_cache_bytes == 3 * ROW_CACHE_BYTES
    await pool.close(1)


async def test_a_full_pool_refuses_once_and_a_request_goes_where_there_is_room() -> None:
    model, pool, running = await held_pool("pool-full", max_queue_size=2)
    three = asyncio.ensure_future(pool.submit([source(2)] * 2, 1, 5))  # fills one queue
    await asyncio.sleep(0.05)
    two = asyncio.ensure_future(pool.submit([source(2)] * 2, 1, 5))  # fits in the other one only
    await asyncio.sleep(0.05)
    assert sorted(b.depth for b in pool.batchers) == [2, 2]
    before = rejected("pool-full")
    with pytest.raises(Overloaded):
        await pool.submit([source(2)], 1, 5)
    assert rejected("pool-full") == before + 1  # counted once, not once per batcher
    model.gate.set()
    await asyncio.gather(*running, three, two)
    await pool.close(1)


async def test_cancel_finds_the_batcher_that_holds_the_row() -> None:
    model, pool, running = await held_pool("pool-cancel")
    [future] = pool.enqueue([source(4)], 1, 5, hooks=[RowHooks()])
    holder = next(b for b in pool.batchers if b.depth)
    assert pool.cancel(future) == "queued"
    assert future.cancelled() and holder.depth == 0 and holder.counters.cancelled == 1
    assert pool.cancel(future) is None  # done: nothing to cancel
    model.gate.set()
    await asyncio.gather(*running)
    await pool.close(1)


async def test_a_running_beam_row_weighs_as_many_rows_as_its_beams() -> None:
    model = FakeModel()
    model.gate = threading.Event()
    pool = make_pool(model, "pool-beams", max_wait_s=0.0)
    held = [asyncio.ensure_future(pool.submit([source(3)], 4, 5))]  # beam 4: the first batcher
    await asyncio.sleep(0.05)
    held.append(asyncio.ensure_future(pool.submit([source(3), source(3)], 1, 5)))  # the second
    await asyncio.sleep(0.05)
    assert [b.load for b in pool.batchers] == [4, 2] and [b.running for b in pool.batchers] == [1, 2]
    held.append(asyncio.ensure_future(pool.submit([source(3)], 1, 5)))
    await asyncio.sleep(0.01)
    assert [b.depth for b in pool.batchers] == [0, 1]  # behind 2 rows, not behind 4 beams
    model.gate.set()
    await asyncio.gather(*held)
    await pool.close(1)


async def test_run_goes_to_an_idle_batcher() -> None:
    model = FakeModel()
    model.gate = threading.Event()
    pool = make_pool(model, "pool-run", max_wait_s=0.0)
    held = asyncio.ensure_future(pool.submit([source(2)], 1, 5))
    await asyncio.sleep(0.05)
    name = await asyncio.wait_for(pool.run(lambda: threading.current_thread().name), 2)
    assert name not in model.threads  # not behind the held batch
    model.gate.set()
    await held
    await pool.close(1)


def test_batch_workers_default_on_the_cpu_by_batching_mode_and_share_its_cores() -> None:
    settings = Settings()
    assert settings.batch_workers_on(CPU_PROVIDER) == 2  # continuous batching
    assert settings.batch_workers_on("CUDAExecutionProvider") == 1
    assert settings.session_threads() == max(1, cpu_cores() // 2)
    request_level = Settings(continuous_batching=False)
    assert request_level.batch_workers_on(CPU_PROVIDER) == 3
    assert request_level.session_threads() == max(1, cpu_cores() // 3)
    given = Settings(batch_workers=3, threads=5)
    assert given.batch_workers_on("CUDAExecutionProvider") == 3 and given.session_threads() == 5
    processes = Settings(workers=2, batch_workers=1)  # each process's workers share its part of the cores
    assert processes.session_threads() == max(1, cpu_cores() // 2)
    assert Settings(workers=2).session_threads() == max(1, cpu_cores() // 4)


def test_batch_limits_default_by_provider() -> None:
    settings = Settings()
    assert (settings.max_batch_size_on(CPU_PROVIDER), settings.max_batch_tokens_on(CPU_PROVIDER)) == (64, 8192)
    cuda = "CUDAExecutionProvider"
    assert (settings.max_batch_size_on(cuda), settings.max_batch_tokens_on(cuda)) == (256, 32768)
    given = Settings(max_batch_size=32, max_batch_tokens=4096)
    assert (given.max_batch_size_on(cuda), given.max_batch_tokens_on(cuda)) == (32, 4096)


async def test_length_routing_keeps_similar_lengths_together_within_the_slack() -> None:
    model = FakeModel()
    model.gate = threading.Event()
    pool = BatcherPool("pool-length", [Batcher("pool-length", model.generate,  # type: ignore[arg-type]
                                               BatchLimits(max_wait_s=0.0, max_batch_size=1))
                                       for _ in range(2)], length_slack=2)
    pool.start()
    short, long = pool.batchers
    futures: list[asyncio.Future[Any]] = []
    try:
        futures.append(asyncio.ensure_future(pool.submit([source(3)], 1, 5)))  # to an idle one: the first
        await asyncio.sleep(0.02)
        futures.append(asyncio.ensure_future(pool.submit([source(40)], 1, 50)))  # the idle one matches best
        await asyncio.sleep(0.02)
        for length in (39, 4, 2):  # each to the batcher of its band (loads stay within the slack)
            futures.append(asyncio.ensure_future(pool.submit([source(length)], 1, 50)))
            await asyncio.sleep(0.02)
        assert short.source_tokens() == (3, 4 + 5 + 3) and long.source_tokens() == (2, 41 + 40)
        for _ in range(3):  # loads 3 vs 2 and 4 vs 2: to its band; 5 vs 2 is over the slack of 2
            futures.append(asyncio.ensure_future(pool.submit([source(3)], 1, 5)))
            await asyncio.sleep(0.02)
        assert short.source_tokens() == (5, 4 + 5 + 3 + 4 + 4) and long.source_tokens() == (3, 41 + 40 + 4)
    finally:
        model.gate.set()
    await asyncio.gather(*futures)
    await pool.close(1)


async def test_a_request_of_many_rows_is_dealt_out_over_idle_batchers_by_source_tokens() -> None:
    model = FakeModel()
    model.gate = threading.Event()
    pool = make_pool(model, "pool-deal", max_wait_s=0.0, max_batch_size=8)
    lengths = [9, 2, 8, 3, 10, 1]
    submitted = asyncio.ensure_future(pool.submit([source(n) for n in lengths], 1, 20))
    await asyncio.sleep(0.05)
    # with EOS: 2, 3, 4, 9 | 10, 11: about half the 39 source tokens each, in two worker threads
    assert sorted(sorted(batch) for batch in model.batches) == [[2, 3, 4, 9], [10, 11]]
    assert len(model.threads) == 2 and pool.running == 6
    model.gate.set()
    assert await submitted == [reverse(source(n), 20) for n in lengths]  # in the request's order
    await pool.close(1)


async def test_a_request_of_many_rows_goes_whole_to_one_batcher_unless_two_are_idle() -> None:
    model, pool, running = await held_pool("pool-busy")  # a row running in each batcher
    futures = pool.enqueue([source(n) for n in (2, 5, 3)], 1, 5)
    assert sorted(b.depth for b in pool.batchers) == [0, 3]  # whole: the small requests keep the other
    model.gate.set()
    assert [r.tokens for r in await asyncio.gather(*futures)] == [reverse(source(n), 5).tokens for n in (2, 5, 3)]
    await asyncio.gather(*running)
    await pool.close(1)


async def test_the_rows_of_a_request_enter_a_batchers_queue_shortest_first() -> None:
    model = FakeModel()
    model.gate = threading.Event()
    batcher = Batcher("one-queue", model.generate, BatchLimits(max_wait_s=0.0, max_batch_size=1))  # type: ignore[arg-type]
    batcher.start()
    held = asyncio.ensure_future(batcher.submit([source(1)], 1, 5))
    await asyncio.sleep(0.05)
    lengths = [5, 2, 7, 3]
    submitted = asyncio.ensure_future(batcher.submit([source(n) for n in lengths], 1, 10))
    await asyncio.sleep(0.02)
    model.gate.set()
    assert await submitted == [reverse(source(n), 10) for n in lengths]
    await held
    assert model.batches[1:] == [[3], [4], [6], [8]]  # one row per batch, in queue order
    await batcher.close(1)


async def test_the_batchers_of_a_model_share_one_admission_share() -> None:
    pool = make_pool(FakeModel(), "p-share", workers=3)
    first = pool.batchers[0].share
    assert all(b.share is first for b in pool.batchers)
    await pool.close(1)


async def test_a_request_dealt_over_two_batchers_counts_the_slower_workers_joins() -> None:
    pool = running_pool("pool-timing", join_delay_s=0.06)
    timing = RequestTiming(time.perf_counter())
    with mock.patch.object(timing, "joined", wraps=timing.joined) as joined:
        await pool.submit([source(20), source(22)], 1, 30, timing=timing)  # idle batchers: one row each
    stages = dict(timing.stages(time.perf_counter()))
    assert joined.call_count == 2  # one join in each worker, side by side: the slower counts, not their sum
    assert 60 <= stages["join"] < 1000 * sum(call.args[0] for call in joined.call_args_list)
    assert stages["join"] == 1000 * max(call.args[0] for call in joined.call_args_list)
    await pool.close(1)
