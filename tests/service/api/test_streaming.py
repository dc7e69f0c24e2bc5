"""`"stream": true` over a real HTTP server, read with httpx: the events, and a disconnect.

The tiny reversal model (onnxruntime, CPU) gives the outputs to compare with `/v1/translate`;
the fake model, slowed down per decoder step, gives a stream long enough to leave midway.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.app import create_app
from service.observability import metrics
from tests.service.conftest import MODELS, AppFactory, serving, tiny_settings
from tests.service.fakes import FakeLoader, FakeModel
from tests.service.live_server import serve, wait_until_ready

TEXTS = ["abc de", "kol", "a b c", "mn o", "hij kl"]


def read_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON of each `data:` event of an SSE body, as it arrives."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])
        else:
            assert line == "", f"not an SSE line: {line!r}"


def stream_events(client: httpx.Client, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(read_events(response))


@pytest.fixture(scope="module")
def tiny_url(served_tiny_models: Path) -> Iterator[str]:
    """The real app over the tiny model, on a loopback port."""
    with serve(create_app(tiny_settings(served_tiny_models))) as url:
        wait_until_ready(url)
        yield url


@pytest.mark.parametrize("beam_size", [1, 3])
def test_events_concatenate_to_the_plain_output(tiny_url: str, beam_size: int) -> None:
    seen = {}
    with httpx.Client(base_url=tiny_url, timeout=30, trust_env=False) as client:
        for text in TEXTS:
            body = {"text": text, "beam_size": beam_size}
            plain = client.post("/v1/translate", json=body).json()
            [expected] = plain["outputs"]
            events = stream_events(client, "/v1/translate", body)
            *tokens, final = events
            assert final["done"] is True and final["model"] == plain["model"]
            assert final["output"] == expected and final["usage"] == plain["usage"]
            # the request's stages, as a JSON answer's Server-Timing (beam rows join the running batch too)
            assert list(final["timing"]) == ["prepare", "queue", "join", "inference", "total"]
            assert 0 < final["timing"]["inference"] <= final["timing"]["total"]
            assert "".join(e["delta"] for e in events) == expected["text"]
            assert len(tokens) == expected["output_tokens"] > 0
            assert [e["index"] for e in tokens] == list(range(len(tokens)))
            assert tokens[-1]["text"] == expected["text"]
            assert all(e["token"]["piece"] and isinstance(e["token"]["id"], int) for e in tokens)
            assert "".join(e["token"]["piece"] for e in tokens).replace("\u2581", " ").lstrip() \
                == expected["text"]
            seen[text] = final["output"]["text"]
    assert seen["abc de"].strip() == "ed cba"  # the tiny model reverses


def test_stream_errors_before_the_stream_are_json(tiny_url: str) -> None:
    with httpx.Client(base_url=tiny_url, timeout=30, trust_env=False) as client:
        too_long = client.post("/v1/translate",
                               json={"text": "abcdefghijklmno abc", "stream": True})
        several = client.post("/v1/translate", json={"texts": ["ab"], "stream": True})
        unknown = client.post("/v1/summarize", json={"text": "ab", "stream": True})
    assert (too_long.status_code, too_long.json()["error_type"]) == (422, "invalid_input")
    assert "at most 15 allowed" in too_long.json()["error"]
    assert (several.status_code, several.json()["error_type"]) == (422, "invalid_input")
    assert (unknown.status_code, unknown.json()["error_type"]) == (404, "model_not_found")


def cancelled(model: str, stage: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "attnserve_cancelled_rows_total", {"model": model, "stage": stage}) or 0.0


def test_a_disconnect_mid_stream_frees_the_row(models_dir: Path) -> None:
    """Two streams share a batch; one client leaves after 3 tokens: its row leaves the batch at
    the next step (counted as cancelled while decoding), the other streams to its end."""
    model_name = "translate-en-it"
    assert model_name in MODELS
    fake = FakeModel(step_delay_s=0.03)
    app = create_app(tiny_settings(models_dir, max_wait_ms=1000), loader=FakeLoader(),
                     generator=lambda runtime: fake.generate)
    stay, leave = "abcdefghijklmnopqrstuvwxyz" * 2, "zyxwvutsrqponmlkjihgfedcba" * 2
    before = cancelled(model_name, "decoding")
    with serve(app) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        wait_until_ready(url)
        batcher = app.state.registry.resolve("translate", None).batcher
        kept: list[dict[str, Any]] = []
        staying = threading.Thread(
            target=lambda: kept.extend(stream_events(client, "/v1/translate", {"text": stay})))
        staying.start()
        with client.stream("POST", "/v1/translate", json={"text": leave, "stream": True}) as r:
            events = read_events(r)
            first = [next(events) for _ in range(3)]
        assert [e["delta"] for e in first] == list("abc")  # the fake model reverses
        deadline = time.monotonic() + 10
        while cancelled(model_name, "decoding") == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled(model_name, "decoding") == before + 1
        assert batcher.counters.cancelled == 1
        assert batcher.running == 1  # only the staying row still generates
        staying.join(timeout=20)
        cards = {c["name"]: c for c in client.get("/v1/models").json()["models"]}
        exposition = client.get("/metrics").text
    assert kept[-1]["done"] and kept[-1]["output"]["text"] == stay[::-1]
    assert "".join(e["delta"] for e in kept) == stay[::-1]
    assert fake.batches[-1] == [len(stay) + 1, len(leave) + 1]  # one batch of both rows
    # The leaving row dropped out after a few steps: the batch ran with one row afterwards.
    assert fake.steps.count(2) < 20 and fake.steps.count(1) > 20
    assert cards[model_name]["batching"]["cancelled"] == 1
    assert cards[model_name]["batching"]["running"] == 0
    assert (f'attnserve_cancelled_rows_total{{model="{model_name}",stage="decoding"}}'
            in exposition)


@pytest.mark.anyio
async def test_a_failure_after_the_stream_started_is_the_last_event(
    make_app: AppFactory,
) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", json={"text": "ab#c", "stream": True})
        fine = await client.post("/v1/summarize", json={"text": "abc", "stream": True,
                                                        "beam_size": 2})
    assert response.status_code == 200
    assert [json.loads(line[6:]) for line in response.text.split("\n\n") if line] == [
        {"error": "inference failed", "error_type": "internal"}]
    events = [json.loads(line[6:]) for line in fine.text.split("\n\n") if line]
    assert [e.get("delta") for e in events] == ["c", "b", "a", ""]
    assert events[-1]["output"] == {"text": "cba", "finish_reason": "eos", "input_tokens": 4,
                                    "output_tokens": 3}


@pytest.mark.anyio
async def test_the_deadline_ends_a_stream_with_an_error_event_and_frees_the_row(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    fake_model.step_delay_s = 0.05  # 26 steps: 1.3 s, over the 0.4 s deadline
    app = make_app(request_timeout_s=0.4)
    async with serving(app) as client:
        response = await client.post("/v1/translate",
                                      json={"text": "abcdefghijklmnopqrstuvwxyz", "stream": True})
        batcher = app.state.registry.resolve("translate", None).batcher
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line]
    *tokens, last = events
    assert last == {"error": "no result within the deadline of 0.4s",
                    "error_type": "deadline_exceeded"}
    assert 0 < len(tokens) < 26
    assert "".join(e["delta"] for e in tokens) == "zyxwvutsrqponmlkjihgfedcba"[:len(tokens)]
    assert batcher.counters.cancelled == 1
    assert max(fake_model.steps[-3:]) == 1 and len(fake_model.steps) < 26
