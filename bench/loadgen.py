"""HTTP load generator (asyncio + aiohttp): closed loop at a concurrency, open loop at a rate.

aiohttp, not httpx: the generator shares the machine's cores with the server it measures, and
aiohttp spends less CPU per request.

Both send `{"text": ...}` to one route and record, per request, its latency and the number of
output tokens the response reports. The open loop measures latency from each request's
scheduled send time, so a server that falls behind is charged for the queueing it causes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.stats import RunStats, summarise

REQUEST_TIMEOUT_S = 300.0


@dataclass
class LoadResult:
    """Per-request latencies (successful requests only), tokens, errors and wall time."""

    latencies_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)

    def stats(self) -> RunStats:
        return summarise(self.latencies_s, self.output_tokens, max(self.elapsed_s, 1e-9), self.errors)

    def merge(self, other: LoadResult) -> None:
        """Add `other`'s requests (a later slice of the same run) to these."""
        self.latencies_s += other.latencies_s
        self.output_tokens += other.output_tokens
        self.errors += other.errors
        self.elapsed_s += other.elapsed_s
        self.error_samples = (self.error_samples + other.error_samples)[:5]


def _failed(result: LoadResult, message: str) -> None:
    result.errors += 1
    if len(result.error_samples) < 5:
        result.error_samples.append(message[:300])


def session(connections: int) -> aiohttp.ClientSession:
    """A client session with at most `connections` connections (0: no limit)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def send(client: aiohttp.ClientSession, url: str, text: str, started: float, result: LoadResult,
                options: dict[str, object] | None = None) -> None:
    """POST `{"text": text, **options}` and record its latency from `started` and its output tokens, or the error."""
    try:
        async with client.post(url, json={"text": text, **(options or {})}) as response:
            if response.status >= 400:
                _failed(result, f"HTTP {response.status}: {await response.text()}")
                return
            body = await response.json()
        tokens = sum(int(o.get("output_tokens", 0)) for o in body["outputs"])
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError) as error:
        _failed(result, f"{type(error).__name__}: {error}")
        return
    result.latencies_s.append(time.perf_counter() - started)
    result.output_tokens += tokens


async def closed_loop(url: str, texts: Sequence[str], concurrency: int, duration_s: float | None = None) -> LoadResult:
    """`concurrency` clients each send the next text as soon as their last answer came back.

    Every text is sent once, unless `duration_s` runs out first (then no new request starts).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    result = LoadResult()
    next_index = 0
    started = time.perf_counter()
    deadline = started + duration_s if duration_s else None

    async def client_loop(client: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < len(texts) and (deadline is None or time.perf_counter() < deadline):
            text = texts[next_index]
            next_index += 1
            await send(client, url, text, time.perf_counter(), result)

    async with session(concurrency) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - started
    return result


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


async def open_loop(url: str, texts: Sequence[str], rate: float, duration_s: float, seed: int = 0,
                    max_requests: int | None = None, first_text: int = 0) -> LoadResult:
    """Requests arrive as a Poisson process at `rate`/s for `duration_s` (texts cycled from
    `first_text`), whatever the server's pace; each latency counts from its scheduled arrival."""
    count = max(1, int(rate * duration_s))
    if max_requests is not None:
        count = min(count, max_requests)
    offsets = arrival_times(rate, count, seed)
    result = LoadResult()
    async with session(0) as client:
        started = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, url, texts[(first_text + i) % len(texts)], started + offset,
                                                   result)))
        await asyncio.gather(*tasks)
        result.elapsed_s = time.perf_counter() - started
    return result
