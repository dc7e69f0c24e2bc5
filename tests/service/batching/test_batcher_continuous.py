"""The batcher with continuous batching: rows join the running batch between decoder steps,
leave it as soon as they finish, and other work runs between two steps."""

from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

import pytest

from service.batching.batcher import Batcher
from service.batching.policy import BatchLimits, join_age_limit
from service.batching.running_batch import RunningBatch
from service.batching.slot_batch import SlotBatch
from service.core.errors import InternalError
from service.generation.hooks import RowHooks
from service.generation.search import generate
from service.observability import metrics
from service.observability.timing import RequestTiming
from service.runtime import ModelRuntime
from tests.service.fakes import EOS, ROW_CACHE_BYTES, UNK, FakeModel, FakeRunningBatch, reverse

pytestmark = pytest.mark.anyio


def source(length: int, start: int = 4) -> list[int]:
    return [start + i % 20 for i in range(length)] + [EOS]


def make(name: str, running: FakeRunningBatch, model: FakeModel | None = None, **limits: float) -> Batcher:
    model = model or FakeModel()
    batcher = Batcher(name, model.generate, BatchLimits(**limits), lambda: running)  # type: ignore[arg-type]
    batcher.start()
    return batcher


async def test_a_late_row_joins_the_running_batch_and_leaves_before_it_ends() -> None:
    running = FakeRunningBatch(step_delay_s=0.005)
    batcher = make("c-join", running)
    long_task = asyncio.ensure_future(batcher.submit([source(60)], 1, 100))
    await asyncio.sleep(0.05)  # the long row is decoding
    short = await batcher.submit([source(3, start=30)], 1, 100)
    assert not long_task.done()  # the short row left while the long one still decodes
    assert short == [reverse(source(3, start=30), 100)]
    assert await long_task == [reverse(source(60), 100)]
    shared = [step for step in running.steps if len(step) == 2]
    assert shared and len(shared) == 4  # 3 tokens + the EOS step, next to the long row
    assert batcher.counters.batches == 2 and batcher.counters.max_batch_rows == 2
    assert batcher.running == 0
    await batcher.close(1)


async def test_the_cache_bytes_follow_the_running_batch_and_the_most_is_kept() -> None:
    def gauge() -> float | None:
        return metrics.REGISTRY.get_sample_value("attnserve_batch_cache_bytes", {"model": "c-cache"})

    running = FakeRunningBatch(step_delay_s=0.005)
    batcher = make("c-cache", running)
    long_task = asyncio.ensure_future(batcher.submit([source(60)], 1, 100))
    await asyncio.sleep(0.05)
    assert batcher.cache_bytes == ROW_CACHE_BYTES and gauge() == ROW_CACHE_BYTES
    await asyncio.gather(*(batcher.submit([source(3, start=30 + i)], 1, 100) for i in range(2)))
    assert batcher.cache_bytes == ROW_CACHE_BYTES and gauge() == ROW_CACHE_BYTES  # the two left
    await long_task
    assert batcher.cache_bytes == 0 and gauge() == 0
    assert batcher.counters.max_cache_bytes == 3 * ROW_CACHE_BYTES
    await batcher.close(1)


async def test_steps_run_in_the_worker_thread() -> None:
    running = FakeRunningBatch()
    batcher = make("c-thread", running)
    await batcher.submit([source(3)], 1, 10)
    assert running.threads and all(name.startswith("batch-c-thread") for name in running.threads)
    await batcher.close(1)


async def test_the_running_batch_holds_at_most_max_batch_size_rows() -> None:
    running = FakeRunningBatch(step_delay_s=0.001)
    batcher = make("c-size", running, max_batch_size=3)
    sources = [source(n) for n in (5, 9, 2, 7, 4, 8, 3, 6, 1, 10)]
    results = await asyncio.gather(*(batcher.submit([s], 1, 50) for s in sources))
    assert [r[0] for r in results] == [reverse(s, 50) for s in sources]
    assert max(len(step) for step in running.steps) == 3
    assert batcher.counters.rows == 10
    await batcher.close(1)


async def test_the_token_budget_caps_the_running_batch() -> None:
    running = FakeRunningBatch(step_delay_s=0.001)
    batcher = make("c-tokens", running, max_batch_tokens=30)
    await asyncio.gather(*(batcher.submit([source(9)], 1, 20) for _ in range(6)))  # 10 tokens each
    assert max(len(step) for step in running.steps) == 3
    await batcher.close(1)


async def test_per_row_token_limits_share_the_running_batch() -> None:
    running = FakeRunningBatch(step_delay_s=0.001)
    batcher = make("c-limits", running, max_wait_s=0.05)
    results = await asyncio.gather(batcher.submit([source(8)], 1, 3), batcher.submit([source(8)], 1, 50))
    assert results == [[reverse(source(8), 3)], [reverse(source(8), 50)]]
    assert results[0][0].finish_reason == "length" and results[1][0].finish_reason == "eos"
    assert any(len(step) == 2 for step in running.steps)
    await batcher.close(1)


