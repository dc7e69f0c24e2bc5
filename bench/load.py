"""HTTP load generator (asyncio + aiohttp): closed loop at a concurrency, open loop at a rate.

aiohttp, not httpx: the generator shares the cores with the server it loads, and aiohttp spends
less CPU per request.

Every request is recorded as a `Sample`: when it was sent (seconds from the run's start), its
status (`TRANSPORT_ERROR` when no HTTP answer came back), its latency, the output tokens a
generation response reports, and what went wrong. A `LoadResult` gives the benchmark's figures
from them (`stats`: throughput and latency percentiles of the answered requests) and the
reliability tests' (`statuses`, `goodput` and `percentile` over windows of the run, `summary`).

Requests are JSON bodies sent in order: a closed loop sends each once (or cycles them until
`duration_s`); an open loop sends at `rate` per second, evenly or as a Poisson process, whatever
the server's pace, and measures each latency from the request's scheduled arrival, so a server
that falls behind is charged for the queueing it causes (`from_send`: from when it was sent). A
probe can poll a liveness URL beside an open loop. Usage:

    python -m bench.load --url http://127.0.0.1:8000/v1/translate --rate 120 --duration 60
    python -m bench.load --url ... --concurrency 8 --duration 10 --json '{"text": "abc"}'
    python -m bench.load --url ... --concurrency 64 --duration 50 --texts data/translate-en-it/test.src
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.stats import RunStats, summarise

TRANSPORT_ERROR = 0  # the status recorded when no HTTP response came back
REQUEST_TIMEOUT_S = 300.0
ERROR_SAMPLES = 5  # error messages a result keeps for its report


@dataclass(frozen=True)
class Sample:
    """One request: when it was sent (seconds from the run's start), its status, its latency,
    the output tokens its response reports, and what went wrong: the exception's class name for
    a transport error (status 0), the status and the start of the body for an HTTP error, or a
    generation response without its outputs; and the stage times (milliseconds) of its
    `Server-Timing` header."""

    sent_s: float
    status: int
    latency_s: float
    error: str = ""
    output_tokens: int = 0
    server_timing: tuple[tuple[str, float], ...] = ()

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.error


@dataclass
class LoadResult:
    """Every request of a run and the probe's answers; `duration_s` is the run's planned length
    (its windows), `elapsed_s` the time until its last answer."""

    duration_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    probes: list[Sample] = field(default_factory=list)
    max_send_lag_s: float = 0.0  # open loop: how late the latest send was against its schedule
    elapsed_s: float = 0.0

    # ---- the benchmark's figures

    @property
    def latencies_s(self) -> list[float]:
        return [s.latency_s for s in self.samples if s.ok]

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.samples if s.ok)

    @property
    def errors(self) -> int:
        return sum(1 for s in self.samples if not s.ok)

    @property
    def error_samples(self) -> list[str]:
        return [s.error for s in self.samples if s.error][:ERROR_SAMPLES]

    def server_timing_ms(self, q: float = 0.5) -> dict[str, float]:
        """The q-quantile (0-1; default the median) of each `Server-Timing` stage over the
        answered requests that report it, in milliseconds, with the client's own latency
        (`client`) over the same requests; each stage on its own, so they do not add up."""
        timed = [s for s in self.samples if s.ok and s.server_timing]
        stages: dict[str, list[float]] = {}
        for sample in timed:
            for name, ms in sample.server_timing:
                stages.setdefault(name, []).append(ms)
        if timed:
            stages["client"] = [s.latency_s * 1000 for s in timed]
        if q == 0.5:
            return {name: round(statistics.median(values), 3) for name, values in stages.items()}
        return {name: round(_nearest_rank(sorted(values), q), 3) for name, values in stages.items()}

    def stats(self) -> RunStats:
        """Throughput and latency percentiles of the answered requests over `elapsed_s`."""
        return summarise(self.latencies_s, self.output_tokens, max(self.elapsed_s, 1e-9), self.errors)

    def merge(self, other: LoadResult) -> None:
        """Add `other`'s requests and time (a later slice of the same run) to these."""
        self.samples += other.samples
        self.probes += other.probes
        self.elapsed_s += other.elapsed_s
        self.duration_s += other.duration_s
        self.max_send_lag_s = max(self.max_send_lag_s, other.max_send_lag_s)

    # ---- the reliability tests' figures

    def statuses(self) -> Counter[int]:
        """How many requests got each status (0: transport error, i.e. lost)."""
        return Counter(sample.status for sample in self.samples)

    def goodput(self, start_s: float = 0.0, end_s: float | None = None) -> float:
        """Answered (2xx) requests per second sent within [start_s, end_s)."""
        end_s = self.duration_s if end_s is None else end_s
        ok = sum(1 for s in self._window(start_s, end_s) if s.ok)
        return ok / max(end_s - start_s, 1e-9)

    def percentile(self, q: float, start_s: float = 0.0, end_s: float | None = None) -> float:
        """The q-quantile (0-1) of the 2xx latencies sent within the window (nan if none)."""
        end_s = self.duration_s if end_s is None else end_s
        latencies = sorted(s.latency_s for s in self._window(start_s, end_s) if s.ok)
        if not latencies:
            return math.nan
        return _nearest_rank(latencies, q)

    def summary(self) -> dict[str, Any]:
        """Counts, goodput and latency percentiles, for printing or RELIABILITY.md."""
        probe_latencies = [p.latency_s for p in self.probes]
        return {
            "duration_s": round(self.duration_s, 1),
            "max_send_lag_s": round(self.max_send_lag_s, 3),
            "requests": len(self.samples),
            "statuses": dict(sorted(self.statuses().items())),
            "lost": self.statuses()[TRANSPORT_ERROR],
            "transport_errors": dict(Counter(s.error for s in self.samples
                                             if s.status == TRANSPORT_ERROR)),
            "goodput_rps": round(self.goodput(), 1),
            "p50_ms": round(self.percentile(0.5) * 1000, 1),
            "p99_ms": round(self.percentile(0.99) * 1000, 1),
            "probes": len(self.probes),
            "probe_failures": sum(1 for p in self.probes if p.status != 200),
            "probe_errors": dict(Counter(p.error for p in self.probes if p.error)),
            "probe_max_ms": round(max(probe_latencies, default=0.0) * 1000, 1),
            "server_timing_p50_ms": self.server_timing_ms(),
        }

    def _window(self, start_s: float, end_s: float) -> list[Sample]:
        return [s for s in self.samples if start_s <= s.sent_s < end_s]


def _nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The q-quantile (0-1) of ascending `ordered` (not empty) by the nearest-rank rule."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def client(connections: int, timeout_s: float = REQUEST_TIMEOUT_S,
           keepalive: bool = True) -> aiohttp.ClientSession:
    """At most `connections` connections (0: no limit), kept alive unless `keepalive` is False;
    each request has `timeout_s` in all."""
    connector = aiohttp.TCPConnector(limit=connections, force_close=not keepalive)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def request(session: aiohttp.ClientSession, url: str, body: Any, t0: float, *,
                  method: str = "POST", headers: dict[str, str] | None = None,
                  since: float | None = None, outputs: bool = True) -> Sample:
    """Send one request and read its whole answer; its latency counts from `since` (default:
    when it was sent), its send time from `t0`. A 2xx answer to a POST must carry `outputs`,
    whose `output_tokens` are counted (unless `outputs` is False: another API's answer)."""
    sent = time.perf_counter()
    error, tokens, timing = "", 0, ""
    try:
        async with session.request(method, url, json=body, headers=headers or {}) as response:
            data = await response.read()
            status = response.status
            timing = response.headers.get("Server-Timing", "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        status, error = TRANSPORT_ERROR, type(exc).__name__
    else:
        if status >= 400:
            error = f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}"
        elif method == "POST" and outputs:
            try:
                tokens = sum(int(o.get("output_tokens", 0)) for o in json.loads(data)["outputs"])
            except (KeyError, ValueError, TypeError, AttributeError) as exc:
                error = f"a response without outputs: {type(exc).__name__}"
    return Sample(sent - t0, status, time.perf_counter() - (sent if since is None else since),
                  error, tokens, parse_server_timing(timing))


