"""The HTTP API over fake models: bodies, status codes, the error body, batching, overload."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.service.conftest import AppFactory, serving, wait_until_settled
from tests.service.fakes import FakeLoader, FakeModel

pytestmark = pytest.mark.anyio


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `condition` until it holds (fails after `timeout_s`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def assert_error(response: Any, status: int, error_type: str) -> dict[str, str]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}
    assert body["error_type"] == error_type
    return body


async def test_translate_one_text(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", json={"text": "hello world"})
    assert response.status_code == 200
    assert response.json() == {
        "model": "translate-en-it",
        "outputs": [
            {"text": "dlrow olleh", "finish_reason": "eos", "input_tokens": 12,
             "output_tokens": 11},
        ],
        "usage": {"input_tokens": 12, "output_tokens": 11},
    }


async def test_summarize_a_list_with_options(make_app: AppFactory) -> None:
    body = {"texts": ["abc", "hello"], "model": "summarize-en", "beam_size": 4,
            "max_new_tokens": 3}
    async with serving(make_app()) as client:
        response = await client.post("/v1/summarize", json=body)
    assert response.status_code == 200
    out = response.json()
    assert out["model"] == "summarize-en"
    assert [(o["text"], o["finish_reason"]) for o in out["outputs"]] == [
        ("cba", "length"), ("oll", "length"),
    ]
    assert out["usage"] == {"input_tokens": 10, "output_tokens": 6}


async def test_models_health_and_metrics(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        assert (await client.get("/health/live")).json()["status"] == "live"
        ready = (await client.get("/health/ready")).json()
        assert ready == {"status": "ready",
                         "models": {"summarize-en": True, "translate-en-it": True}}
        await client.post("/v1/translate", json={"text": "abc"})
        await client.get("/no/such/path/123")
        cards = {c["name"]: c for c in (await client.get("/v1/models")).json()["models"]}
        exposition = (await client.get("/metrics")).text
    assert cards["translate-en-it"]["provider"] == "CPUExecutionProvider"
    assert cards["translate-en-it"]["task"] == "translate"
    assert cards["translate-en-it"]["batching"]["rows"] >= 1
    assert cards["translate-en-it"]["batching"]["processes"] == 1
    assert ('attnserve_requests_total{model="translate-en-it",route="/v1/translate",'
            'status="2xx"}') in exposition
    assert 'route="unmatched"' in exposition
    assert "/no/such/path" not in exposition
    assert 'attnserve_model_info{model="summarize-en",provider="CPUExecutionProvider",' \
           'task="summarize",variant="fp32"} 1.0' in exposition


LONG = "a" * 65  # 65 tokens: over the fake model's 63 (64 with EOS)


@pytest.mark.parametrize(
    ("route", "body", "status", "error_type"),
    [
        ("/v1/translate", {"text": ""}, 422, "invalid_input"),
        ("/v1/translate", {"text": "   "}, 422, "invalid_input"),
        ("/v1/translate", {"texts": []}, 422, "invalid_input"),
        ("/v1/translate", {"texts": ["ok", ""]}, 422, "invalid_input"),
        ("/v1/translate", {"text": "x" * 2001}, 422, "invalid_input"),
        ("/v1/translate", {"text": LONG}, 422, "invalid_input"),
        ("/v1/translate", {"texts": ["a"] * 17}, 422, "invalid_input"),
        ("/v1/translate", {"text": 5}, 422, "invalid_input"),
        ("/v1/translate", {"texts": "abc"}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "beam_size": "2"}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "beam_size": 0}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "beam_size": 9}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "max_new_tokens": 0}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "max_new_tokens": 65}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "texts": ["abc"]}, 422, "invalid_input"),
        ("/v1/translate", {}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "temperature": 1, "beam_size": 2}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "top_p": 0.9}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "seed": 1}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "temperature": -1}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "temperature": 1, "top_p": 1.5}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "temperature": 1, "top_k": 0}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "temperature": 1, "seed": -1}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "temperature": "1"}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "repetition_penalty": 1}, 422, "invalid_input"),
        ("/v1/translate", {"texts": ["abc"], "stream": True}, 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "stream": True, "return_attention": True}, 422,
         "invalid_input"),
        ("/v1/translate", {"text": "abc", "stream": "yes"}, 422, "invalid_input"),
        ("/v1/translate", ["abc"], 422, "invalid_input"),
        ("/v1/translate", {"text": "abc", "model": "nope"}, 404, "model_not_found"),
        ("/v1/translate", {"text": "abc", "model": "summarize-en"}, 404, "model_not_found"),
        ("/v1/nope", {"text": "abc"}, 404, "not_found"),
    ],
)
async def test_bad_requests_get_the_error_body(
    make_app: AppFactory, route: str, body: Any, status: int, error_type: str
) -> None:
    async with serving(make_app()) as client:
        response = await client.post(route, json=body)
    assert_error(response, status, error_type)


async def test_errors_never_echo_the_input(make_app: AppFactory) -> None:
    secret = "zq" * 1500
    async with serving(make_app()) as client:
        too_long = await client.post("/v1/translate", json={"text": secret})
        wrong = await client.post("/v1/translate", json={"text": [secret], "beam_size": secret})
    for response in (too_long, wrong):
        body = assert_error(response, 422, "invalid_input")
        assert "zqzq" not in body["error"] and len(body["error"]) < 500


async def test_invalid_json_and_large_bodies(make_app: AppFactory) -> None:
    async with serving(make_app(max_body_bytes=2048)) as client:
        broken = await client.post("/v1/translate", content=b'{"text": "abc"',
                                   headers={"content-type": "application/json"})
        large = await client.post("/v1/translate", json={"text": "a" * 3000})

        async def chunks() -> Any:
            for _ in range(4):
                yield b" " * 1000

        streamed = await client.post("/v1/translate", content=chunks(),
                                     headers={"content-type": "application/json"})
        assert (await client.post("/v1/translate", json={"text": "abc"})).status_code == 200
    assert_error(broken, 422, "invalid_input")
    assert_error(large, 413, "payload_too_large")
    assert_error(streamed, 413, "payload_too_large")


async def test_64_concurrent_requests_are_batched(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    fake_model.delay_s = 0.01
    texts = [f"text number {'x' * (i % 7)} {chr(97 + i % 26) * (1 + i // 26)}" for i in range(64)]
    async with serving(make_app(max_wait_ms=20)) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/translate", json={"text": t}) for t in texts)
        )
        card = next(c for c in (await client.get("/v1/models")).json()["models"]
                    if c["name"] == "translate-en-it")
    assert all(r.status_code == 200 for r in responses)
    assert [r.json()["outputs"][0]["text"] for r in responses] == [t.strip()[::-1] for t in texts]
    batching = card["batching"]
    assert batching["rows"] >= 64
    assert batching["max_batch_rows"] > 1
    assert batching["batches"] < 64


async def test_same_output_alone_and_in_a_mixed_batch(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    body = {"text": "the same request", "max_new_tokens": 10}
    async with serving(make_app(max_wait_ms=30)) as client:
        alone = (await client.post("/v1/translate", json=body)).json()
        others = [{"texts": ["a", "much longer input text"], "max_new_tokens": 10},
                  {"text": "short", "max_new_tokens": 10}]
        responses = await asyncio.gather(
            *(client.post("/v1/translate", json=b) for b in [*others, body, *others])
        )
    assert responses[2].json() == alone
    assert max(len(b) for b in fake_model.batches) >= 4


async def test_a_full_queue_answers_429_with_retry_after(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    app = make_app(max_queue_size=2, max_texts=2, max_batch_size=1, retry_after_s=2)
    async with serving(app) as client:
        fake_model.gate = threading.Event()  # the first batch holds the worker until the gate opens
        started = len(fake_model.batches)
        running = asyncio.ensure_future(client.post("/v1/translate", json={"text": "first"}))
        await _until(lambda: len(fake_model.batches) > started)  # first is in the worker, the queue is empty
        queued = asyncio.ensure_future(
            client.post("/v1/translate", json={"texts": ["second", "third"]}))
        full = 'attnserve_queue_depth{model="translate-en-it"} 2.0'
        for _ in range(2000):  # second and third fill the queue
            if full in (await client.get("/metrics")).text:
                break
            await asyncio.sleep(0.005)
        refused = await client.post("/v1/translate", json={"text": "fourth"})
        exposition = (await client.get("/metrics")).text
        fake_model.gate.set()
        assert (await running).status_code == 200
        assert (await queued).status_code == 200
    assert_error(refused, 429, "overloaded")
    assert refused.headers["retry-after"] == "2"
    assert "server-timing" not in refused.headers  # refused: it went through no stage
    assert 'attnserve_rejected_total{model="translate-en-it",reason="queue_full"}' in exposition


async def test_a_failing_batch_gives_500_and_the_server_goes_on(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        failed = await client.post("/v1/translate", json={"text": "a # b"})
        after = await client.post("/v1/translate", json={"text": "abc"})
    body = assert_error(failed, 500, "internal")
    assert "Traceback" not in body["error"] and "boom" not in body["error"]
    assert after.status_code == 200


async def test_an_unexpected_error_gives_the_fixed_500_body(make_app: AppFactory) -> None:
    loader = FakeLoader()
    async with serving(make_app(loader=loader)) as client:
        registry = client._transport.app.state.registry  # type: ignore[attr-defined]
        runtime = registry.resolve("translate", None).runtime

        def broken(texts: Any) -> Any:
            raise KeyError("secret detail")

        runtime.tokenizer.encode_batch = broken
        response = await client.post("/v1/translate", json={"text": "abc"})
    assert response.json() == {"error": "internal error", "error_type": "internal"}
    assert response.status_code == 500


async def test_deadline_exceeded_gives_504(make_app: AppFactory, fake_model: FakeModel) -> None:
    async with serving(make_app(request_timeout_s=0.2)) as client:
        fake_model.delay_s = 0.5
        response = await client.post("/v1/translate", json={"text": "slow"})
        fake_model.delay_s = 0
    assert_error(response, 504, "deadline_exceeded")


async def test_not_ready_while_loading_then_ready(make_app: AppFactory) -> None:
    loader = FakeLoader()
    loader.release.clear()
    async with serving(make_app(loader=loader), wait_ready=False) as client:
        assert (await client.get("/health/live")).status_code == 200
        assert_error(await client.get("/health/ready"), 503, "not_ready")
        assert_error(await client.post("/v1/translate", json={"text": "a"}), 503, "not_ready")
        states = {c["state"] for c in (await client.get("/v1/models")).json()["models"]}
        assert states == {"loading"}
        loader.release.set()
        for _ in range(500):
            if (await client.get("/health/ready")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert (await client.post("/v1/translate", json={"text": "a"})).status_code == 200


async def test_one_of_several_worker_processes_starts_only_once_its_models_are_loaded(make_app: AppFactory) -> None:
    """With `workers` > 1 the lifespan's startup waits for the models (uvicorn accepts on the
    shared socket only after it): a restarted worker never answers 503 while the others serve."""
    loader = FakeLoader()
    loader.release.clear()
    entered = asyncio.Event()

    async def serve() -> int:
        async with serving(make_app(loader=loader, workers=2), wait_ready=False) as client:
            entered.set()
            return (await client.get("/health/ready")).status_code

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0.3)
    assert not entered.is_set()  # still in the startup: no request could reach it
    loader.release.set()
    assert await asyncio.wait_for(task, 10) == 200  # ready at the first request


async def test_a_model_that_fails_to_load_leaves_the_server_live_not_ready(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(loader=FakeLoader(failing=["summarize-en"]))
    async with serving(app, wait_ready=False) as client:
        cards = await wait_until_settled(client)
        assert (await client.get("/health/live")).status_code == 200
        ready = assert_error(await client.get("/health/ready"), 503, "not_ready")
        failed = await client.post("/v1/summarize", json={"text": "a"})
        served = await client.post("/v1/translate", json={"text": "a"})
    assert "summarize-en (failed)" in ready["error"]
    assert cards["summarize-en"]["state"] == "failed"
    assert "sha256 mismatch" in cards["summarize-en"]["error"]
    assert_error(failed, 503, "not_ready")
    assert served.status_code == 200
    assert "model summarize-en failed to load" in caplog.text


async def test_no_models_folder_is_live_not_ready(make_app: AppFactory, tmp_path: Any) -> None:
    async with serving(make_app(models_dir=tmp_path / "missing"), wait_ready=False) as client:
        assert (await client.get("/health/live")).status_code == 200
        body = assert_error(await client.get("/health/ready"), 503, "not_ready")
    assert "no models found" in body["error"]


async def test_draining_turns_readiness_503_and_in_flight_work_finishes(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    fake_model.delay_s = 0.2
    app = make_app()
    async with serving(app) as client:
        in_flight = asyncio.ensure_future(client.post("/v1/translate", json={"text": "abc"}))
        await asyncio.sleep(0.05)
        app.state.registry.begin_draining()
        assert_error(await client.get("/health/ready"), 503, "not_ready")
        assert (await client.get("/health/live")).status_code == 200
        late = await client.post("/v1/translate", json={"text": "late"})
        assert (await in_flight).status_code == 200
        assert late.status_code == 200  # still served until the batchers close
        await app.state.registry.close(5)
        closed = await client.post("/v1/translate", json={"text": "a"})
    assert_error(closed, 503, "not_ready")


@pytest.mark.parametrize(("provider", "rows"), [("CPUExecutionProvider", 64), ("CUDAExecutionProvider", 256)])
async def test_a_batch_holds_the_providers_default_rows(make_app: AppFactory, fake_model: FakeModel,
                                                        provider: str, rows: int) -> None:
    """Unset, `max_batch_size` is the model's provider's default (`BATCH_ROWS`): 300 requests
    queued behind a held batch go out in batches of at most that many rows, the first full."""
    app = make_app(loader=FakeLoader(provider=provider), max_queue_size=400)
    async with serving(app) as client:
        fake_model.gate = threading.Event()
        started = len(fake_model.batches)
        first = asyncio.ensure_future(client.post("/v1/translate", json={"text": "first"}))
        await _until(lambda: len(fake_model.batches) > started)  # the worker holds one row
        queued = [asyncio.ensure_future(client.post("/v1/translate", json={"text": "row"})) for _ in range(300)]
        full = 'attnserve_queue_depth{model="translate-en-it"} 300.0'
        for _ in range(2000):
            if full in (await client.get("/metrics")).text:
                break
            await asyncio.sleep(0.005)
        fake_model.gate.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(first, *queued))
    sizes = [len(b) for b in fake_model.batches[started + 1:]]
    assert sum(sizes) == 300 and sizes[0] == rows == max(sizes)


async def test_an_answer_carries_its_stage_times_in_server_timing(make_app: AppFactory,
                                                                  fake_model: FakeModel) -> None:
    fake_model.delay_s = 0.03
    async with serving(make_app()) as client:
        response = await client.post("/v1/summarize", json={"texts": ["abc", "hello"]})
    assert response.status_code == 200
    metrics = [part.strip().split(";") for part in response.headers["server-timing"].split(",")]
    names = [name for name, _ in metrics]
    assert names[0] == "prepare" and names[-1] == "total" and "queue" in names and "inference" in names
    durations = {name: float(dur.removeprefix("dur=")) for name, dur in metrics}
    assert durations["inference"] >= 30  # the fake model's batch
    assert durations["total"] >= durations["inference"] + durations["prepare"]
