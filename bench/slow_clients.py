"""Slow clients against a real server: do 500 sockets that never finish their request hurt the
clients that do?

A server process is started (the fake models of known capacity, `tests/service/load_app.py`,
by default; `--models DIR` serves real models with `attnserve serve`). Real clients run a closed
loop for `--duration-s` (the baseline); then `--slow` sockets connect and stall -- half in
their headers, half after 10 of the 100 body bytes they announce -- and, while the server
still holds them, the same closed loop runs again. The server's open file descriptors show the
sockets held; afterwards the script waits for the server's header and body timeouts to close
them, reads `attnserve_connections_refused_total` from `/metrics` and runs the loop a third
time. The result (p50/p95 of the loops, the ratio of the second's p95 to the baseline's, the
sockets held and closed) goes to `<out>/<name>.json`:

    python -m bench.slow_clients --slow 500 --out bench/results/slow_clients
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.load import LoadResult, closed_loop
from bench.machine import describe
from bench.servers import HOST, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
BODY = {"text": "the quick brown fox"}
FAKE_ENV = {"ATTNSERVE_FAKE_DELAY_S": "0.02", "ATTNSERVE_MAX_BATCH_SIZE": "8",
            "ATTNSERVE_BATCH_WORKERS": "1"}


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """The server process (`bench.servers.ServerProcess`, its log in `<out>/<name>-server.log`);
    yields its base URL and pid."""
    port = free_port()
    env = {"ATTNSERVE_HEADER_TIMEOUT_S": str(args.header_timeout_s),
           "ATTNSERVE_BODY_TIMEOUT_S": str(args.body_timeout_s)}
    if args.models is None:
        env.update(FAKE_ENV)
        command = [sys.executable, "-m", "uvicorn", "tests.service.load_app:create_load_app",
                   "--factory", "--http", "service.process.http:GuardedProtocol", "--host",
                   HOST, "--port", str(port), "--no-access-log", "--log-level", "warning"]
    else:
        script = shutil.which("attnserve", path=str(Path(sys.executable).parent)) \
            or shutil.which("attnserve")
        command = [*([script] if script else [sys.executable, "-m", "attnserve.cli"]),
                   "--log-level", "WARNING", "serve", "--host", HOST, "--port", str(port),
                   "--models", str(args.models)]
    with ServerProcess(command, port, (args.out / f"{args.name}-server.log").resolve(), env=env, cwd=ROOT) as process:
        assert process.process is not None
        yield process.url, process.process.pid


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stall(address: tuple[str, int], path: str, count: int) -> list[socket.socket]:
    """`count` sockets: even ones stop inside their headers, odd ones after 10 of 100 body
    bytes."""
    sockets = []
    for i in range(count):
        sock = socket.create_connection(address, timeout=10)
        if i % 2 == 0:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Ty".encode())
        else:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
                         "\r\nContent-Length: 100\r\n\r\n".encode() + b'{"text": "')
        sockets.append(sock)
    return sockets


def latencies(result: LoadResult) -> dict[str, Any]:
    return {"requests": len(result.samples), "statuses": dict(sorted(result.statuses().items())),
            "goodput_rps": round(result.goodput(), 1),
            "p50_ms": round(result.percentile(0.5) * 1000, 1),
            "p95_ms": round(result.percentile(0.95) * 1000, 1),
            "p99_ms": round(result.percentile(0.99) * 1000, 1)}


def refused_counts(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10, trust_env=False).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("attnserve_connections_refused_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    with server(args) as (base, pid):
        url = f"{base}/v1/translate"
        host, port = base.removeprefix("http://").split(":")
        asyncio.run(closed_loop(url, [BODY], args.concurrency, 2.0,
                                cycle=True, timeout_s=30.0))  # warm up
        fds_idle = open_fds(pid)
        baseline = asyncio.run(closed_loop(url, [BODY], args.concurrency, args.duration_s,
                                           cycle=True, timeout_s=30.0))
        opened_at = time.monotonic()
        sockets = stall((host, int(port)), "/v1/translate", args.slow)
        time.sleep(0.5)  # the server has accepted them
        fds_held = open_fds(pid)
        attacked = asyncio.run(closed_loop(url, [BODY], args.concurrency, args.duration_s,
                                           cycle=True, timeout_s=30.0))
        fds_after_loop = open_fds(pid)
        measured_within_s = time.monotonic() - opened_at
        closed_within_s = None
        deadline = opened_at + max(args.header_timeout_s, args.body_timeout_s) + 30
        while time.monotonic() < deadline:
            if open_fds(pid) <= fds_idle + 2:
                closed_within_s = round(time.monotonic() - opened_at, 1)
                break
            time.sleep(0.2)
        answered = 0
        for sock in sockets:
            sock.settimeout(0.5)
            try:
                answered += sock.recv(4096).startswith(b"HTTP/1.1 408")
            except OSError:
                pass
            sock.close()
        refused = refused_counts(base)
        after = asyncio.run(closed_loop(url, [BODY], args.concurrency, args.duration_s,
                                           cycle=True, timeout_s=30.0))
    ratio = attacked.percentile(0.95) / baseline.percentile(0.95)
    return {
        "slow_sockets": args.slow, "concurrency": args.concurrency, "duration_s": args.duration_s,
        "models": str(args.models) if args.models else "fake (tests/service/load_app.py)",
        "header_timeout_s": args.header_timeout_s, "body_timeout_s": args.body_timeout_s,
        "server_fds": {"idle": fds_idle, "slow_sockets_open": fds_held,
                       "after_second_loop": fds_after_loop},
        "slow_sockets_held_during_loop": fds_after_loop - fds_idle >= 0.9 * args.slow,
        "second_loop_ended_s_after_opening": round(measured_within_s, 1),
        "baseline": latencies(baseline), "with_slow_sockets": latencies(attacked),
        "after_they_closed": latencies(after),
        "p95_ratio": round(ratio, 3), "p95_within_2x": ratio <= 2.0,
        "all_closed_by_the_server_within_s": closed_within_s,
        "slow_sockets_answered_408": answered,
        "connections_refused_total": refused,
        "machine": describe(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slow_clients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=int, default=500, help="stalled sockets (default 500)")
    parser.add_argument("--concurrency", type=int, default=4, help="real clients (default 4)")
    parser.add_argument("--duration-s", type=float, default=8.0,
                        help="each closed loop; keep it under --header-timeout-s (default 8)")
    parser.add_argument("--header-timeout-s", type=float, default=10.0)
    parser.add_argument("--body-timeout-s", type=float, default=30.0)
    parser.add_argument("--models", type=Path, default=None,
                        help="serve these models with `attnserve serve` (default: fake models)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/slow_clients"))
    parser.add_argument("--name", default="slow_clients")
    args = parser.parse_args(argv)
    figures = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "machine"}, indent=2))
    return 0 if figures["p95_within_2x"] and figures["slow_sockets_held_during_loop"] else 1


if __name__ == "__main__":
    sys.exit(main())
