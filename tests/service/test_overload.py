"""Overload, deadlines, client disconnects and failing batches, over the fake models.

A gated fake model holds its batch in the worker thread until the test opens the gate, so a
first request can hold the worker while the test fills the queue behind it, however slow the
machine is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from service.observability.metrics import REGISTRY
from tests.service.api.test_routes import assert_error
from tests.service.conftest import AppFactory, serving
from tests.service.fakes import FakeModel

pytestmark = pytest.mark.anyio

MODEL = "translate-en-it"


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value(
        "attnserve_rejected_total", {"model": MODEL, "reason": reason}
    ) or 0.0


def queue_depth() -> float:
    return REGISTRY.get_sample_value("attnserve_queue_depth", {"model": MODEL}) or 0.0


async def hold_the_worker(client: Any, fake_model: FakeModel, text: str = "blocker") -> Any:
    """Close the model's gate, start a request and return once its batch runs in the worker
    (the queue is empty); the test opens `fake_model.gate` to let it finish."""
    fake_model.gate = threading.Event()
    running = asyncio.ensure_future(client.post("/v1/translate", json={"text": text}))
    for _ in range(500):
        if text in fake_model.seen:
            return running
        await asyncio.sleep(0.005)
    raise AssertionError("the first request never reached the model")


async def timed_post(client: Any, body: dict[str, Any], **kwargs: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    response = await client.post("/v1/translate", json=body, **kwargs)
    return response, time.perf_counter() - started


@pytest.mark.parametrize(("queue_size", "extra"), [(4, 1), (8, 6)])
async def test_k_extra_requests_get_429_fast_and_the_accepted_ones_succeed(
    make_app: AppFactory, fake_model: FakeModel, queue_size: int, extra: int
) -> None:
    app = make_app(max_queue_size=queue_size, max_texts=1, max_batch_size=queue_size,
                   retry_after_s=3)
    async with serving(app) as client:
        running = await hold_the_worker(client, fake_model)
        before = rejected("queue_full")
        tasks = [asyncio.ensure_future(timed_post(client, {"text": f"request {chr(97 + i)}"}))
                 for i in range(queue_size)]
        for _ in range(1000):  # the queue fills while the worker is held
            if queue_depth() >= queue_size:
                break
            await asyncio.sleep(0.005)
        assert queue_depth() == queue_size
        # Each extra request, sent once the queue is full, is refused on its own clock.
        extras = [await timed_post(client, {"text": f"extra {i}"}) for i in range(extra)]
        assert fake_model.gate is not None
        fake_model.gate.set()
        answers = [*await asyncio.gather(*tasks), *extras]
        assert (await running).status_code == 200
        counted = rejected("queue_full") - before
    refused = [(r, seconds) for r, seconds in answers if r.status_code == 429]
    accepted = [r for r, _ in answers if r.status_code != 429]
    assert len(refused) == extra and counted == extra
    for response, seconds in refused:
        assert_error(response, 429, "overloaded")
        assert response.headers["retry-after"] == "3"
        assert seconds < 0.05, f"a 429 took {seconds * 1000:.0f} ms"
    assert len(accepted) == queue_size
    assert all(r.status_code == 200 for r in accepted)


async def test_with_the_queue_full_a_request_is_refused_before_its_body_is_read(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    app = make_app(max_queue_size=2, max_texts=1, max_batch_size=2)
    async with serving(app) as client:
        running = await hold_the_worker(client, fake_model)
        queued = [asyncio.ensure_future(client.post("/v1/translate", json={"text": f"queued {chr(97 + i)}"}))
                  for i in range(2)]
        for _ in range(1000):
            if queue_depth() >= 2:
                break
            await asyncio.sleep(0.005)
        before = rejected("queue_full")
        # not even JSON: a request that reached the route would get 422
        refused = await client.post("/v1/translate", content=b"{not json",
                                    headers={"Content-Type": "application/json"})
        counted = rejected("queue_full") - before
        assert fake_model.gate is not None
        fake_model.gate.set()
        answered = await asyncio.gather(*queued)
        assert [r.status_code for r in answered] == [200, 200], [r.text for r in answered]
        assert (await running).status_code == 200
    assert_error(refused, 429, "overloaded")
    assert "queue is full" in refused.json()["error"]
    assert counted == 1


@pytest.mark.parametrize("how", ["header", "field"])
async def test_a_request_queued_past_its_deadline_gets_504_and_never_runs(
    make_app: AppFactory, fake_model: FakeModel, how: str
) -> None:
    body: dict[str, Any] = {"text": "too late"}
    headers = {}
    if how == "header":
        headers["X-Request-Timeout-Ms"] = "100"
    else:
        body["timeout_ms"] = 100
    async with serving(make_app(request_timeout_s=30)) as client:
        running = await hold_the_worker(client, fake_model)
        before = rejected("deadline")
        response, seconds = await timed_post(client, body, headers=headers)
        counted = rejected("deadline") - before
        assert fake_model.gate is not None
        fake_model.gate.set()
        assert (await running).status_code == 200
        await asyncio.sleep(0.05)  # the batcher's loop moved on past the expired row
    assert_error(response, 504, "deadline_exceeded")
    assert 0.09 < seconds < 1.0  # at its deadline, not when the worker frees up
    assert counted == 1
    assert "too late" not in fake_model.seen


async def test_the_batcher_fails_rows_still_queued_at_their_deadline() -> None:
    from service.batching.batcher import Batcher
    from service.batching.policy import BatchLimits
    from service.core.errors import DeadlineExceeded
    from tests.service.fakes import CharTokenizer

    model = FakeModel(delay_s=0.2)
    batcher = Batcher(MODEL, model.generate, BatchLimits(max_batch_size=1, max_wait_s=0))
    batcher.start()
    tokens = CharTokenizer()
    first = asyncio.ensure_future(batcher.submit([[*tokens.encode("first"), 3]], 1, 10))
    await asyncio.sleep(0.05)
    late = batcher.submit([[*tokens.encode("late"), 3]], 1, 10,
                          deadline=time.perf_counter() + 0.05)
    with pytest.raises(DeadlineExceeded):
        await late  # no `wait_for` around it: the batcher itself refuses to run it
    assert [r.tokens for r in await first]
    await batcher.close(1)
    assert model.seen == ["first"]


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5", "9" * 20])
async def test_a_bad_timeout_header_is_422(make_app: AppFactory, value: str) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", json={"text": "abc"},
                                     headers={"X-Request-Timeout-Ms": value})
    assert_error(response, 422, "invalid_input")


async def test_the_header_cannot_exceed_the_configured_deadline(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    async with serving(make_app(request_timeout_s=0.15)) as client:
        fake_model.delay_s = 0.4
        response, seconds = await timed_post(client, {"text": "slow"},
                                             headers={"X-Request-Timeout-Ms": "60000"})
        fake_model.delay_s = 0
    assert_error(response, 504, "deadline_exceeded")
    assert seconds < 0.35


async def test_a_queued_request_whose_client_left_is_dropped_and_counted(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    app = make_app()
    async with serving(app) as client:
        running = await hold_the_worker(client, fake_model)
        gone = asyncio.Event()
        sent: list[dict[str, Any]] = []
        calls = 0

        async def receive() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": b'{"text": "nobody waits"}',
                        "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/translate", "raw_path": b"",
                 "query_string": b"", "root_path": "", "server": ("test", 80),
                 "client": ("127.0.0.1", 5000),
                 "headers": [(b"content-type", b"application/json"), (b"host", b"test")]}
        before = rejected("disconnected")
        request = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.sleep(0.1)
        gone.set()
        await asyncio.wait_for(request, 5)  # returns while the blocker still runs
        assert not running.done()
        counted = rejected("disconnected") - before
        assert fake_model.gate is not None
        fake_model.gate.set()
        assert (await running).status_code == 200
        await asyncio.sleep(0.05)
    assert counted == 1
    assert sent[0]["status"] == 499
    assert "nobody waits" not in fake_model.seen


@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
async def test_an_exception_in_one_batch_fails_only_that_batch(error: type[Exception]) -> None:
    from service.batching.batcher import Batcher
    from service.batching.policy import BatchLimits
    from service.core.errors import InternalError
    from tests.service.fakes import CharTokenizer, reverse

    tokens = CharTokenizer()
    poison = tokens.encode("poison")

    def generate(sources: list[list[int]], beam_size: int, max_new_tokens: int,
                 hooks: Any = None) -> list[Any]:
        time.sleep(0.02)
        if any(source[:-1] == poison for source in sources):
            raise error("out of memory in this batch")
        return [reverse(source, max_new_tokens) for source in sources]

    batcher = Batcher(MODEL, generate, BatchLimits(max_batch_size=4, max_wait_s=0.01))
    batcher.start()
    # Different token limits never share a batch: the poison's batch holds it and "b" only.
    poisoned = asyncio.ensure_future(batcher.submit(
        [[*poison, 3], [*tokens.encode("b"), 3]], 1, 10))
    healthy = [asyncio.ensure_future(batcher.submit([[*tokens.encode(t), 3]], 1, 20))
               for t in ("abc", "de", "fgh")]
    with pytest.raises(InternalError):
        await poisoned
    results = [await h for h in healthy]
    after = await batcher.submit([[*tokens.encode("xy"), 3]], 1, 10)
    await batcher.close(1)
    assert [tokens.decode(r[0].tokens) for r in results] == ["cba", "ed", "hgf"]
    assert tokens.decode(after[0].tokens) == "yx"
