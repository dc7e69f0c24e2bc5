"""The load generator (`bench.load`): every request recorded, transport errors named, and an
open loop's lag behind its schedule measured."""

from __future__ import annotations

import asyncio
import socket

import httpx

from bench.load import TRANSPORT_ERROR, LoadResult, _one, open_loop


def test_a_transport_error_is_recorded_with_its_class_name() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-fail"):
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, json={})

    async def run() -> LoadResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            ok = await _one(client, "POST", "http://test/x", {}, {}, 0.0)
            failed = await _one(client, "POST", "http://test/x", {}, {"x-fail": "1"}, 0.0)
        return LoadResult(1.0, samples=[ok, failed])

    result = asyncio.run(run())
    assert [s.status for s in result.samples] == [200, TRANSPORT_ERROR]
    assert [s.error for s in result.samples] == ["", "ReadTimeout"]
    summary = result.summary()
    assert summary["lost"] == 1
    assert summary["transport_errors"] == {"ReadTimeout": 1}


def test_an_open_loop_sends_on_schedule_and_names_refused_connections() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1/translate", {}, 100.0, 0.2,
                                   timeout_s=2.0))
    assert len(result.samples) == 20
    assert result.statuses() == {TRANSPORT_ERROR: 20}
    assert result.summary()["transport_errors"] == {"ConnectError": 20}
    sent = sorted(s.sent_s for s in result.samples)
    assert 0.15 <= sent[-1] < 0.19 + result.max_send_lag_s
    assert 0.0 <= result.max_send_lag_s < 0.5