async def test_beam_rows_run_beside_the_running_batch() -> None:
    running = FakeRunningBatch(step_delay_s=0.005)
    model = FakeModel()
    batcher = make("c-beam", running, model)
    long_task = asyncio.ensure_future(batcher.submit([source(60)], 1, 100))
    await asyncio.sleep(0.05)
    beam = await batcher.submit([source(4)], 3, 100)
    assert not long_task.done() and beam == [reverse(source(4), 100)]
    assert model.batches == [[5]]  # the beam row went to the request-level generate
    assert model.threads and all(name.startswith("batch-c-beam-beam") for name in model.threads)
    await long_task
    await batcher.close(1)


async def test_a_running_beam_batch_does_not_hold_back_greedy_rows() -> None:
    running = FakeRunningBatch(step_delay_s=0.002)
    model = FakeModel(gate=threading.Event())  # the beam batch runs until the gate opens
    batcher = make("c-beam-hol", running, model)
    beam_task = asyncio.ensure_future(batcher.submit([source(6), source(8)], 4, 100))
    await asyncio.sleep(0.05)
    assert batcher.running == 2 and not beam_task.done()
    # greedy requests arriving now join the running batch, decode and finish
    greedy = await asyncio.wait_for(asyncio.gather(*(batcher.submit([source(n)], 1, 100) for n in (3, 5, 7))), 5)
    assert [g[0] for g in greedy] == [reverse(source(n), 100) for n in (3, 5, 7)]
    assert not beam_task.done()
    # a second beam request waits for the first (one request-level batch at a time)
    second = asyncio.ensure_future(batcher.submit([source(4)], 2, 100))
    await asyncio.sleep(0.05)
    assert model.batches == [[7, 9]]
    assert model.gate is not None
    model.gate.set()
    assert await beam_task == [reverse(source(6), 100), reverse(source(8), 100)]
    assert await second == [reverse(source(4), 100)]
    assert model.batches == [[7, 9], [5]]
    await batcher.close(1)


async def test_a_cancelled_beam_request_stops_beside_the_running_batch() -> None:
    running = FakeRunningBatch(step_delay_s=0.002)
    model = FakeModel(gate=threading.Event())
    batcher = make("c-beam-cancel", running, model)
    beam_task = asyncio.ensure_future(batcher.submit([source(6)], 4, 100))
    await asyncio.sleep(0.05)
    beam_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await beam_task
    assert batcher.counters.cancelled == 1 and batcher.running == 0  # its row's cancel flag is set
    assert model.gate is not None
    model.gate.set()
    assert await batcher.submit([source(3)], 1, 100) == [reverse(source(3), 100)]
    await batcher.close(1)


async def test_other_work_runs_between_two_steps() -> None:
    running = FakeRunningBatch(step_delay_s=0.005)
    batcher = make("c-run", running)
    long_task = asyncio.ensure_future(batcher.submit([source(60)], 1, 100))
    await asyncio.sleep(0.05)
    assert await batcher.run(threading.current_thread) is not threading.current_thread()
    assert not long_task.done()
    await long_task
    await batcher.close(1)


async def test_a_failing_step_fails_its_rows_and_the_next_rows_are_served() -> None:
    running = FakeRunningBatch(step_delay_s=0.002)
    batcher = make("c-fail", running)
    healthy = asyncio.ensure_future(batcher.submit([source(30)], 1, 100))
    await asyncio.sleep(0.02)
    with pytest.raises(InternalError):
        await batcher.submit([[4, UNK, 5, EOS]], 1, 100)
    with pytest.raises(InternalError):  # it shared the failing step
        await healthy
    assert len(running) == 0 and batcher.running == 0
    assert await batcher.submit([source(3)], 1, 10) == [reverse(source(3), 10)]
    await batcher.close(1)


async def test_a_cancelled_streamed_row_leaves_at_the_next_step() -> None:
    running = FakeRunningBatch(step_delay_s=0.005)
    batcher = make("c-cancel", running)
    tokens: list[int] = []
    hooks = RowHooks(on_token=tokens.append)
    [future] = batcher.enqueue([source(60)], 1, 100, hooks=[hooks])
    other = asyncio.ensure_future(batcher.submit([source(60, start=5)], 1, 100))
    while len(tokens) < 3:
        await asyncio.sleep(0.005)
    assert batcher.cancel(future) == "decoding"
    await asyncio.sleep(0.05)
    assert all(row.future is not future for step in running.steps[-3:] for row in step)
    assert batcher.counters.cancelled == 1 and batcher.running == 1
    await other
    await batcher.close(1)


