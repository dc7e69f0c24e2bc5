"""`attnserve serve` as a real subprocess on a free loopback port: start, drain on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 90  # imports and model loading on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command() -> list[str]:
    """The console script next to this Python (or the module, if it is not installed)."""
    script = Path(sys.executable).with_name("attnserve")
    if script.exists():
        return [str(script)]
    found = shutil.which("attnserve")
    return [found] if found else [sys.executable, "-m", "attnserve.cli"]


@contextmanager
def attnserve_serve(
    models: Path, port: int, *flags: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """Run `attnserve serve`, wait until it answers `/health/live`, stop it at the end."""
    environment = {**os.environ, "ATTNSERVE_PROVIDERS": "CPUExecutionProvider",
                   "ATTNSERVE_THREADS": "1", **(env or {})}
    process = subprocess.Popen(
        [*serve_command(), "serve", "--host", "127.0.0.1", "--port", str(port),
         "--models", str(models), *flags],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _answers(f"http://127.0.0.1:{port}/health/live"):
            if process.poll() is not None:
                pytest.fail(f"attnserve serve exited early:\n{process.stdout.read()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "attnserve serve did not start"
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def wait_ready(port: int, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _answers(f"http://127.0.0.1:{port}/health/ready"):
        assert time.monotonic() < deadline, "attnserve serve did not turn ready"
        time.sleep(0.2)


def test_without_models_live_not_ready_and_sigterm_exits_0(tmp_path: Path) -> None:
    port = free_port()
    with attnserve_serve(tmp_path, port) as process:
        ready = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5)
        assert ready.status_code == 503
        assert ready.json()["error_type"] == "not_ready"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_sigterm_drains_in_flight_requests(
    tiny_model_repository: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    shutil.copytree(tiny_model_repository, models / tiny_model_repository.name)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Batches wait 1.5 s to fill, so the requests are still queued when SIGTERM arrives;
    # the 1 s shutdown delay lets a fresh connection see readiness turn 503.
    flags = ("--max-wait-ms", "1500", "--shutdown-delay-s", "1")
    with attnserve_serve(models, port, *flags) as process:
        wait_ready(port)
        text = "abc de"
        results: list[httpx.Response | BaseException] = []

        def post() -> None:
            try:
                results.append(httpx.post(f"{url}/v1/translate", json={"text": text}, timeout=30))
            except BaseException as error:  # noqa: BLE001 - reported below
                results.append(error)

        threads = [threading.Thread(target=post) for _ in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # the requests are queued, waiting for their batch
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        readiness = httpx.get(f"{url}/health/ready", timeout=5)
        for thread in threads:
            thread.join(timeout=30)
        assert process.wait(timeout=30) == 0
        log = process.stdout.read()  # type: ignore[union-attr]
    assert readiness.status_code == 503, log
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), (
        results, log)
    assert len({r.text for r in results if isinstance(r, httpx.Response)}) == 1
    assert "drained and stopped" in log

