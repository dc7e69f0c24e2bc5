"""A request's stage times and its `Server-Timing` header."""

from __future__ import annotations

import threading

from service.observability.timing import RequestTiming


def test_the_header_lists_each_stage_in_milliseconds() -> None:
    timing = RequestTiming(started=10.0)
    timing.queued(10.0005)
    timing.admitted(10.0015, enqueued_at=10.0005)  # one row waited 1 ms
    timing.admitted(10.0035, enqueued_at=10.0005)  # the other 3 ms
    timing.joined(0.0008)
    timing.joined(0.0004)
    timing.finished_at(10.0125)
    timing.finished_at(10.0100)  # a row finishing earlier moves nothing
    assert timing.header(10.013) == ("prepare;dur=0.500, queue;dur=3.000, join;dur=1.200, "
                                     "inference;dur=11.000, total;dur=13.000")


def test_stages_not_reached_are_left_out() -> None:
    assert RequestTiming(started=1.0).header(1.002) == "total;dur=2.000"
    queued = RequestTiming(started=1.0)
    queued.queued(1.001)
    assert [name for name, _ in queued.stages(1.004)] == ["prepare", "total"]
    admitted = RequestTiming(started=1.0)
    admitted.queued(1.001)
    admitted.admitted(1.002, enqueued_at=1.001)
    assert [name for name, _ in admitted.stages(1.004)] == ["prepare", "queue", "total"]  # no join, unfinished


def test_a_request_dealt_over_batchers_keeps_its_first_queueing_and_its_slowest_worker() -> None:
    timing = RequestTiming(started=0.0)
    timing.queued(0.001)
    timing.queued(0.002)  # its second part, on another batcher
    timing.joined(0.004)  # in this thread; the other worker's joins below
    worker = threading.Thread(target=lambda: (timing.joined(0.003), timing.joined(0.002)))
    worker.start()
    worker.join()
    assert timing.enqueued == 0.001 and timing.join_s == 0.005  # the other worker spent 5 ms in all
