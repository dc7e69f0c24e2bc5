"""The load generator (`bench.load`): every request recorded, transport errors named, an open
loop's lag behind its schedule measured, its arrivals Poisson, its bodies cycled, and the
benchmark's figures from the samples."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from bench.load import (
    TRANSPORT_ERROR,
    LoadResult,
    Sample,
    arrival_times,
    client,
    closed_loop,
    open_loop,
    parse_server_timing,
    request,
    text_bodies,
)


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
        async with server, client(2, 5.0, keepalive=False) as session:
            ok = await request(session, f"http://127.0.0.1:{port}/ok", {}, 0.0, method="GET")
            failed = await request(session, f"http://127.0.0.1:{port}/gone", {}, 0.0)
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
    result = asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1/translate", [{}], 100.0, 0.2,
                                   poisson=False, timeout_s=2.0))
    assert len(result.samples) == 20
    assert result.statuses() == {TRANSPORT_ERROR: 20}
    assert result.summary()["transport_errors"] == {"ClientConnectorError": 20}
    sent = sorted(s.sent_s for s in result.samples)
    assert 0.15 <= sent[-1] <= 0.19 + result.max_send_lag_s + 1e-9
    assert 0.0 <= result.max_send_lag_s <= result.elapsed_s  # a lag within the run, however loaded the machine


def test_arrival_times_are_poisson_at_the_rate() -> None:
    offsets = arrival_times(rate=50.0, count=2000, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert 2000 / offsets[-1] == pytest.approx(50.0, rel=0.1)
    assert arrival_times(50.0, 10, seed=1) == offsets[:10]
    with pytest.raises(ValueError):
        arrival_times(0.0, 3)


async def _translate_server(received: list[str]) -> tuple[web.AppRunner, int]:
    """An aiohttp server whose /v1/translate reports one output token per character (and an
    inference of a millisecond per character in its `Server-Timing`), and answers 500 to the
    text "fail" and a body without outputs to "bare"."""

    async def translate(req: web.Request) -> web.Response:
        text = (await req.json())["text"]
        received.append(text)
        if text == "fail":
            return web.json_response({"error": "boom"}, status=500)
        if text == "bare":
            return web.json_response({})
        return web.json_response({"outputs": [{"output_tokens": len(text)}]}, headers={
            "Server-Timing": f'prepare;dur=0.5, cache;desc="hit", inference;dur={len(text)};desc="x"'})

    app = web.Application()
    app.router.add_post("/v1/translate", translate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


def test_an_open_loop_slice_cycles_the_bodies_from_first() -> None:
    received: list[str] = []

    async def run() -> LoadResult:
        runner, port = await _translate_server(received)
        try:  # 4 requests (200/s for 0.02 s), texts from the third on
            return await open_loop(f"http://127.0.0.1:{port}/v1/translate",
                                   text_bodies(["a", "bb", "ccc"]), 200.0, 0.02, first=2)
        finally:
            await runner.cleanup()

    result = asyncio.run(run())
    assert sorted(received) == ["a", "bb", "ccc", "ccc"]
    assert len(result.latencies_s) == 4 and result.output_tokens == 1 + 2 + 3 + 3 and result.errors == 0


def test_a_closed_loop_counts_http_errors_and_answers_without_outputs() -> None:
    received: list[str] = []

    async def run() -> LoadResult:
        runner, port = await _translate_server(received)
        try:
            return await closed_loop(f"http://127.0.0.1:{port}/v1/translate",
                                     text_bodies(["ab", "fail", "bare", "c"]), 2)
        finally:
            await runner.cleanup()

    result = asyncio.run(run())
    assert sorted(received) == ["ab", "bare", "c", "fail"]  # each body once
    assert result.errors == 2 and result.output_tokens == 3 and len(result.latencies_s) == 2
    assert result.statuses() == {200: 3, 500: 1}
    assert sorted(e.split(":")[0] for e in result.error_samples) == ["HTTP 500", "a response without outputs"]
    assert result.summary()["transport_errors"] == {}  # HTTP errors are not lost requests
    timing = result.summary()["server_timing_p50_ms"]  # over "ab" and "c"; a metric without dur left out
    assert set(timing) == {"prepare", "inference", "client"}
    assert timing["prepare"] == 0.5 and timing["inference"] == 1.5 and timing["client"] > 0


def test_a_stage_quantile_is_over_the_answered_requests_that_report_it() -> None:
    timed = [Sample(0.0, 200, ms / 1000, server_timing=(("queue", ms / 10), ("total", float(ms)))) for ms in range(1, 21)]
    result = LoadResult(samples=[*timed, Sample(0.0, 500, 9.0, "HTTP 500", server_timing=(("total", 999.0),)),
                                 Sample(0.0, 200, 5.0)])  # an error and an answer without the header: left out
    assert result.server_timing_ms() == {"queue": 1.05, "total": 10.5, "client": 10.5}
    assert result.server_timing_ms(0.95) == {"queue": 1.9, "total": 19.0, "client": 19.0}


def test_server_timing_values_are_read_leniently() -> None:
    assert parse_server_timing("") == ()
    assert parse_server_timing('a;dur=1.25, b;desc="no dur", c;dur="2", d;dur=x, ;dur=3') == (
        ("a", 1.25), ("c", 2.0))


def test_merged_load_results_pool_requests_and_time() -> None:
    first = LoadResult(elapsed_s=2.0, samples=[Sample(0.0, 200, 0.1, output_tokens=4),
                                               Sample(0.1, 200, 0.2, output_tokens=6),
                                               Sample(0.2, 500, 0.01, "HTTP 500")])
    second = LoadResult(elapsed_s=1.0, samples=[Sample(0.0, 200, 0.3, output_tokens=5)])
    first.merge(second)
    assert first.latencies_s == [0.1, 0.2, 0.3] and first.output_tokens == 15 and first.errors == 1
    stats = first.stats()
    assert stats.sentences_per_s == pytest.approx(1.0)  # 3 answered in 3 s of slices
    assert first.error_samples == ["HTTP 500"]


def test_the_command_sends_each_line_of_a_texts_file_as_a_body(tmp_path, monkeypatch, capsys) -> None:
    import bench.load as load_module

    texts = tmp_path / "test.src"
    texts.write_text("first sentence\n\nsecond one\n", encoding="utf-8")
    sent: list = []

    async def fake_closed_loop(url, bodies, concurrency, duration_s, **options) -> LoadResult:
        sent.extend(bodies)
        return LoadResult(duration_s)

    monkeypatch.setattr(load_module, "closed_loop", fake_closed_loop)
    assert load_module.main(["--url", "http://x/v1/translate", "--concurrency", "2", "--texts", str(texts)]) == 0
    assert sent == [{"text": "first sentence"}, {"text": "second one"}]
    assert '"requests": 0' in capsys.readouterr().out
