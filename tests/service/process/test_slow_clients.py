"""Slow, many and careless clients against a real uvicorn server with the service's guards
(`service.process.http.Guards`, on httptools' protocol and on h11's) and middlewares: header and body
read timeouts, the header size limit, the connection cap, the cap on concurrent large
responses, a 10 MB body a plain client can read the 413 of, and the JSON error body for
requests the parser refuses.

Timeouts are short here (a fraction of a second) and every wait polls with a generous bound,
so the tests hold on a slow, loaded machine.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.app import create_app
from service.core.settings import Settings
from service.observability.metrics import REGISTRY
from service.process.http import guarded_protocol
from tests.service.fakes import FakeLoader, FakeModel
from tests.service.live_server import serve, wait_until_ready

READ_BOUND_S = 15  # the most a test waits for the server's answer (its timeouts are far shorter)


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value(
        "attnserve_connections_refused_total", {"reason": reason}) or 0.0


def open_connections() -> float:
    return REGISTRY.get_sample_value("attnserve_open_connections") or 0.0


def poll(condition: Any) -> None:
    deadline = time.monotonic() + READ_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture(params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, models_dir: Path) -> Any:
    """`server(**settings)`: the app over the fake models behind uvicorn with the service's
    guards on httptools' protocol, then on h11's; a context manager of (host, port)."""
    base = HttpToolsProtocol if request.param == "httptools" else H11Protocol

    @contextmanager
    def start(**overrides: Any) -> Iterator[tuple[str, int]]:
        settings = Settings(models_dir=models_dir, batch_workers=1, **overrides)
        app = create_app(settings, loader=FakeLoader(),
                         generator=lambda runtime: FakeModel().generate)
        with serve(app, http=guarded_protocol(settings, base), timeout_keep_alive=30) as url:
            wait_until_ready(url)
            host, port = url.removeprefix("http://").split(":")
            yield host, int(port)

    return start


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded in time)."""
    connection.settimeout(READ_BOUND_S)
    chunks = []
    deadline = time.monotonic() + READ_BOUND_S
    while time.monotonic() < deadline:
        chunk = connection.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    raise AssertionError(f"the server kept the connection open: {b''.join(chunks)[:200]!r}")


def parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of one HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def test_headers_that_never_finish_get_408_and_the_connection_closed(server: Any) -> None:
    before = refused("header_timeout")
    with server(header_timeout_s=0.5) as address:
        started = time.monotonic()
        with socket.create_connection(address) as slow:
            slow.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nContent-Ty")
            raw = read_until_closed(slow)
        waited = time.monotonic() - started
        with socket.create_connection(address) as silent:  # connects, sends nothing
            assert read_until_closed(silent) == b""
    status, headers, body = parse(raw)
    assert status == 408 and headers["connection"] == "close"
    assert body == {"error": "the request headers did not arrive within 0.5s",
                    "error_type": "request_timeout"}
    assert 0.4 <= waited < READ_BOUND_S
    assert refused("header_timeout") == before + 2


def test_the_header_timeout_applies_to_each_request_of_a_kept_alive_connection(
    server: Any,
) -> None:
    request = (b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               b"Content-Length: 15\r\n\r\n{\"text\": \"abc\"}")
    with server(header_timeout_s=1.0) as address, \
            socket.create_connection(address) as connection:
        connection.sendall(request)
        connection.settimeout(READ_BOUND_S)
        first = connection.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and b'"cba"' in first
        connection.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: te")  # then stalls
        status, _, body = parse(read_until_closed(connection))
    assert status == 408 and body["error_type"] == "request_timeout"


@pytest.mark.parametrize(("path", "error_keys"), [
    ("/v1/translate", {"error", "error_type"}), ("/v2/models/translate-en-it/infer", {"error"}),
])
def test_a_body_that_stalls_gets_408_and_the_connection_closed(
    server: Any, path: str, error_keys: set[str]
) -> None:
    before = refused("body_timeout")
    with server(body_timeout_s=0.5) as address, \
            socket.create_connection(address) as slow:
        slow.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n".encode() + b'{"text": "')  # 10 of 100 bytes
        status, headers, body = parse(read_until_closed(slow))
    assert status == 408 and headers["connection"] == "close"
    assert set(body) == error_keys and "did not arrive within 0.5s" in body["error"]
    assert refused("body_timeout") == before + 1


