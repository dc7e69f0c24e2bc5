"""Each request's id: `X-Request-ID` taken or made, sent back on every answer (successes, errors,
streams, operational routes), carried by the records logged while the request is handled, and
one access line per request."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from service.api.routes import models as models_route
from service.observability import logs
from tests.service.conftest import AppFactory, serving

pytestmark = pytest.mark.anyio

GENERATED = re.compile(r"[0-9a-f]{32}")


async def test_a_request_without_an_id_gets_a_new_one_each_time(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        first = await client.post("/v1/translate", json={"text": "abc"})
        second = await client.post("/v1/translate", json={"text": "abc"})
    assert first.status_code == second.status_code == 200
    assert GENERATED.fullmatch(first.headers["x-request-id"])
    assert GENERATED.fullmatch(second.headers["x-request-id"])
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/translate", {"text": "abc"}, 200),
    ("POST", "/v1/translate", {"text": ""}, 422),
    ("POST", "/v1/translate", {"text": "abc", "model": "nope"}, 404),
    ("POST", "/v2/models/translate-en-it/infer",
     {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["abc"]}]}, 200),
    ("GET", "/health/ready", None, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/no/such/route", None, 404),
])
async def test_the_given_id_comes_back_on_every_answer(make_app: AppFactory, method: str, path: str,
                                                       body: object, status: int) -> None:
    async with serving(make_app()) as client:
        response = await client.request(method, path, json=body, headers={"X-Request-ID": "req-42.a:b/c"})
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"] == "req-42.a:b/c"


async def test_a_streamed_answer_carries_the_id(make_app: AppFactory) -> None:
    async with serving(make_app()) as client, client.stream(
            "POST", "/v1/translate", json={"text": "abc", "stream": True},
            headers={"X-Request-ID": "stream-1"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"] == "stream-1"
        await response.aread()


@pytest.mark.parametrize("given", ["x" * 129, "with space", "tab\there", "caf\u00e9"])
async def test_an_unusable_id_is_replaced_not_refused(make_app: AppFactory, given: str) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", json={"text": "abc"},
                                     headers={"X-Request-ID": given.encode("utf-8")})
    assert response.status_code == 200
    assert GENERATED.fullmatch(response.headers["x-request-id"])


async def test_each_request_logs_one_access_line_with_its_id(make_app: AppFactory,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=logs.ACCESS.name)
    async with serving(make_app()) as client:
        caplog.clear()
        ok = await client.post("/v1/translate", json={"text": "abc"}, headers={"X-Request-ID": "one"})
        bad = await client.post("/v1/translate", json={"text": ""}, headers={"X-Request-ID": "two"})
    assert (ok.status_code, bad.status_code) == (200, 422)
    lines = [r for r in caplog.records if r.name == logs.ACCESS.name]
    assert [(r.request_id, r.method, r.path, r.status) for r in lines] == [  # type: ignore[attr-defined]
        ("one", "POST", "/v1/translate", 200), ("two", "POST", "/v1/translate", 422)]
    assert lines[0].model == "translate-en-it"  # type: ignore[attr-defined]
    assert all(r.duration_ms >= 0 for r in lines)  # type: ignore[attr-defined]
    assert lines[0].getMessage().startswith("POST /v1/translate 200 ")
    assert lines[0].getMessage().endswith("request_id=one")


async def test_no_access_line_with_the_access_log_off(make_app: AppFactory,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=logs.ACCESS.name)
    async with serving(make_app(access_log=False)) as client:
        response = await client.post("/v1/translate", json={"text": "abc"})
    assert response.status_code == 200 and response.headers["x-request-id"]
    assert not [r for r in caplog.records if r.name == logs.ACCESS.name]


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_an_error_logged_by_a_route_names_the_request(make_app: AppFactory, log_format: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(access_log=False)

    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    written = io.StringIO()
    handler = logs.make_handler(log_format, written)
    logging.getLogger().addHandler(handler)
    try:
        async with serving(app) as client:
            monkeypatch.setattr(models_route, "_card", bug)  # /v1/models fails unexpectedly
            response = await client.get("/v1/models", headers={"X-Request-ID": "bug-7"})
    finally:
        logging.getLogger().removeHandler(handler)
    assert response.status_code == 500 and response.headers["x-request-id"] == "bug-7"
    assert "a bug" not in response.text  # no trace to the client
    [line] = [line for line in written.getvalue().splitlines() if "unhandled error" in line]
    if log_format == "json":
        entry = json.loads(line)
        assert entry["request_id"] == "bug-7" and entry["level"] == "ERROR"
        assert "RuntimeError: a bug" in entry["exception"]
    else:
        assert line.endswith("ERROR service.api.errors: unhandled error on GET /v1/models request_id=bug-7")
        assert "RuntimeError: a bug" in written.getvalue()