def parse_server_timing(value: str) -> tuple[tuple[str, float], ...]:
    """(name, milliseconds) of each metric of a `Server-Timing` header value that has a
    `dur` (W3C Server Timing: `name;dur=1.5;desc="..."`, comma-separated)."""
    stages = []
    for metric in value.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, raw = param.partition("=")
            if name and key.strip() == "dur":
                try:
                    stages.append((name, float(raw.strip().strip('"'))))
                except ValueError:
                    pass
    return tuple(stages)


def arrival_times(rate: float, count: int, seed: int = 0) -> list[float]:
    """Poisson arrival offsets (seconds from the start) of `count` requests at `rate` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def _probe(url: str, every_s: float, t0: float, stop: asyncio.Event,
                 out: list[Sample]) -> None:
    async with client(1, 10.0) as session:
        while not stop.is_set():
            out.append(await request(session, url, None, t0, method="GET"))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass


async def open_loop(
    url: str, bodies: Sequence[Any], rate: float, duration_s: float, *, poisson: bool = True,
    seed: int = 0, first: int = 0, max_requests: int | None = None,
    headers: dict[str, str] | None = None, timeout_s: float = REQUEST_TIMEOUT_S,
    probe_url: str | None = None, probe_every_s: float = 0.25, keepalive: bool = True,
    from_send: bool = False,
) -> LoadResult:
    """Send `rate` requests per second for `duration_s` (Poisson arrivals, or evenly spaced
    without `poisson`), whatever the answers, `bodies` cycled from `first`; wait for all."""
    count = max(1, math.floor(rate * duration_s))
    if max_requests is not None:
        count = min(count, max_requests)
    offsets = arrival_times(rate, count, seed) if poisson else [i / rate for i in range(count)]
    result = LoadResult(duration_s)
    stop = asyncio.Event()
    t0 = time.perf_counter()
    probe = (asyncio.ensure_future(_probe(probe_url, probe_every_s, t0, stop, result.probes))
             if probe_url else None)
    connections = max(16, math.ceil(rate * min(timeout_s, 5.0)))
    async with client(connections, timeout_s, keepalive) as session:
        tasks = []
        for i, offset in enumerate(offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(request(
                session, url, bodies[(first + i) % len(bodies)], t0, headers=headers,
                since=None if from_send else t0 + offset)))
        result.samples = list(await asyncio.gather(*tasks))
    # each request's start against its schedule (a task starts when the loop next runs it)
    result.max_send_lag_s = max(max(s.sent_s - o for s, o in zip(result.samples, offsets, strict=True)), 0.0)
    result.elapsed_s = time.perf_counter() - t0
    stop.set()
    if probe is not None:
        await probe
    return result


async def closed_loop(
    url: str, bodies: Sequence[Any], concurrency: int, duration_s: float | None = None, *,
    cycle: bool = False, headers: dict[str, str] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S, keepalive: bool = True, outputs: bool = True,
) -> LoadResult:
    """`concurrency` clients each send the next body as soon as their last answer came back:
    every body once, unless `duration_s` runs out first (then no new request starts); with
    `cycle`, the bodies over and over until `duration_s`; `outputs` as `request`'s."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if cycle and duration_s is None:
        raise ValueError("cycling the bodies needs a duration")
    result = LoadResult(duration_s or 0.0)
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + duration_s if duration_s else None

    async def user(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while (cycle or next_index < len(bodies)) and (deadline is None or time.perf_counter() < deadline):
            body = bodies[next_index % len(bodies)]
            next_index += 1
            result.samples.append(await request(session, url, body, t0, headers=headers, outputs=outputs))

    async with client(concurrency, timeout_s, keepalive) as session:
        await asyncio.gather(*(user(session) for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - t0
    return result


def text_bodies(texts: Sequence[str], **options: Any) -> list[dict[str, Any]]:
    """The generation routes' bodies: `{"text": text, **options}` per text."""
    return [{"text": text, **options} for text in texts]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one load and print its summary as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--json", default='{"text": "hello world"}', help="request body")
    parser.add_argument("--texts", type=Path, help="bodies {\"text\": line} from this file's first 1,000 lines, "
                        "sent in turn (instead of --json)")
    parser.add_argument("--rate", type=float, help="open loop: requests per second (evenly spaced)")
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
    if args.texts:
        from bench.workload import read_lines  # lazy: it brings the tokenizer, which loads need not

        bodies = text_bodies(read_lines(args.texts, 1000))
    else:
        bodies = [json.loads(args.json)]
    if args.rate is not None:
        result = asyncio.run(open_loop(args.url, bodies, args.rate, args.duration, poisson=False,
                                       headers=headers, timeout_s=args.timeout,
                                       probe_url=args.probe_url, from_send=True))
    else:
        result = asyncio.run(closed_loop(args.url, bodies, args.concurrency, args.duration,
                                         cycle=True, headers=headers, timeout_s=args.timeout))
    print(json.dumps(result.summary(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
