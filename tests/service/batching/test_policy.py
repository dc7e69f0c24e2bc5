"""The batch formation rules, on plain rows: no event loop, no model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from service.batching.policy import (
    BatchLimits,
    RowKey,
    RunningState,
    join_age_limit,
    join_due,
    joiners,
    request_batch,
)

GREEDY = RowKey(beam_size=1, max_new_tokens=16)
BEAM = RowKey(beam_size=4, max_new_tokens=16)


@dataclass
class Row:
    source: list[int]
    key: RowKey = GREEDY
    enqueued_at: float = 0.0
    done: bool = False
    deadline: float | None = None


def rows(*lengths: int, key: RowKey = GREEDY, at: float = 0.0) -> list[Row]:
    return [Row([1] * n, key, at) for n in lengths]


def test_request_batch_takes_the_oldest_rows_of_the_key_up_to_the_size() -> None:
    queue = [*rows(3, key=BEAM), *rows(2), *rows(4, 5, 6, key=BEAM)]
    chosen, full = request_batch(queue, BEAM, BatchLimits(max_batch_size=3))
    assert chosen == [queue[0], queue[2], queue[3]] and full


def test_request_batch_stops_at_the_padded_token_budget_times_beams() -> None:
    queue = rows(2, 2, 10, key=BEAM)
    # 2 rows x 2 tokens x 4 beams = 16 fit; a third row pads all to 10: 3 x 10 x 4 = 120 > 64
    chosen, full = request_batch(queue, BEAM, BatchLimits(max_batch_tokens=64))
    assert chosen == queue[:2] and full


def test_request_batch_skips_resolved_rows_and_is_not_full_when_the_queue_runs_out() -> None:
    queue = rows(2, 2, 2)
    queue[1].done = True
    chosen, full = request_batch(queue, GREEDY, BatchLimits(max_batch_size=8))
    assert chosen == [queue[0], queue[2]] and not full


def test_beam_rows_join_a_batch_that_takes_beams_one_row_per_beam() -> None:
    queue = [*rows(3), *rows(4, key=BEAM), *rows(5)]
    greedy_only = RunningState(rows=1, longest=5)
    assert joiners(queue, greedy_only, BatchLimits(), now=0.0) == [queue[0], queue[2]]
    beams = RunningState(rows=1, longest=5, takes_beams=True)
    assert joiners(queue, beams, BatchLimits(), now=0.0) == queue
    # room for 4 more rows: the greedy row (1) fits, the beam row (4) does not, nor what follows
    assert joiners(queue, beams, BatchLimits(max_batch_size=5), now=0.0) == [queue[0]]  # (by default it never gives way)
    # the token budget counts a beam row's rows: (1 + 1 + 4) x 5 = 30 > 24
    assert joiners(queue, beams, BatchLimits(max_batch_tokens=24), now=0.0) == [queue[0]]


def test_a_beam_row_gives_way_to_greedy_rows_while_the_batch_is_busy() -> None:
    """Past a quarter of the batch (`beam_rows`, its beams counted) a beam-search row waits and
    the greedy rows behind it join; it joins once the batch is that small again, or once it has
    waited `max_beam_wait_s`, which `join_due` wakes the scheduler for."""
    limits = BatchLimits(max_batch_size=32, max_beam_wait_s=0.5)  # beam_rows 8
    queue = [*rows(4, key=BEAM, at=1.0), *rows(3, 5, at=1.0)]
    busy = RunningState(rows=6, longest=5, takes_beams=True)  # 6 + 4 beams > 8
    assert limits.beam_rows == 8
    assert joiners(queue, busy, limits, now=1.2) == queue[1:]
    assert join_due(queue, busy, limits, now=1.2) == pytest.approx(0.3)  # the beam row's wait ends first
    assert joiners(queue, busy, limits, now=1.5) == queue  # waited long enough: joins, beams counted
    quiet = RunningState(rows=4, longest=5, takes_beams=True)  # 4 + 4 beams fit
    assert joiners(queue, quiet, limits, now=1.0) == queue
    # greedy rows chosen ahead of it count: 3 + 1 + 1 + 4 > 8
    late = [*rows(3, 5, at=1.0), *rows(4, key=BEAM, at=1.0)]
    assert joiners(late, RunningState(rows=3, longest=5, takes_beams=True), limits, now=1.0) == late[:2]
    queue[0].deadline = 1.4  # gives way for half its time to its deadline when that is sooner
    assert joiners(queue, busy, limits, now=1.1) == queue[1:] and joiners(queue, busy, limits, now=1.2) == queue
    assert join_due(queue, busy, limits, now=1.15) == pytest.approx(0.05)  # its half ends at 1.2
    never = BatchLimits(max_batch_size=32)  # the default, --max-beam-wait-ms 0: it never gives way
    assert joiners(queue, busy, never, now=1.0) == queue and join_due(queue, busy, never, now=1.05) == pytest.approx(0.05)


def test_a_beam_row_wider_than_the_batch_joins_it_alone_when_empty() -> None:
    queue = rows(4, 4, key=BEAM)
    limits = BatchLimits(max_batch_size=2)
    assert joiners(queue, RunningState(takes_beams=True), limits, now=0.0) == [queue[0]]
    assert joiners(queue, RunningState(rows=4, longest=4, takes_beams=True), limits, now=0.0) == []


def test_rows_join_a_small_batch_at_once() -> None:
    queue = rows(3, 4)
    assert joiners(queue, RunningState(rows=3, longest=5), BatchLimits(), now=0.0) == queue


def test_a_group_smaller_than_a_quarter_of_the_batch_waits_until_max_join_wait() -> None:
    limits = BatchLimits(max_batch_size=32, max_join_wait_s=0.1)
    running = RunningState(rows=16, longest=5)  # group: min(8, 16 // 4) = 4
    queue = rows(3, 3, at=10.0)
    assert joiners(queue, running, limits, now=10.05) == []
    assert joiners(queue, running, limits, now=10.15) == queue
    assert joiners(rows(3, 3, 3, 3, at=10.0), running, limits, now=10.0) != []


def test_behind_a_backlog_a_small_group_waits_for_room_however_long_it_waited() -> None:
    limits = BatchLimits(max_batch_size=20, max_join_wait_s=0.1)
    running = RunningState(rows=18, longest=5)  # room 2 < group 4, more rows wait than fit
    assert joiners(rows(3, 3, 3, at=0.0), running, limits, now=100.0) == []


def test_beam_rows_never_join_and_the_token_budget_holds() -> None:
    queue = [*rows(3, key=BEAM), *rows(3, 50)]
    chosen = joiners(queue, RunningState(rows=1, longest=3), BatchLimits(max_batch_tokens=40), now=0.0)
    assert chosen == [queue[1]]  # 3 rows x 50 > 40 keeps the long one out


def test_an_old_padded_batch_takes_no_newcomers() -> None:
    limits = BatchLimits(max_batch_size=64, max_join_age=24)  # join_rows 16
    limit = join_age_limit(24, 16, 16)
    assert limit == 24
    old = RunningState(rows=16, longest=5, oldest_age=limit + 1, pads_to_oldest=True)
    queue = rows(*[3] * 8)
    assert joiners(queue, old, limits, now=0.0) == []
    slots = RunningState(rows=16, longest=5, oldest_age=limit + 1, pads_to_oldest=False)
    assert joiners(queue, slots, limits, now=0.0) == queue


@pytest.mark.parametrize(("rows_", "limit"), [(4, 96), (16, 24), (64, 6)])
def test_join_age_limit_keeps_rows_times_age_constant(rows_: int, limit: int) -> None:
    assert join_age_limit(24, 16, rows_) == limit


def test_join_due_is_the_oldest_greedy_rows_wait_left() -> None:
    limits = BatchLimits(max_batch_size=4, max_join_wait_s=0.1)
    queue = [*rows(2, key=BEAM, at=0.0), *rows(2, at=1.0)]
    assert join_due(queue, RunningState(rows=1), limits, now=1.04) == pytest.approx(0.06)
    assert join_due(queue, RunningState(rows=1), limits, now=1.2) is None  # overdue: no timer
    assert join_due(queue, RunningState(rows=4), limits, now=1.04) is None  # full batch
