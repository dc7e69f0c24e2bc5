"""A request every model would refuse, against a real uvicorn server with the service's
protocol: answered 429 from its headers alone, its body discarded, the connection kept for the
next request; on httptools' protocol without starting the app (`service.process.http`), on
h11's by the app's `ShedMiddleware` (`service.api.shed`).

A gated fake model holds the only batch worker while the queue of one row is filled, so every
model of the task is out of reach however slow the machine is.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.app import create_app
from service.api.shed import Shedder
from service.core.settings import Settings
from service.observability import logs
from service.observability.metrics import REGISTRY
from service.process.http import guarded_protocol
from tests.service.fakes import FakeLoader, FakeModel
from tests.service.live_server import serve, wait_until_ready

MODEL = "translate-en-it"
BOUND_S = 15.0  # the most a test waits for an answer


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def request(path: str, body: bytes = b"", length: int | None = None, method: str = "POST",
            headers: bytes = b"") -> bytes:
    """One HTTP/1.1 request; `length` overrides the Content-Length (a body still to come);
    `headers`, more header lines."""
    length = len(body) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + headers + b"\r\n" + body


# bytes read past a response, per socket (answers to pipelined requests)
_LEFTOVER: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def read_response(connection: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the next response on `connection` (Content-Length framed)."""
    connection.settimeout(BOUND_S)
    data = _LEFTOVER.pop(connection, b"")
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = connection.recv(65536)
        assert chunk, "closed in the middle of a body"
        body += chunk
    _LEFTOVER[connection] = body[length:]
    return int(lines[0].split()[1]), headers, body[:length]