async def test_close_lets_the_running_batch_finish() -> None:
    running = FakeRunningBatch(step_delay_s=0.002)
    batcher = make("c-close", running)
    task = asyncio.ensure_future(batcher.submit([source(20)], 1, 100))
    await asyncio.sleep(0.01)
    await batcher.close(5)
    assert await task == [reverse(source(20), 100)]


@pytest.mark.parametrize("running_batch", [RunningBatch, SlotBatch])
async def test_onnx_rows_arriving_at_random_times_get_their_solo_tokens(tiny_runtime: ModelRuntime,
                                                                         trained_tiny, running_batch) -> None:
    """The real running batches behind the batcher: each row decodes what it decodes alone."""
    batcher = Batcher("c-onnx", lambda *a, **k: generate(tiny_runtime, *a, **k),
                      BatchLimits(max_batch_size=5, max_join_age=1), lambda: running_batch(tiny_runtime))
    batcher.start()
    sources = [s + [EOS] for s in trained_tiny.valid.sources[:16]]

    async def later(index: int, source_ids: list[int]):
        await asyncio.sleep(0.002 * (index % 7))
        return (await batcher.submit([source_ids], 1, 12))[0]

    started = time.perf_counter()
    results = await asyncio.gather(*(later(i, s) for i, s in enumerate(sources)))
    assert time.perf_counter() - started < 30
    for result, source_ids in zip(results, sources, strict=True):
        assert result.tokens == generate(tiny_runtime, [source_ids], 1, 12)[0].tokens
    assert batcher.counters.rows == 16 and batcher.counters.max_batch_rows <= 5
    await batcher.close(1)


async def test_beam_rows_join_a_slot_batch_and_decode_as_alone(tiny_runtime: ModelRuntime, trained_tiny) -> None:
    """A running batch that takes beams (`SlotBatch`): beam requests join it beside greedy rows,
    one row per beam within `max_batch_size`, and nothing runs in a request-level batch."""
    request_level: list[int] = []

    def generate_fn(sources, beam_size, max_new_tokens, hooks=None):
        request_level.append(beam_size)
        return generate(tiny_runtime, sources, beam_size, max_new_tokens, hooks=hooks)

    sizes: list[int] = []

    def slot_batch() -> SlotBatch:
        batch: SlotBatch = SlotBatch(tiny_runtime)
        step = batch.generate_token

        def counted():  # the rows of every step
            sizes.append(len(batch))
            return step()

        batch.generate_token = counted  # type: ignore[method-assign]
        return batch

    batcher = Batcher("c-onnx-beam", generate_fn, BatchLimits(max_batch_size=8), slot_batch)
    batcher.start()
    sources = [s + [EOS] for s in trained_tiny.valid.sources[:10]]
    beams = [1, 4, 1, 2, 3, 1, 4, 1, 2, 1]

    async def later(index: int):
        await asyncio.sleep(0.002 * (index % 5))
        return (await batcher.submit([sources[index]], beams[index], 12))[0]

    results = await asyncio.gather(*(later(i) for i in range(len(sources))))
    for result, source_ids, k in zip(results, sources, beams, strict=True):
        expected = generate(tiny_runtime, [source_ids], k, 12)[0]
        assert (result.tokens, result.finish_reason) == (expected.tokens, expected.finish_reason)
    assert request_level == []  # every beam row decoded in the running batch
    assert max(sizes) <= 8 and max(sizes) > 4  # beams counted as rows, and several rows at once
    await batcher.close(1)


async def test_rows_join_a_busy_batch_in_groups_or_after_the_join_wait() -> None:
    """With 8 rows busy (join group: a quarter of them, 2 rows), one newcomer waits
    `max_join_wait_s` for a companion; two newcomers join at once."""
    running = FakeRunningBatch(step_delay_s=0.005)
    batcher = make("c-group", running, max_batch_size=16, max_join_wait_s=0.15)
    busy = [asyncio.ensure_future(batcher.submit([source(60, start=4 + i)], 1, 100)) for i in range(8)]
    while len(running) < 8:
        await asyncio.sleep(0.002)
    started = time.perf_counter()
    alone = await batcher.submit([source(2)], 1, 100)
    assert time.perf_counter() - started >= 0.15 and alone == [reverse(source(2), 100)]
    steps_before = len(running.steps)
    pair = asyncio.gather(batcher.submit([source(2, start=9)], 1, 100), batcher.submit([source(2, start=11)], 1, 100))
    await pair
    joined_at = next(i for i, step in enumerate(running.steps) if len(step) == 10)
    assert joined_at - steps_before <= 2  # the pair joined at the next step or the one after
    await asyncio.gather(*busy)
    await batcher.close(1)


