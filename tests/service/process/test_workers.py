"""`attnserve serve --workers N`: worker processes, each on its own listening socket (Linux), a
killed one is restarted.

The settings reach the spawned workers through the environment (checked in the default run);
the kill test runs the real server on the tiny model and is marked `soak` (`make soak`); with
`ATTNSERVE_RELIABILITY_MODELS` set to a model repository (`models`: the default models) it runs
on those instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.core.settings import Settings
from service.process.workers import settings_environment

MODELS = os.environ.get("ATTNSERVE_RELIABILITY_MODELS")  # None: the tiny model
BODY = {"text": "the quick brown fox"} if MODELS else {"text": "abc de"}


def test_the_environment_rebuilds_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(models_dir=Path("some/models"), providers=("CPUExecutionProvider",),
                        max_batch_size=3, api_key="k3y", cors_origins=("https://a.example",),
                        fail_on_model_error=True, workers=2, request_timeout_s=7.5)
    for name, value in settings_environment(settings).items():
        monkeypatch.setenv(name, value)
    assert Settings() == settings
    assert Settings().api_key is not None and Settings().api_key.get_secret_value() == "k3y"


def test_the_supervisor_imports_no_model_code() -> None:
    # the process that only spawns and restarts workers keeps no copy of numpy or onnxruntime
    code = ("import sys, service.process.workers as w, service.process.commands\n"
            "from service.core.settings import Settings\n"
            "from service.process.uvicorn_config import PROTOCOL, server_options\n"
            "options = server_options(Settings(workers=2))\n"
            "heavy = sorted({'numpy', 'onnxruntime', 'fastapi', 'sentencepiece'} & set(sys.modules))\n"
            "print(heavy, PROTOCOL, options['port'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["[]", "service.process.http:GuardedProtocol", "8000"]


def worker_pids(parent: int) -> set[int]:
    """The spawned worker processes of uvicorn's supervisor (not its resource tracker)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    pids = set()
    for pid in map(int, children):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"resource_tracker" not in command:
            pids.add(pid)
    return pids


async def closed_loop_until(url: str, stop: asyncio.Event, concurrency: int) -> list[int]:
    """Statuses of requests sent by `concurrency` clients, a new connection each time, until
    `stop` (0: no HTTP response)."""
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def user() -> None:
            while not stop.is_set():
                try:
                    statuses.append((await client.post(url, json=BODY)).status_code)
                except httpx.HTTPError:
                    statuses.append(0)

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return statuses


def tcp_sockets(port: int, state: str) -> set[int]:
    """Inodes of the TCP sockets whose local port is `port`, in `state` ('0A' listening,
    '01' established), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                inodes.add(int(fields[9]))
    return inodes


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


@contextlib.contextmanager
def two_workers(models: Path, tmp_path: Path, command: list[str] | None = None, flags: tuple[str, ...] = (),
                ) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`serve --workers 2` on the CPU (`command`: the CLI to run, default `serve_command()`;
    `flags`: more options of `serve`) on a free port, ready: its process, port and log;
    terminated (killed if it hangs) on the way out unless it has exited."""
    from tests.service.test_serve import STARTUP_TIMEOUT_S, free_port, serve_command, wait_ready

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as output, subprocess.Popen(
        [*(command or serve_command()), "--log-level", "WARNING", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--models", str(models), "--workers", "2", *flags],
        env={**os.environ, "ATTNSERVE_PROVIDERS": "CPUExecutionProvider", "ATTNSERVE_THREADS": "1"},
        stdout=output, stderr=subprocess.STDOUT,
    ) as process:
        try:
            wait_ready(port, STARTUP_TIMEOUT_S)
            yield process, port, log
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()


def listening_workers(process: subprocess.Popen[bytes], port: int, log: Path) -> tuple[dict[int, set[int]], set[int]]:
    """Once both workers of `process` listen on `port`: each worker's listening sockets (inodes),
    and all the sockets listening on the port."""
    from tests.service.test_serve import STARTUP_TIMEOUT_S

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    own: dict[int, set[int]] = {}
    while len(own) < 2 or not all(own.values()):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
        listening = tcp_sockets(port, "0A")
        own = {pid: socket_inodes(pid) & listening for pid in worker_pids(process.pid)}
    return own, listening


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balances on Linux")
def test_each_worker_listens_on_its_own_socket_and_connections_spread(served_tiny_models: Path,
                                                                       tmp_path: Path) -> None:
    """Each worker accepts on a listening socket of its own (none is shared), so the kernel
    spreads 64 connections opened at once over the two: each holds at least 16 (below that
    by chance, for either: about 1 in 40,000)."""
    connections: list[socket.socket] = []
    with two_workers(served_tiny_models, tmp_path) as (process, port, log):
        try:
            own, listening = listening_workers(process, port, log)
            assert all(len(inodes) == 1 for inodes in own.values()), own
            assert len(set.union(*own.values())) == 2 and not socket_inodes(process.pid) & listening
            connections = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(64)]
            deadline = time.monotonic() + 30
            held: dict[int, int] = {}
            while sum(held.values()) < 64:  # each worker accepts its connections
                assert time.monotonic() < deadline, held
                time.sleep(0.1)
                established = tcp_sockets(port, "01")
                held = {pid: len(socket_inodes(pid) & established) for pid in own}
            assert min(held.values()) >= 16, held
        finally:
            for connection in connections:
                connection.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balances on Linux")
