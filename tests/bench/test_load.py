"""The load generator (`bench.load`): every request recorded, transport errors named, and an
open loop's lag behind its schedule measured."""

from __future__ import annotations

import asyncio
import socket

from bench.load import TRANSPORT_ERROR, LoadResult, _client, _one, open_loop


async def _answer_or_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that answers `/ok` with 200 and closes any other request unanswered."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.split(b" ")[1] == b"/ok":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")
        await writer.drain()
    writer.close()


def test_a_transport_error_is_recorded_with_its_class_name() -> None:
    async def run() -> LoadResult:
        server = await asyncio.start_server(_answer_or_hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, _client(2, 5.0, keepalive=False) as client:
            ok = await _one(client, "POST", f"http://127.0.0.1:{port}/ok", {}, {}, 0.0)
            failed = await _one(client, "POST", f"http://127.0.0.1:{port}/gone", {}, {}, 0.0)
        return LoadResult(1.0, samples=[ok, failed])

    result = asyncio.run(run())
    assert [s.status for s in result.samples] == [200, TRANSPORT_ERROR]
    assert [s.error for s in result.samples] == ["", "ServerDisconnectedError"]
    summary = result.summary()
    assert summary["lost"] == 1
    assert summary["transport_errors"] == {"ServerDisconnectedError": 1}


def test_an_open_loop_sends_on_schedule_and_names_refused_connections() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1/translate", {}, 100.0, 0.2,
                                   timeout_s=2.0))
    assert len(result.samples) == 20
    assert result.statuses() == {TRANSPORT_ERROR: 20}
    assert result.summary()["transport_errors"] == {"ClientConnectorError": 20}
    sent = sorted(s.sent_s for s in result.samples)
    assert 0.15 <= sent[-1] < 0.19 + result.max_send_lag_s
    assert 0.0 <= result.max_send_lag_s < 0.5