async def test_a_backlog_waits_for_room_for_a_whole_group() -> None:
    """A full batch of 16 rows with 16 more queued and no join wait: as busy rows finish one by
    one, the queued rows join in groups (a quarter of the batch: 3 when 15 rows run), never one
    per finished row."""
    running = FakeRunningBatch(step_delay_s=0.002)
    batcher = make("c-backlog", running, max_batch_size=16, max_join_wait_s=0.0)
    first = [batcher.submit([source(10 + 2 * i, start=4 + i % 10)], 1, 100) for i in range(16)]
    more = [batcher.submit([source(5, start=6 + i % 10)], 1, 100) for i in range(16)]
    results = await asyncio.gather(*first, *more)
    assert [r[0] for r in results[16:]] == [reverse(source(5, start=6 + i % 10), 100) for i in range(16)]
    # the first 16 joined together, the other 16 in groups of 3 or more (one by one: 17 joins)
    assert batcher.counters.rows == 32 and batcher.counters.batches <= 7, batcher.counters
    await batcher.close(1)


async def test_rows_wait_while_the_running_batch_is_older_than_max_join_age() -> None:
    """A newcomer's cache would be padded to the oldest row's length: past `max_join_age` steps
    it waits, and joins once the old row has left (a young batch it joins at once)."""
    running = FakeRunningBatch(step_delay_s=0.004)
    # max_batch_size 4: join_rows 1, so a batch of one row takes newcomers up to age 5
    batcher = make("c-age", running, max_join_age=5, max_join_wait_s=0.0, max_batch_size=4)
    old = asyncio.ensure_future(batcher.submit([source(30)], 1, 100))
    await asyncio.sleep(0.1)  # the old row has run more than 5 steps
    young = await batcher.submit([source(3, start=40)], 1, 100)
    assert old.done()  # it waited for the old row to finish
    assert young == [reverse(source(3, start=40), 100)]
    assert not [step for step in running.steps if len(step) == 2]  # never decoded side by side
    first = asyncio.ensure_future(batcher.submit([source(30)], 1, 100))
    await asyncio.sleep(0.005)  # one or two steps in: young enough
    await batcher.submit([source(3, start=40)], 1, 100)
    assert not first.done() and [step for step in running.steps if len(step) == 2]
    await first
    await batcher.close(1)


async def test_the_join_age_limit_does_not_hold_back_a_batch_that_does_not_pad() -> None:
    """On the step graph each row's cache is its own (`pads_to_oldest` False): a newcomer joins
    an old batch at once."""
    running = FakeRunningBatch(step_delay_s=0.004, pads_to_oldest=False)
    batcher = make("c-age-free", running, max_join_age=5, max_join_wait_s=0.0, max_batch_size=4)
    old = asyncio.ensure_future(batcher.submit([source(30)], 1, 100))
    await asyncio.sleep(0.1)  # the old row has run more than 5 steps
    young = await batcher.submit([source(3, start=40)], 1, 100)
    assert not old.done()  # the young row did not wait for it
    assert young == [reverse(source(3, start=40), 100)]
    assert [step for step in running.steps if len(step) == 2]  # decoded side by side
    await old
    await batcher.close(1)


def test_the_join_age_limit_shrinks_as_the_batch_grows() -> None:
    assert [join_age_limit(24, 16, rows) for rows in (1, 4, 16, 21, 64)] == [384, 96, 24, 18, 6]
    assert join_age_limit(24, 16, 0) == 384  # an empty batch: the newcomers start it


def test_oldest_age_counts_the_steps_of_the_oldest_live_row(tiny_runtime: ModelRuntime) -> None:
    batch: RunningBatch[str] = RunningBatch(tiny_runtime)
    assert batch.oldest_age == 0
    batch.concatenate([[5, 6, 7, EOS]], ["old"], [50])
    batch.generate_token()
    batch.generate_token()
    batch.concatenate([[8, EOS]], ["new"], [50])
    batch.generate_token()
    assert batch.oldest_age == 3



async def test_a_requests_timing_counts_its_join_once_and_its_steps() -> None:
    running = FakeRunningBatch(step_delay_s=0.005, join_delay_s=0.03)
    batcher = make("c-timing", running)
    timing = RequestTiming(time.perf_counter())
    began = time.perf_counter()
    with mock.patch.object(timing, "joined", wraps=timing.joined) as joined:
        await batcher.submit([source(3), source(4, start=40)], 1, 100, timing=timing)  # both join in one call
    ended = time.perf_counter()
    assert joined.call_count == 1  # the one join, not once per row
    stages = dict(timing.stages(ended))
    assert list(stages) == ["prepare", "queue", "join", "inference", "total"]
    assert stages["join"] >= 30  # the fake join's sleep
    assert stages["inference"] >= stages["join"] + 5 * 5  # the join and 5 steps of 5 ms (4 tokens + EOS)
    assert stages["inference"] <= (ended - began) * 1000 and stages["total"] >= stages["inference"]
    await batcher.close(1)
