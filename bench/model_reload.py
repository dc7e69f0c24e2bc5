"""A model reloaded under load (`--model-control`): what its clients see.

One server (`attnserve serve --model-control`, the defaults otherwise) answers a closed loop of
`--concurrency` clients sending the test sentences to translate-en-it, one a request, without
pause for `--duration-s`; after a steady start, `--reloads` times and evenly spaced, the model
is reloaded from its folder (`POST /v2/repository/models/<name>/load`: hash check, sessions,
warm-up, beside the version serving, which then drains). Per concurrency: the requests and their
statuses (anything but a 2xx, or no answer, is a failure), each reload's duration, and the
sentences/s and p50/p99 latency of the requests sent while a reload ran against those sent
outside (before the first, and from two seconds after each).

    python -m bench.model_reload --models models --data-dir data --concurrency 16 64 \
        --out bench/results/model-reload
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import load
from bench.servers import service_process

logger = logging.getLogger(__name__)

MODEL = "translate-en-it"
SETTLE_S = 2.0  # after a reload ends, the requests of this long count as neither window


async def reloaded_run(url: str, texts: Sequence[str], concurrency: int, duration_s: float,
                       reloads: int, warm_s: float) -> tuple[load.LoadResult, list[tuple[float, float, int]]]:
    """The closed loop, and each reload's (start, end) in the loop's seconds and its status."""
    done: list[tuple[float, float, int]] = []
    t0 = time.perf_counter()

    async def reload_now() -> None:
        spacing = (duration_s - warm_s) / reloads
        async with httpx.AsyncClient(timeout=300) as client:
            for index in range(reloads):
                await asyncio.sleep(max(0.0, t0 + warm_s + index * spacing - time.perf_counter()))
                start = time.perf_counter() - t0
                answer = await client.post(f"{url}/v2/repository/models/{MODEL}/load")
                done.append((start, time.perf_counter() - t0, answer.status_code))

    loop = asyncio.ensure_future(load.closed_loop(f"{url}/v1/translate", load.text_bodies(texts, model=MODEL),
                                                  concurrency, duration_s, cycle=True, outputs=False))
    await reload_now()
    return await loop, done


def windows(result: load.LoadResult, reloads: list[tuple[float, float, int]]) -> dict[str, Any]:
    """Sentences/s and latency of the requests sent during a reload and of those sent outside."""
    def during(sent: float) -> bool:
        return any(start <= sent < end for start, end, _ in reloads)

    def settling(sent: float) -> bool:
        return any(end <= sent < end + SETTLE_S for _, end, _ in reloads)

    inside = [s for s in result.samples if during(s.sent_s)]
    outside = [s for s in result.samples if not during(s.sent_s) and not settling(s.sent_s)]
    inside_s = sum(end - start for start, end, _ in reloads)
    outside_s = result.duration_s - inside_s - SETTLE_S * len(reloads)
    return {"during reloads": _figures(inside, inside_s), "outside": _figures(outside, outside_s)}


def _figures(samples: list[load.Sample], seconds: float) -> dict[str, Any]:
    latencies = sorted(s.latency_s for s in samples if s.ok)

    def quantile(q: float) -> float:
        if not latencies:
            return math.nan
        return round(latencies[min(len(latencies) - 1, max(0, math.ceil(q * len(latencies)) - 1))] * 1000, 1)

    return {"requests": len(samples), "seconds": round(seconds, 2),
            "sentences_per_s": round(sum(1 for s in samples if s.ok) / max(seconds, 1e-9), 1),
            "p50_ms": quantile(0.5), "p99_ms": quantile(0.99)}


def run(models: Path, data_dir: Path, out: Path, concurrencies: Sequence[int], duration_s: float,
        reloads: int, warm_s: float) -> dict[str, Any]:
    texts = (data_dir / MODEL / "test.src").read_text(encoding="utf-8").splitlines()
    report: dict[str, Any] = {
        "command": "python -m bench.model_reload " + " ".join([
            "--models", str(models), "--data-dir", str(data_dir), "--concurrency",
            *map(str, concurrencies), "--duration-s", f"{duration_s:g}", "--reloads", str(reloads),
            "--out", str(out)]),
        "runs": {},
    }
    for concurrency in concurrencies:
        with service_process(models, out / f"server-c{concurrency}.log", ["--model-control"]) as server:
            asyncio.run(load.closed_loop(f"{server.url}/v1/translate", load.text_bodies(texts[:200], model=MODEL),
                                         concurrency))  # warm-up
            result, done = asyncio.run(reloaded_run(server.url, texts, concurrency, duration_s, reloads, warm_s))
        statuses = dict(sorted(result.statuses().items()))
        report["runs"][str(concurrency)] = {
            "requests": len(result.samples), "statuses": statuses, "failed": result.errors,
            "reloads": [{"start_s": round(start, 2), "seconds": round(end - start, 2), "status": status}
                        for start, end, status in done],
            **windows(result, done),
        }
        logger.info("concurrency %d: %s", concurrency, report["runs"][str(concurrency)])
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_reload.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "model_reload.md").write_text(markdown(report), encoding="utf-8")
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = ["# A model reloaded under load", "", f"`{report['command']}`", "",
             ("| clients | requests | failed | reloads, s each | sent during a reload: sentences/s, p50, p99 ms "
              "| sent outside: sentences/s, p50, p99 ms |"), "|---|---|---|---|---|---|"]
    for concurrency, run_ in report["runs"].items():
        inside, outside = run_["during reloads"], run_["outside"]
        lines.append(
            f"| {concurrency} | {run_['requests']} | {run_['failed']} | "
            f"{', '.join(str(r['seconds']) for r in run_['reloads'])} | "
            f"{inside['sentences_per_s']}, {inside['p50_ms']}, {inside['p99_ms']} | "
            f"{outside['sentences_per_s']}, {outside['p50_ms']}, {outside['p99_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/model-reload"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--warm-s", type=float, default=8.0, help="steady seconds before the first reload")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run(args.models, args.data_dir, args.out, args.concurrency, args.duration_s, args.reloads, args.warm_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
