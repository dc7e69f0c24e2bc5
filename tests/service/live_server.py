"""A real HTTP server for tests that need one (a browser, `tritonclient`, a streamed body):
uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve(app: Any, **options: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port, in a thread; yield its base URL.
    `options` are more `uvicorn.Config` arguments (`http=`: the protocol class)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_until_ready(base_url: str, timeout_s: float = 60) -> None:
    """Poll `/health/ready` until 200 (503 while the models load)."""
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        try:
            with opener.open(base_url + "/health/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError:
            pass  # 503 while loading
        if time.monotonic() > deadline:
            raise RuntimeError("the app did not turn ready")
        time.sleep(0.05)
