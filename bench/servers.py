"""Start a server as a subprocess on a free loopback port, wait until it is ready, stop it.

`attnserve serve` (each batching mode) and the naive PyTorch server run this way, so each one's
memory is its own process's and the load generator shares no interpreter with it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import httpx

from bench.rss import PeakRss

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# The service's batching modes: extra `attnserve serve` flags of each.
SERVICE_MODES: dict[str, list[str]] = {
    "continuous": [],  # the default: greedy rows join the running batch between decoder steps
    "dynamic": ["--no-continuous-batching"],  # request-level batches only
    "batching_off": ["--no-continuous-batching", "--max-batch-size", "1", "--max-wait-ms", "0"],
}


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def service_command(models_dir: Path, port: int, mode: str = "continuous", threads: int = 0,
                    providers: Sequence[str] = ("CPUExecutionProvider",), max_queue_size: int = 2048) -> list[str]:
    """The `attnserve serve` command line in one of `SERVICE_MODES` (batching off = one row per
    batch, no wait)."""
    command = [sys.executable, "-m", "attnserve.cli", "--log-level", "WARNING", "serve",
               "--models", str(models_dir), "--host", HOST, "--port", str(port),
               "--providers", ",".join(providers), "--threads", str(threads),
               "--max-queue-size", str(max_queue_size)]
    return command + SERVICE_MODES[mode]


def service_process(models_dir: Path, log_path: Path, flags: Sequence[str] = (),
                    checkout: Path | None = None, env: dict[str, str] | None = None) -> ServerProcess:
    """`attnserve serve` (`service_command`, continuous batching, plus `flags`) on a free port,
    not started; from the code of `checkout` when given, serving that checkout's own
    `models_dir` when the path is relative."""
    port = free_port()
    if checkout is not None and not models_dir.is_absolute():
        models_dir = checkout / models_dir
    command = service_command(models_dir.resolve(), port) + list(flags)
    env = dict(env or {})
    if checkout is not None:  # run there: `python -m` puts the working directory first
        env["PYTHONPATH"] = str(checkout.resolve())
    return ServerProcess(command, port, log_path.resolve(), env=env,
                         cwd=checkout.resolve() if checkout is not None else None)


class ServerProcess:
    """One server subprocess: its URL, its log file, and its peak RSS while it runs."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 ready_path: str = "/health/ready", cwd: Path | None = None) -> None:
        self.command = command
        self.cwd = cwd  # where it runs (its first import path with `python -m`)
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.process: subprocess.Popen[bytes] | None = None
        self.rss: PeakRss | None = None

    def start(self, timeout_s: float = 300.0) -> Self:
        """Start the process and return once `ready_path` answers 200 (raises if it never does)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                        cwd=self.cwd)
        log.close()
        self.rss = PeakRss(self.process.pid).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout_s}s; see {self.log_path}")

    def stop(self, timeout_s: float = 30.0) -> float:
        """SIGTERM (then SIGKILL after `timeout_s`); returns the peak RSS in MiB."""
        peak = self.rss.stop() / 2**20 if self.rss else 0.0
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return peak

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