def test_connections_over_the_cap_get_503_and_the_others_are_served(server: Any) -> None:
    before = refused("too_many_connections")
    open_before = open_connections()
    with server(max_connections=3) as address:
        poll(lambda: open_connections() <= open_before)  # the readiness checks' connections closed
        idle = [socket.create_connection(address) for _ in range(3)]
        try:
            poll(lambda: open_connections() >= open_before + 3)  # the gauge counts them
            with socket.create_connection(address) as extra:
                status, _, body = parse(read_until_closed(extra))
        finally:
            for connection in idle:
                connection.close()
        url = f"http://{address[0]}:{address[1]}"
        deadline = time.monotonic() + READ_BOUND_S
        while True:  # the server sees the idle ones close
            try:
                after = httpx.post(f"{url}/v1/translate", json={"text": "abc"}, timeout=10,
                                   trust_env=False)
                if after.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not recover"
            time.sleep(0.05)
    assert status == 503 and body["error_type"] == "overloaded" and "3 open" in body["error"]
    assert refused("too_many_connections") >= before + 1


def test_headers_over_the_size_limit_get_431(server: Any) -> None:
    with server(max_header_bytes=2048) as address, \
            socket.create_connection(address) as connection:
        connection.sendall(b"GET /health/live HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * 4096)
        status, _, body = parse(read_until_closed(connection))
    assert status == 431 and body["error_type"] == "headers_too_large"


@pytest.mark.parametrize("head", [
    b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/translate HTTP/1.1\r\nHost: test\r\nContent-Length: 1, 2\r\n\r\n",
    b"NOT A REQUEST LINE\r\n\r\n",
])
def test_requests_the_parser_refuses_get_the_json_error_body(server: Any, head: bytes) -> None:
    with server() as address, socket.create_connection(address) as connection:
        connection.sendall(head)
        status, headers, body = parse(read_until_closed(connection))
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error_type"] == "bad_request" and body["error"].startswith("malformed HTTP")


def test_a_plain_client_reads_the_413_of_a_10_mb_body(server: Any) -> None:
    """urllib sends the whole body before it reads: the server reads (and drops) it, then
    answers, instead of resetting the connection under it."""
    with server() as (host, port):
        request = urllib.request.Request(
            f"http://{host}:{port}/v1/translate", data=b"{" + b" " * (10 * 1024 * 1024) + b"}",
            headers={"Content-Type": "application/json"}, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as caught:
            opener.open(request, timeout=READ_BOUND_S)
        body = json.load(caught.value)
    assert caught.value.code == 413
    assert body == {"error": "request body larger than 1000000 bytes",
                    "error_type": "payload_too_large"}


def test_concurrent_large_responses_are_capped(server: Any) -> None:
    """A client that trickles its /v1/attention body holds one of the `max_large_responses`
    slots; one more attention request gets 429, other routes do not notice, and the slot comes
    back when that client is cut off."""
    with server(max_large_responses=1, body_timeout_s=2) as (host, port):
        url = f"http://{host}:{port}"
        with socket.create_connection((host, port)) as slow:
            slow.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: test\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
            time.sleep(0.2)  # the server has its headers and waits for the body
            busy = httpx.post(f"{url}/v1/attention", json={"source": "abc"}, timeout=10,
                              trust_env=False)
            other = httpx.post(f"{url}/v1/translate", json={"text": "abc"}, timeout=10,
                               trust_env=False)
            assert parse(read_until_closed(slow))[0] == 408
        deadline = time.monotonic() + READ_BOUND_S
        while (again := httpx.post(f"{url}/v1/attention", json={"source": "abc"}, timeout=10,
                                   trust_env=False)).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["error_type"] == "overloaded"
    assert other.status_code == 200
    assert again.status_code == 422  # past the cap: the fake model has no attention outputs
