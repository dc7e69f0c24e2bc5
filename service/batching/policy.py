"""Which queued rows form the next batch: pure functions of the queue and the running batch.

Request-level batches (`request_batch`): the oldest rows sharing the head's `RowKey` (beam
size, token limit), up to `max_batch_size` rows and `max_batch_tokens` padded source tokens
times the beams.

Joins into the running batch (`joiners`: greedy rows, and beam-search rows when the batch
takes them, `RunningState.takes_beams`, each counted as one row per beam): up to
`max_batch_size` rows and `max_batch_tokens` padded source tokens in the batch. A join costs
an encoder call and (unless
the newcomers fit in the slots of rows that left) a copy of the batch's state, so rows join in
groups of a quarter of the running batch (at most `join_rows`, a quarter of `max_batch_size`;
at once into a batch of fewer than 4 rows), or when the oldest has waited `max_join_wait_s`,
unless more rows wait than fit: then they wait for room for a whole group.

With `max_beam_wait_s` (0 by default: off) a beam-search row gives way while the batch is busy:
with more than `beam_rows` rows (a quarter of `max_batch_size`, its beams counted) it waits, and
the greedy rows behind it join, until the batch is that small again, it has waited
`max_beam_wait_s` or half its time to its deadline (`gives_way_until`; `join_due` wakes the
scheduler then). Its k beams make every step of the batch longer for its whole length, and the
greedy rows' latency tail is made when the batch is busy: the beam request waits instead. Two
runs of `bench.beam_mix` disagreed on what that buys the greedy rows, and the beam requests'
p95 more than doubled in both, so it is off by default (bench/README.md, "Beam rows giving way").

With `max_join_age`, rows wait while the batch's oldest row has run more than
`join_age_limit` steps: every row's cache is as long as the oldest row's output, so a join into
an old batch makes every step longer. The limit applies only to a batch that pads to its oldest
row (`RunningState.pads_to_oldest`); on the step graph each row's cache is its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar


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
    max_beam_wait_s: float = 0.0  # continuous batching: longest a beam-search row gives way to greedy rows (0: never)

    @property
    def join_rows(self) -> int:
        """The largest group rows join the running batch in (a quarter of `max_batch_size`)."""
        return max(1, self.max_batch_size // 4)

    @property
    def beam_rows(self) -> int:
        """The running batch's rows, counting a beam-search row's beams, up to which a beam-search
        row joins it before it has waited `max_beam_wait_s` (a quarter of `max_batch_size`, as
        `join_rows`)."""
        return self.join_rows


@dataclass(frozen=True)
class RowKey:
    """Rows batch together only when they share these generation options."""

    beam_size: int
    max_new_tokens: int



class Candidate(Protocol):
    """What the policy reads of a queued row."""

    @property
    def source(self) -> list[int]: ...
    @property
    def key(self) -> RowKey: ...
    @property
    def enqueued_at(self) -> float: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def done(self) -> bool: ...


Row = TypeVar("Row", bound=Candidate)


@dataclass(frozen=True)
class RunningState:
    """The running batch as the join policy sees it."""

    rows: int = 0  # rows it decodes (a beam-search row counts one per beam)
    longest: int = 0  # longest source among its rows
    oldest_age: int = 0  # steps its oldest row has run
    pads_to_oldest: bool = False
    takes_beams: bool = False  # beam-search rows join it too


def joins(key: RowKey, running: RunningState) -> bool:
    """Whether rows of `key` join the running batch: greedy rows always, beam-search rows when
    it takes them (else they form request-level batches)."""
    return key.beam_size == 1 or running.takes_beams


def gives_way_until(row: Candidate, limits: BatchLimits) -> float:
    """Until when a queued beam-search row gives way to greedy rows (`joiners`): `max_beam_wait_s`
    after it was queued, or half its time to its deadline when that is sooner."""
    until = row.enqueued_at + limits.max_beam_wait_s
    if row.deadline is not None:
        until = min(until, row.enqueued_at + (row.deadline - row.enqueued_at) / 2)
    return until


def join_age_limit(max_join_age: int, join_rows: int, rows: int) -> int:
    """The most decoder steps a running batch of `rows` rows may have run (its oldest row) and
    still take newcomers: `max_join_age` at `join_rows` rows, scaled inversely with the rows, so
    that rows x age -- the cached positions each step carries -- stays within the same budget
    (with the defaults, 24 x 16: age 96 at 4 rows, 24 at 16, 6 at 64)."""
    return max_join_age * join_rows // max(rows, 1)


def request_batch(queue: Iterable[Row], key: RowKey, limits: BatchLimits) -> tuple[list[Row], bool]:
    """The rows the next request-level batch of `key` would take, oldest first, and whether it
    is full (no further row could join it)."""
    chosen: list[Row] = []
    longest = 0
    for row in queue:
        if row.key != key or row.done:
            continue
        if len(chosen) == limits.max_batch_size:
            return chosen, True
        width = max(longest, len(row.source))
        if chosen and (len(chosen) + 1) * width * key.beam_size > limits.max_batch_tokens:
            return chosen, True
        chosen.append(row)
        longest = width
    return chosen, len(chosen) == limits.max_batch_size


def joiners(queue: Iterable[Row], running: RunningState, limits: BatchLimits, now: float) -> list[Row]:
    """The rows that join the running batch now (`joins`), oldest first; none while they
    should wait (a group forming, the batch too old, no room for a whole group)."""
    if (limits.max_join_age and running.pads_to_oldest and running.rows
            and running.oldest_age > join_age_limit(limits.max_join_age, limits.join_rows, running.rows)):
        return []
    room = limits.max_batch_size - running.rows
    rows, longest = running.rows, running.longest
    chosen: list[Row] = []
    taken = 0  # rows of the batch the chosen take (one per beam)
    left_behind = False  # a row waits that the room or the token budget kept out
    for row in queue:
        if row.done or not joins(row.key, running):
            continue
        width = max(longest, len(row.source))
        beams = row.key.beam_size
        if beams > 1 and rows and rows + beams > limits.beam_rows and now < gives_way_until(row, limits):
            continue  # gives way to the greedy rows behind it while the batch is busy (never with a wait of 0)
        # a row of more beams than the batch's size joins an empty batch alone
        too_many = taken + beams > room and (taken or running.rows)
        if too_many or (rows and (rows + beams) * width > limits.max_batch_tokens):
            left_behind = True
            break
        chosen.append(row)
        taken += beams
        rows, longest = rows + beams, width
    if not chosen:
        return []
    group = min(limits.join_rows, running.rows // 4)  # 0 when the batch is (nearly) empty
    waited = now - chosen[0].enqueued_at
    # behind a backlog a small group waits for room: joining a few rows per finished row would
    # copy the batch per row
    if taken < group and (left_behind or waited < limits.max_join_wait_s):
        return []
    return chosen


def join_due(queue: Iterable[Row], running: RunningState, limits: BatchLimits,
             now: float) -> float | None:
    """Seconds until the oldest waiting row that joins the batch (`joins`) may join without a
    group, or the oldest beam-search row stops giving way (`gives_way_until`), whichever is
    sooner, when that is ahead and the batch has room; None otherwise (a finishing row or an
    arrival wakes the scheduler then)."""
    if running.rows >= limits.max_batch_size:
        return None
    oldest = next((row for row in queue if joins(row.key, running) and not row.done), None)
    if oldest is None:
        return None
    dues = [oldest.enqueued_at + limits.max_join_wait_s - now]
    if limits.max_beam_wait_s:  # the oldest beam-search row giving way joins at the latest then
        beam = next((row for row in queue if row.key.beam_size > 1 and joins(row.key, running) and not row.done), None)
        if beam is not None:
            dues.append(gives_way_until(beam, limits) - now)
    ahead = [due for due in dues if due > 0]
    return min(ahead) if ahead else None
