"""HTTP load generator: open loop (a fixed request rate) or closed loop (fixed concurrency).

aiohttp, as `bench.loadgen`: the generator shares the cores with the server it loads, and
aiohttp spends less CPU per request than httpx.

Every request's send time, status (or transport error) and latency is recorded, so a run can
be cut into windows (goodput, percentiles per minute). A probe can poll a liveness URL beside
the load. Usage:

    python -m bench.load --url http://127.0.0.1:8000/v1/translate --rate 120 --duration 60
    python -m bench.load --url ... --concurrency 8 --duration 10 --json '{"text": "abc"}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TRANSPORT_ERROR = 0  # the status recorded when no HTTP response came back


@dataclass(frozen=True)
class Sample:
    """One request: when it was sent (seconds from the run's start), its status, its latency,
    and for a transport error (status 0) the exception's class name."""

    sent_s: float
    status: int
    latency_s: float
    error: str = ""


@dataclass
class LoadResult:
    """Every request of a run and the probe's answers."""

    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    probes: list[Sample] = field(default_factory=list)
    max_send_lag_s: float = 0.0  # open loop: how late the latest send was against its schedule

    def statuses(self) -> Counter[int]:
        """How many requests got each status (0: transport error, i.e. lost)."""
        return Counter(sample.status for sample in self.samples)

    def goodput(self, start_s: float = 0.0, end_s: float | None = None) -> float:
        """Successful (2xx) requests per second sent within [start_s, end_s)."""
        end_s = self.duration_s if end_s is None else end_s
        ok = sum(1 for s in self._window(start_s, end_s) if 200 <= s.status < 300)
        return ok / max(end_s - start_s, 1e-9)

    def percentile(self, q: float, start_s: float = 0.0, end_s: float | None = None) -> float:
        """The q-quantile (0-1) of the 2xx latencies sent within the window (nan if none)."""
        end_s = self.duration_s if end_s is None else end_s
        latencies = sorted(s.latency_s for s in self._window(start_s, end_s)
                           if 200 <= s.status < 300)
        if not latencies:
            return math.nan
        return latencies[min(len(latencies) - 1, math.ceil(q * len(latencies)) - 1)]

    def summary(self) -> dict[str, Any]:
        """Counts, goodput and latency percentiles, for printing or RELIABILITY.md."""
        probe_latencies = [p.latency_s for p in self.probes]
        return {
            "duration_s": round(self.duration_s, 1),
            "max_send_lag_s": round(self.max_send_lag_s, 3),
            "requests": len(self.samples),
            "statuses": dict(sorted(self.statuses().items())),
            "lost": self.statuses()[TRANSPORT_ERROR],
            "transport_errors": dict(Counter(s.error for s in self.samples if s.error)),
            "goodput_rps": round(self.goodput(), 1),
            "p50_ms": round(self.percentile(0.5) * 1000, 1),
            "p99_ms": round(self.percentile(0.99) * 1000, 1),
            "probes": len(self.probes),
            "probe_failures": sum(1 for p in self.probes if p.status != 200),
            "probe_errors": dict(Counter(p.error for p in self.probes if p.error)),
            "probe_max_ms": round(max(probe_latencies, default=0.0) * 1000, 1),
        }

    def _window(self, start_s: float, end_s: float) -> list[Sample]:
        return [s for s in self.samples if start_s <= s.sent_s < end_s]


async def _one(client: aiohttp.ClientSession, method: str, url: str, body: Any,
               headers: dict[str, str], t0: float) -> Sample:
    """Send one request and read its whole answer; a failure to get one is TRANSPORT_ERROR."""
    sent = time.perf_counter()
    error = ""
    try:
        async with client.request(method, url, json=body, headers=headers) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        status, error = TRANSPORT_ERROR, type(exc).__name__
    return Sample(sent - t0, status, time.perf_counter() - sent, error)


async def _probe(url: str, every_s: float, t0: float, stop: asyncio.Event,
                 out: list[Sample]) -> None:
    async with _client(1, 10.0, True) as client:
        while not stop.is_set():
            out.append(await _one(client, "GET", url, None, {}, t0))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass


def _client(connections: int, timeout_s: float, keepalive: bool) -> aiohttp.ClientSession:
    """At most `connections` connections, kept alive unless `keepalive` is False; each request
    has `timeout_s` in all."""
    connector = aiohttp.TCPConnector(limit=connections, force_close=not keepalive)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def open_loop(
    url: str, body: Any, rate: float, duration_s: float, *, headers: dict[str, str] | None = None,
    timeout_s: float = 30.0, probe_url: str | None = None, probe_every_s: float = 0.25,
    keepalive: bool = True,
) -> LoadResult:
    """Send `rate` requests per second for `duration_s`, whatever the answers; wait for all."""
    headers = headers or {}
    connections = max(16, math.ceil(rate * min(timeout_s, 5.0)))
    result = LoadResult(duration_s)
    stop = asyncio.Event()
    t0 = time.perf_counter()
    probe = (asyncio.ensure_future(_probe(probe_url, probe_every_s, t0, stop, result.probes))
             if probe_url else None)
    async with _client(connections, timeout_s, keepalive) as client:
        tasks = []
        for i in range(math.floor(rate * duration_s)):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = time.perf_counter() - (t0 + i / rate)
            result.max_send_lag_s = max(result.max_send_lag_s, lag)
            tasks.append(asyncio.ensure_future(_one(client, "POST", url, body, headers, t0)))
        result.samples = list(await asyncio.gather(*tasks))
    stop.set()
    if probe is not None:
        await probe
    return result


async def closed_loop(
    url: str, body: Any, concurrency: int, duration_s: float, *,
    headers: dict[str, str] | None = None, timeout_s: float = 30.0, keepalive: bool = True,
) -> LoadResult:
    """`concurrency` clients each sending one request after the other for `duration_s`."""
    headers = headers or {}
    result = LoadResult(duration_s)
    t0 = time.perf_counter()

    async def user(client: aiohttp.ClientSession) -> None:
        while time.perf_counter() - t0 < duration_s:
            result.samples.append(await _one(client, "POST", url, body, headers, t0))

    async with _client(concurrency, timeout_s, keepalive) as client:
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run one load and print its summary as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--json", default='{"text": "hello world"}', help="request body")
    parser.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument("--concurrency", type=int, help="closed loop: concurrent clients")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    parser.add_argument("--header", action="append", default=[], help="Name: value")
    parser.add_argument("--probe-url", help="poll this URL (liveness) during an open loop")
    args = parser.parse_args(argv)
    if (args.rate is None) == (args.concurrency is None):
        parser.error("give exactly one of --rate and --concurrency")
    headers = dict(h.split(":", 1) for h in args.header)
    headers = {k.strip(): v.strip() for k, v in headers.items()}
    body = json.loads(args.json)
    if args.rate is not None:
        result = asyncio.run(open_loop(args.url, body, args.rate, args.duration, headers=headers,
                                       timeout_s=args.timeout, probe_url=args.probe_url))
    else:
        result = asyncio.run(closed_loop(args.url, body, args.concurrency, args.duration,
                                         headers=headers, timeout_s=args.timeout))
    print(json.dumps(result.summary(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
