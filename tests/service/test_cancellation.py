"""Abandoned work stops: a request whose deadline passes or whose client leaves -- plain
(non-streamed) requests included -- takes its rows out of the model's batch at the next decoder
step (greedy rows leave the running batch, beam searches stop), counted in
`attnserve_cancelled_rows_total{stage="decoding"}`."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.api.app import create_app
from service.core.settings import Settings
from service.observability.metrics import REGISTRY
from tests.service.conftest import serving
from tests.service.fakes import FakeLoader, FakeModel, FakeRunningBatch
from tests.service.live_server import serve, wait_until_ready

MODEL = "translate-en-it"
TEXTS = ["abcdefghijklmnopqrstuvwxyz"] * 16  # 26 tokens each: 27 decoder steps when left alone
STEP_S = 0.05


def cancelled_rows(stage: str = "decoding") -> float:
    return REGISTRY.get_sample_value(
        "attnserve_cancelled_rows_total", {"model": MODEL, "stage": stage}) or 0.0


def poll(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


async def apoll(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_an_expired_deadline_stops_the_beam_search_at_the_next_step(
    models_dir: Path, fake_model: FakeModel
) -> None:
    """16 texts x beam 8 with a 300 ms deadline: the 504 comes at the deadline and the batch
    decodes at most one more step, not the 27 it would take."""
    fake_model.step_delay_s = STEP_S
    app = create_app(Settings(models_dir=models_dir, batch_workers=1), loader=FakeLoader(),
                     generator=lambda runtime: fake_model.generate)
    before = cancelled_rows()
    async with serving(app) as client:
        response = await client.post(
            "/v1/translate", json={"texts": TEXTS, "beam_size": 8},
            headers={"X-Request-Timeout-Ms": "300"})
        steps_at_answer = len(fake_model.steps)
        batcher = app.state.registry.resolve("translate", None).batcher
        await apoll(lambda: fake_model.returned >= 2)  # the warm-up, then this batch
        assert batcher.running == 0
    assert response.status_code == 504, response.text
    assert response.json()["error_type"] == "deadline_exceeded"
    assert fake_model.batches[-1] == [27] * 16  # one batch of the 16 rows
    assert steps_at_answer < 27
    assert len(fake_model.steps) <= steps_at_answer + 1  # the step running when it was cancelled
    assert fake_model.steps[-1] == 16  # all rows decoded together until then
    assert cancelled_rows() == before + 16
    assert batcher.counters.cancelled == 16


def test_a_plain_request_whose_client_leaves_leaves_the_running_batch(models_dir: Path) -> None:
    """A non-streamed request of 16 greedy rows joins the running batch; its client closes the
    connection: the rows leave the running batch within one step and are counted."""
    running: dict[str, FakeRunningBatch] = {}

    def running_batch(runtime: Any) -> Callable[[], FakeRunningBatch]:
        return lambda: running.setdefault(runtime.name, FakeRunningBatch(step_delay_s=STEP_S))

    model = FakeModel()
    app = create_app(Settings(models_dir=models_dir, batch_workers=1, max_join_wait_ms=0),
                     loader=FakeLoader(), generator=lambda runtime: model.generate,
                     running_batch=running_batch)
    before = cancelled_rows()
    body = ('{"texts": [' + ", ".join(f'"{t}"' for t in TEXTS) + "]}").encode()
    with serve(app) as url:
        wait_until_ready(url)
        batch = running[MODEL]
        batcher = app.state.registry.resolve("translate", None).batcher
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: test\r\n"
                               b"Content-Type: application/json\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            poll(lambda: len(batch.steps) >= 3 and len(batch.steps[-1]) == 16)
            assert batcher.running == 16
        # the client is gone
        poll(lambda: cancelled_rows() == before + 16)
        steps_at_cancel = len(batch.steps)
        assert batcher.running == 0  # the rows no longer count as generating
        poll(lambda: len(batch) == 0)
        steps_after = batch.steps[steps_at_cancel:]
        assert len(steps_after) <= 1, [len(step) for step in steps_after]
        assert len(batch.steps) < 27  # it did not decode to the end
        card = next(c for c in _models(url) if c["name"] == MODEL)
    assert card["batching"]["cancelled"] == 16 and card["batching"]["running"] == 0


def _models(url: str) -> list[dict[str, Any]]:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).json()["models"]
