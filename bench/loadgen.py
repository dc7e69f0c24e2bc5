"""HTTP load generator (asyncio + httpx): closed loop at a concurrency, open loop at a rate.

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

import httpx

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


def _failed(result: LoadResult, message: str) -> None:
    result.errors += 1
    if len(result.error_samples) < 5:
        result.error_samples.append(message[:300])


async def _send(client: httpx.AsyncClient, url: str, text: str, started: float, result: LoadResult) -> None:
    try:
        response = await client.post(url, json={"text": text})
        response.raise_for_status()
        tokens = sum(int(o.get("output_tokens", 0)) for o in response.json()["outputs"])
    except httpx.HTTPStatusError as error:
        _failed(result, f"HTTP {error.response.status_code}: {error.response.text}")
        return
    except (httpx.HTTPError, KeyError, ValueError) as error:
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
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    started = time.perf_counter()
    deadline = started + duration_s if duration_s else None

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < len(texts) and (deadline is None or time.perf_counter() < deadline):
            text = texts[next_index]
            next_index += 1
            await _send(client, url, text, time.perf_counter(), result)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
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
                    max_requests: int | None = None) -> LoadResult:
    """Requests arrive as a Poisson process at `rate`/s for `duration_s` (texts cycled), whatever
    the server's pace; each latency counts from its scheduled arrival."""
    count = max(1, int(rate * duration_s))
    if max_requests is not None:
        count = min(count, max_requests)
    offsets = arrival_times(rate, count, seed)
    result = LoadResult()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        started = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(client, url, texts[i % len(texts)], started + offset, result)))
        await asyncio.gather(*tasks)
        result.elapsed_s = time.perf_counter() - started
    return result