def test_each_worker_serves_grpc_on_a_socket_of_its_own(served_tiny_models: Path, tmp_path: Path) -> None:
    """With `--grpc-port` every worker listens on the gRPC port too, on a socket of its own
    (SO_REUSEPORT, as for HTTP), and calls on separate connections are answered."""
    grpc = pytest.importorskip("grpc")
    from service.api import grpc_messages as pb
    from service.api import open_inference
    from tests.service.test_serve import free_port

    grpc_port = free_port()
    with two_workers(served_tiny_models, tmp_path, flags=("--grpc-port", str(grpc_port))) as (process, port, log):
        listening_workers(process, port, log)  # both workers started
        listening = tcp_sockets(grpc_port, "0A")
        own = {pid: socket_inodes(pid) & listening for pid in worker_pids(process.pid)}
        assert len(own) == 2 and all(len(inodes) == 1 for inodes in own.values()), own
        assert len(set.union(*own.values())) == 2
        request = pb.ModelInferRequest(model_name="tiny-reverse")
        request.inputs.add(name="text", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(open_inference.serialize_bytes(["abc de"]))
        answers = []
        for _ in range(8):  # a connection each
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                infer = channel.unary_unary(f"/{pb.SERVICE}/ModelInfer",
                                            request_serializer=pb.ModelInferRequest.SerializeToString,
                                            response_deserializer=pb.ModelInferResponse.FromString)
                response = infer(request, timeout=30)
                (output,) = open_inference.deserialize_bytes(response.raw_output_contents[0])
                answers.append(output.decode().strip())
    assert answers == ["ed cba"] * 8  # the tiny model reverses


def test_where_the_kernel_does_not_spread_uvicorns_supervisor_serves_one_socket(served_tiny_models: Path,
                                                                                tmp_path: Path) -> None:
    """Without `SO_REUSEPORT` balancing (`SPREADS` off, as off Linux) the workers share uvicorn's
    one listening socket and serve."""
    code = ("import sys, service.process.workers as w; w.SPREADS = False; "
            "from attnserve.cli import main; sys.exit(main())")
    with two_workers(served_tiny_models, tmp_path, [sys.executable, "-c", code]) as (process, port, log):
        own, _ = listening_workers(process, port, log)
        assert len(set.union(*own.values())) == 1  # one socket, held by both
        assert httpx.post(f"http://127.0.0.1:{port}/v1/translate", json=BODY, timeout=30).status_code == 200


def test_sigterm_stops_every_worker_and_the_supervisor_exits_0(served_tiny_models: Path, tmp_path: Path) -> None:
    """SIGTERM to the supervisor: each worker is asked to drain and stops, requests sent before
    it are answered, and the supervisor exits 0 with no worker left behind."""
    with two_workers(served_tiny_models, tmp_path) as (process, port, log):
        workers = set(listening_workers(process, port, log)[0])
        statuses = [httpx.post(f"http://127.0.0.1:{port}/v1/translate", json=BODY, timeout=30).status_code
                    for _ in range(4)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-3000:]
    assert statuses == [200] * 4
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def test_workers_on_an_address_in_use_exit_1_with_one_line(served_tiny_models: Path, tmp_path: Path) -> None:
    """A port another socket holds: the supervisor says so and exits 1, no traceback."""
    from tests.service.test_serve import serve_command

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*serve_command(), "serve", "--host", "127.0.0.1", "--port", str(port), "--models",
             str(served_tiny_models), "--workers", "2"],
            env={**os.environ, "ATTNSERVE_PROVIDERS": "CPUExecutionProvider"}, capture_output=True, text=True,
            timeout=120, check=False)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def _translations_counted(port: int) -> float:
    """`attnserve_requests_total` of /v1/translate's 2xx answers in one scrape of `/metrics`."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("attnserve_requests_total{") and 'route="/v1/translate"' in line
               and 'status="2xx"' in line)


def test_the_workers_metrics_add_up_and_a_dead_workers_gauges_leave(
    served_tiny_models: Path, tmp_path: Path
) -> None:
    from service.observability.metrics import forget_dead_processes
    from tests.service.test_serve import STARTUP_TIMEOUT_S, free_port, serve_command, wait_ready

    port, folder = free_port(), tmp_path / "metrics"
    folder.mkdir()
    environment = {**os.environ, "ATTNSERVE_PROVIDERS": "CPUExecutionProvider", "ATTNSERVE_THREADS": "1",
                   "PROMETHEUS_MULTIPROC_DIR": str(folder)}  # given: kept, so the test reads the files
    log = tmp_path / "serve.log"
    with log.open("w") as output, subprocess.Popen(
        [*serve_command(), "--log-level", "WARNING", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--models", str(served_tiny_models), "--workers", "2"],
        env=environment, stdout=output, stderr=subprocess.STDOUT,
    ) as process:
        try:
            wait_ready(port, STARTUP_TIMEOUT_S)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while len(workers := worker_pids(process.pid)) < 2 or not all(
                    (folder / f"gauge_livesum_{pid}.db").exists() for pid in workers):
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            for _ in range(12):  # a new connection each: either worker may take it
                assert httpx.post(f"http://127.0.0.1:{port}/v1/translate", json=BODY, timeout=30).status_code == 200
            assert [_translations_counted(port) for _ in range(6)] == [12.0] * 6  # whichever worker answers
            card = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["models"][0]
            assert card["batching"]["processes"] == 2  # its counters are that worker's own
            victim = min(workers)
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while len(worker_pids(process.pid) - {victim}) < 2:
                assert time.monotonic() < deadline, "the killed worker was not replaced"
                time.sleep(0.2)
            wait_ready(port, STARTUP_TIMEOUT_S)
            assert _translations_counted(port) == 12.0  # the dead worker's counts stay in the sum
            assert not list(folder.glob(f"gauge_live*_{victim}.db"))  # its gauges left at the scrape
            assert forget_dead_processes(folder) == []
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.mark.soak
def test_a_killed_worker_is_restarted_and_only_its_requests_fail(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from tests.service.test_serve import STARTUP_TIMEOUT_S, free_port, serve_command, wait_ready

    models = Path(MODELS) if MODELS else request.getfixturevalue("served_tiny_models")
    concurrency = 6
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/translate"
    log = tmp_path / "serve.log"
    environment = {**os.environ, "ATTNSERVE_PROVIDERS": "CPUExecutionProvider",
                   "ATTNSERVE_THREADS": "1"}
    with log.open("w") as output, subprocess.Popen(
        [*serve_command(), "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--models", str(models), "--workers", "2"],
        env=environment, stdout=output, stderr=subprocess.STDOUT,
    ) as process:
        try:
            wait_ready(port, 300 if MODELS else STARTUP_TIMEOUT_S)
        except AssertionError:
            process.kill()
            raise AssertionError(log.read_text()[-3000:]) from None
        deadline = time.monotonic() + 60
        while len(worker_pids(process.pid)) < 2:
            assert time.monotonic() < deadline, "the two workers did not start"
            time.sleep(0.2)
        before = worker_pids(process.pid)

        async def scenario() -> tuple[list[int], set[int]]:
            stop = asyncio.Event()
            load = asyncio.ensure_future(closed_loop_until(url, stop, concurrency))
            await asyncio.sleep(3)
            victim = min(before)
            os.kill(victim, signal.SIGKILL)
            replaced: set[int] = set()
            for _ in range(600):  # the supervisor notices and spawns a new worker
                replaced = worker_pids(process.pid) - before
                if replaced:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(8)  # the replacement loads the model and serves
            stop.set()
            return await load, replaced

        statuses, replaced = asyncio.run(scenario())
        after = [httpx.post(url, json=BODY, timeout=30).status_code for _ in range(10)]
        alive = worker_pids(process.pid)
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    failed = [s for s in statuses if s != 200]
    figures = {"models": str(models), "requests": len(statuses), "failed": len(failed),
               "failed_statuses": sorted(set(failed)), "replaced": bool(replaced),
               "in_flight_bound": concurrency, "after": after}
    print(f"\nkilled worker: {json.dumps(figures)}")
    out = os.environ.get("ATTNSERVE_RELIABILITY_OUT")
    if out:
        name = f"killed-worker-{models.resolve().name}" if MODELS else "killed-worker"
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    assert replaced, "the killed worker was not replaced"
    assert len(alive) == 2
    assert statuses.count(200) > 20
    assert len(failed) <= concurrency, failed  # at most the requests in flight on the victim
    assert set(failed) <= {0}, failed  # lost connections only, never an error status
    assert after == [200] * 10
