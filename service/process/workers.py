"""Several server processes (`--workers N`), each on a listening socket of its own, each
restarted if it dies.

On Linux each worker accepts on its own socket bound to the same address with `SO_REUSEPORT`,
so the kernel spreads new connections over the workers by their addresses: kept-alive
connections opened at once land evenly, where on one shared socket whichever process wakes
first takes them. `Supervisor` keeps uvicorn's worker processes
(`uvicorn.supervisors.multiprocess.Process`: the health ping, the server) and gives each its
socket; a worker that exits or stops answering is replaced on a new one (only that worker's
in-flight requests fail), and a bound, never listening socket holds the address between them.
Elsewhere uvicorn's own supervisor serves all workers on one socket.

Each worker builds its own app from the environment (`app_from_environment`): the parent
writes the effective settings into `ATTNSERVE_*` variables before spawning. Every worker loads
every model and has its own batcher; their metrics add up through files in a folder the
supervisor makes (prometheus-client's multiprocess mode, `service.observability.metrics`), so
any worker's `/metrics` reports all of them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from service.core.settings import Settings
from service.observability import logs

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from uvicorn.supervisors.multiprocess import Process

ENV_PREFIX = "ATTNSERVE_"
LOG_LEVEL_VARIABLE = "ATTNSERVE_LOG_LEVEL"  # the parent's `--log-level`, for the workers
SPREADS = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")  # the kernel balances there
logger = logging.getLogger(__name__)


def settings_environment(settings: Settings) -> dict[str, str]:
    """`ATTNSERVE_*` variables that rebuild `settings` in a worker (the API key included)."""
    environment = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if name == "api_key":
            value = settings.api_key.get_secret_value() if settings.api_key else None
        elif isinstance(value, tuple | list):
            value = ",".join(str(part) for part in value)
        elif isinstance(value, bool):
            value = json.dumps(value)
        environment[ENV_PREFIX + name.upper()] = str(value)
    return environment


def app_from_environment() -> FastAPI:
    """The app of one worker, with the settings its parent wrote into the environment."""
    from service.api.app import create_app

    if not logging.getLogger().handlers:  # a spawned worker: logging as `attnserve` sets it
        logs.configure(os.environ.get(LOG_LEVEL_VARIABLE, "INFO"), os.environ.get(logs.FORMAT_VARIABLE, "text"))
    return create_app(Settings())


def run_workers(settings: Settings, environ: Mapping[str, str] | None = None) -> int:
    """Serve with `settings.workers` processes until SIGTERM or SIGINT (which drains them);
    returns the exit status: 0, or 1 when the address cannot be bound (logged)."""
    import uvicorn

    os.environ.update(environ if environ is not None else settings_environment(settings))
    os.environ[LOG_LEVEL_VARIABLE] = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    os.environ[logs.FORMAT_VARIABLE] = logs.current_format()
    # the supervisor runs no app: uvicorn's options without the app's modules (numpy, onnxruntime)
    from service.observability.metrics import MULTIPROCESS_DIR
    from service.process.uvicorn_config import PROTOCOL, server_options

    options: dict[str, Any] = {**server_options(settings), "http": PROTOCOL,
                               "workers": settings.workers, "factory": True}
    given = os.environ.get(MULTIPROCESS_DIR)  # the workers' metrics add up in files there
    directory = given or tempfile.mkdtemp(prefix="attnserve-metrics-")
    os.environ[MULTIPROCESS_DIR] = directory
    try:
        if not SPREADS:
            uvicorn.run("service.process.workers:app_from_environment", **options)
            return 0
        try:
            supervisor = Supervisor(uvicorn.Config("service.process.workers:app_from_environment", **options))
        except OSError as error:
            logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, error)
            return 1
        supervisor.run()
        return 0
    finally:
        if not given:
            shutil.rmtree(directory, ignore_errors=True)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` with `SO_REUSEPORT`, not listening yet."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """`config.workers` uvicorn worker processes, each listening on a socket of its own bound to
    one address (`SO_REUSEPORT`), replaced when they die, until SIGINT or SIGTERM (which each
    worker drains, as uvicorn's server does)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.config = config
        self.anchor = reuse_port_socket(config.host, config.port)  # never listens: holds the address
        self.port = self.anchor.getsockname()[1]
        self.processes: list[Process] = []
        self.should_exit = threading.Event()
        self.signals: list[int] = []

    def spawn(self) -> Process:
        """A started worker on a new socket; the worker holds the socket's only descriptor, so
        the socket leaves the kernel's group, its queued connections refused, when the worker exits."""
        from uvicorn.supervisors.multiprocess import Process

        sock = reuse_port_socket(self.config.host, self.port)
        try:
            process = Process(self.config, [sock])
            process.start()
        finally:
            sock.close()
        return process

    def run(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda sig, frame: self.signals.append(sig))
        logger.info("%d workers on http://%s:%d, one listening socket each", self.config.workers,
                    self.config.host, self.port)
        try:
            self.processes = [self.spawn() for _ in range(self.config.workers)]
            while not self.should_exit.wait(0.5):
                if self.signals:
                    self.should_exit.set()
                    break
                self.keep_alive()
            for process in self.processes:
                process.terminate()
            for process in self.processes:
                process.join()
        finally:
            self.anchor.close()

    def keep_alive(self) -> None:
        """Replace each worker that exited or does not answer its health ping; stop all when
        one failed before it started serving (its replacement would fail the same way)."""
        from uvicorn.config import STARTUP_FAILURE

        for index, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                logger.error("worker %s failed to start; stopping", process.pid)
                self.should_exit.set()
                return
            logger.warning("worker %s died (exit code %s); starting another", process.pid, process.exitcode)
            self.processes[index] = self.spawn()