class CountingApp:
    """The app, counting the requests it was started for, by path."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.started: dict[str, int] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.started[scope["path"]] = self.started.get(scope["path"], 0) + 1
        await self.app(scope, receive, send)


@contextmanager
def overloaded_server(models_dir: Path, base: type[Any], headers: bytes = b"",
                      **overrides: Any) -> Iterator[tuple[tuple[str, int], CountingApp]]:
    """A server whose one translation worker is held and whose queue of one row is full (its
    two requests sent with `headers`)."""
    model = FakeModel()
    settings = Settings(models_dir=models_dir, batch_workers=1, max_queue_size=1, max_batch_size=1,
                        max_texts=1, max_header_bytes=2048, header_timeout_s=5, **overrides)
    app = CountingApp(create_app(settings, loader=FakeLoader(), generator=lambda runtime: model.generate))
    with serve(app, http=guarded_protocol(settings, base), timeout_keep_alive=30) as url:
        wait_until_ready(url)
        model.gate = threading.Event()  # closed: the next batch holds the worker
        host, port = url.removeprefix("http://").split(":")
        address = (host, int(port))
        held = [socket.create_connection(address) for _ in range(2)]
        try:
            held[0].sendall(request("/v1/translate", b'{"text": "held"}', headers=headers))
            deadline = time.monotonic() + BOUND_S
            while "held" not in model.seen:
                assert time.monotonic() < deadline, "the first request never reached the model"
                time.sleep(0.01)
            held[1].sendall(request("/v1/translate", b'{"text": "queued"}', headers=headers))
            while sample("attnserve_queue_depth", model=MODEL) < 1:
                assert time.monotonic() < deadline, "the second request was never queued"
                time.sleep(0.01)
            yield address, app
            assert model.gate is not None
            model.gate.set()
            assert [read_response(c)[0] for c in held] == [200, 200]
        finally:
            for connection in held:
                connection.close()


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_a_request_out_of_reach_is_refused_from_its_headers(models_dir: Path, base: type[Any]) -> None:
    refused = sample("attnserve_rejected_total", model=MODEL, reason="queue_full")
    answered = sample("attnserve_requests_total", route="/v1/translate", model=MODEL, status="4xx")
    with overloaded_server(models_dir, base) as (address, app), \
            socket.create_connection(address) as connection:
        # the headers and 10 of 100 body bytes: the answer does not wait for the rest
        connection.sendall(request("/v1/translate", b'{"text": "', length=100))
        status, headers, body = read_response(connection)
        started = app.started.get("/v1/translate", 0)
    assert status == 429 and headers["retry-after"] == "1"
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error_type"] == "overloaded"
    assert "queue is full" in json.loads(body)["error"]
    assert sample("attnserve_rejected_total", model=MODEL, reason="queue_full") == refused + 1
    # counted under its route (not "unmatched"), the same by either path
    assert sample("attnserve_requests_total", route="/v1/translate", model=MODEL,
                  status="4xx") == answered + 1
    # httptools: the app never started for it; h11: the app's middleware refused it
    assert started == (2 if base is HttpToolsProtocol else 3)


@pytest.mark.parametrize("whole", [True, False], ids=["in-one-piece", "body-later"])
def test_after_a_refusal_in_the_parser_the_connection_serves_the_next_request(
    models_dir: Path, whole: bool,
) -> None:
    body = json.dumps({"text": "x" * 5000}).encode()  # longer than max_header_bytes (2048)
    with overloaded_server(models_dir, HttpToolsProtocol) as (address, _app), \
            socket.create_connection(address) as connection:
        if whole:
            connection.sendall(request("/v1/translate", body))
            first = read_response(connection)
        else:
            connection.sendall(request("/v1/translate", body[:10], length=len(body)))
            first = read_response(connection)
            for start in range(10, len(body), 1000):  # the rest, in pieces
                connection.sendall(body[start:start + 1000])
                time.sleep(0.01)
        connection.sendall(request("/health/live", method="GET"))
        second = read_response(connection)
        connection.sendall(request("/v1/summarize", b"{not json"))  # a summarizer is free
        third = read_response(connection)
    assert first[0] == 429 and "connection" not in first[1]
    assert second[0] == 200
    assert third[0] == 422  # reached the route, which parsed this body, not the shed one's


def test_a_request_waiting_for_100_continue_is_refused_and_closed(models_dir: Path) -> None:
    with overloaded_server(models_dir, HttpToolsProtocol) as (address, _app), \
            socket.create_connection(address) as connection:
        connection.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nContent-Type: "
                           b"application/json\r\nExpect: 100-continue\r\nContent-Length: 20\r\n\r\n")
        status, headers, _ = read_response(connection)
        connection.settimeout(BOUND_S)
        assert connection.recv(1024) == b""  # closed: the body it held back is never misread
    assert status == 429 and headers["connection"] == "close"


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_with_an_api_key_only_an_authorized_request_is_shed(models_dir: Path, base: type[Any]) -> None:
    token = b"Authorization: Bearer sesame\r\n"
    with overloaded_server(models_dir, base, headers=token, api_key="sesame") as (address, _app), \
            socket.create_connection(address) as connection:
        connection.sendall(request("/v1/translate", b'{"text": "a"}'))
        anonymous = read_response(connection)
        connection.sendall(request("/v1/translate", b'{"text": "a"}', headers=token))
        authorized = read_response(connection)
    assert anonymous[0] == 401 and json.loads(anonymous[2])["error_type"] == "unauthorized"
    assert authorized[0] == 429


def test_a_pipelined_request_shed_after_the_one_before_keeps_the_header_size_limit(
    models_dir: Path,
) -> None:
    with overloaded_server(models_dir, HttpToolsProtocol) as (address, _app), \
            socket.create_connection(address) as connection:
        # two requests in one piece: the second waits (pipelined) while the route answers the
        # first, and is shed when its turn comes, its body read already
        connection.sendall(request("/v1/summarize", b"{not json") +
                           request("/v1/translate", b'{"text": "a"}'))
        statuses = [read_response(connection)[0] for _ in range(2)]
        # then headers over max_header_bytes (2048), never finished
        connection.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * 3000)
        status, _, body = read_response(connection)
    assert statuses == [422, 429]
    assert status == 431 and json.loads(body)["error_type"] == "headers_too_large"


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_a_request_let_through_is_decided_once(models_dir: Path, base: type[Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    decided: list[str] = []
    refusal = Shedder.refusal

    def counting(self: Shedder, scope: Any) -> Any:
        decided.append(scope["path"])
        return refusal(self, scope)

    monkeypatch.setattr(Shedder, "refusal", counting)
    settings = Settings(models_dir=models_dir)
    app = create_app(settings, loader=FakeLoader(), generator=lambda runtime: FakeModel().generate)
    with serve(app, http=guarded_protocol(settings, base)) as url:
        wait_until_ready(url)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as connection:
            connection.sendall(request("/v1/translate", b'{"text": "hello"}'))
            status, _, _ = read_response(connection)
    # the protocol (httptools) or the middleware (h11) decides; never both
    assert status == 200 and decided.count("/v1/translate") == 1


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_a_shed_request_carries_its_id_and_its_access_line(models_dir: Path, base: type[Any],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=logs.ACCESS.name)
    with overloaded_server(models_dir, base) as (address, _), socket.create_connection(address) as connection:
        caplog.clear()
        connection.sendall(request("/v1/translate", b'{"text": "x"}', headers=b"X-Request-ID: shed-1\r\n"))
        status, headers, _ = read_response(connection)
        deadline = time.monotonic() + BOUND_S  # the line is written right after the answer
        while not (lines := [r for r in caplog.records if r.name == logs.ACCESS.name]):
            assert time.monotonic() < deadline, "no access line"
            time.sleep(0.01)
    assert status == 429 and headers["x-request-id"] == "shed-1"
    # the parser's answer (httptools) and the app's middleware (h11) log it alike
    assert [(r.request_id, r.path, r.status, r.model) for r in lines] == [  # type: ignore[attr-defined]
        ("shed-1", "/v1/translate", 429, MODEL)]
