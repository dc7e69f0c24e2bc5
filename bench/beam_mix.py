"""Greedy latency with beam-search requests mixed in: does a beam request hold back the greedy
rows of the running batch?

One server (continuous batching, its defaults) gets Poisson arrivals of translation requests at
`--load` times its greedy closed-loop throughput (measured first at `--concurrency`). In each
slice the same arrivals are sent twice, in turns: once with a share `--beam-share` of them asking
for beam search (`--beam-size`), once with those requests left out (greedy only). The greedy
requests are the same in both, so the ratio of their p95 latencies is what the beam requests
cost them; the issue's bound is 1.5. Slices alternate which run goes first. Results:
`<out>/beam_mix.json` and `.md`.

    python -m bench.beam_mix --models models --data-dir data --out bench/results/beam_mix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import machine
from bench.load import LoadResult, arrival_times, client, closed_loop, request, text_bodies
from bench.servers import ServerProcess, free_port, service_command
from bench.workload import read_lines

BOUND = 1.5  # greedy p95 with beam requests mixed in / greedy-only p95


def beam_requests(count: int, share: float, seed: int) -> list[bool]:
    """Which of `count` requests ask for beam search: each with probability `share`, seeded."""
    rng = random.Random(seed)
    return [rng.random() < share for _ in range(count)]


async def mixed_open_loop(url: str, texts: Sequence[str], rate: float, duration_s: float, beams: Sequence[bool],
                          beam_size: int, with_beam: bool, seed: int, first_text: int = 0
                          ) -> tuple[LoadResult, LoadResult]:
    """Poisson arrivals at `rate` for `duration_s`; request i asks for beam search when
    `beams[i]` (left out entirely unless `with_beam`). Returns (greedy, beam) results; latencies
    count from the scheduled arrival."""
    offsets = [o for o in arrival_times(rate, len(beams), seed) if o < duration_s]
    async with client(0) as session:
        t0 = time.perf_counter()
        tasks, kinds = [], []
        for i, offset in enumerate(offsets):
            if beams[i] and not with_beam:
                continue
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"text": texts[(first_text + i) % len(texts)], **({"beam_size": beam_size} if beams[i] else {})}
            tasks.append(asyncio.create_task(request(session, url, body, t0, since=t0 + offset)))
            kinds.append(beams[i])
        samples = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    greedy = LoadResult(duration_s, [s for s, b in zip(samples, kinds, strict=True) if not b], elapsed_s=elapsed)
    beam = LoadResult(duration_s, [s for s, b in zip(samples, kinds, strict=True) if b], elapsed_s=elapsed)
    return greedy, beam


def run(models_dir: Path, texts: Sequence[str], out_dir: Path, load: float, concurrency: int, slices: int,
        slice_s: float, beam_share: float, beam_size: int, command: str = "") -> dict[str, Any]:
    """The measurement described in the module docstring; writes and returns the results."""
    port = free_port()
    server = ServerProcess(service_command(models_dir, port), port, out_dir / "logs" / "beam_mix-service.log")
    url = f"{server.url}/v1/translate"
    with server:
        asyncio.run(closed_loop(url, text_bodies(texts[:4]), 2))  # warm-up
        capacity = asyncio.run(closed_loop(url, text_bodies(texts), concurrency, 30.0)).stats().sentences_per_s
        rate = load * capacity
        pooled = {name: LoadResult() for name in ("greedy_only", "mixed_greedy", "mixed_beam")}
        per_slice = []
        for index in range(slices):
            count = max(1, int(rate * slice_s * 2))
            beams = beam_requests(count, beam_share, seed=index)
            order = (False, True) if index % 2 == 0 else (True, False)
            entry: dict[str, Any] = {}
            for with_beam in order:
                greedy, beam = asyncio.run(mixed_open_loop(url, texts, rate, slice_s, beams, beam_size, with_beam,
                                                           seed=index, first_text=index * count))
                if with_beam:
                    pooled["mixed_greedy"].merge(greedy)
                    pooled["mixed_beam"].merge(beam)
                    entry["mixed_greedy_p95_s"] = greedy.stats().latency_p95_s
                else:
                    pooled["greedy_only"].merge(greedy)
                    entry["greedy_only_p95_s"] = greedy.stats().latency_p95_s
            per_slice.append(entry)
    stats = {name: result.stats().to_dict() for name, result in pooled.items()}
    only, mixed = stats["greedy_only"]["latency_p95_s"], stats["mixed_greedy"]["latency_p95_s"]
    ratio = mixed / only if only and mixed is not None else None
    results = {
        "command": command, "machine": machine.describe(),
        "config": {"load": load, "concurrency": concurrency, "slices": slices, "slice_s": slice_s,
                   "beam_share": beam_share, "beam_size": beam_size},
        "greedy_capacity_sentences_per_s": capacity, "offered_rate": rate,
        "runs": stats, "slices": per_slice,
        "greedy_p95_ratio": ratio, "bound": BOUND,
        "status": "not measured" if ratio is None else ("met" if ratio <= BOUND else "missed"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "beam_mix.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out_dir / "beam_mix.md").write_text(markdown(results), encoding="utf-8")
    return results


def markdown(results: dict[str, Any]) -> str:
    config, runs = results["config"], results["runs"]

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = ["# Greedy latency with beam-search requests mixed in", "",
             f"Command: `{results['command']}`", "",
             (f"Machine: {results['machine'].get('cpu')}, {results['machine'].get('cpu_count')} cores. Greedy "
              f"capacity {results['greedy_capacity_sentences_per_s']:.1f} sentences/s at concurrency "
              f"{config['concurrency']}; offered {results['offered_rate']:.1f} requests/s ({config['load']:.0%}); "
              f"{config['beam_share']:.0%} of them beam {config['beam_size']} in the mixed runs; "
              f"{config['slices']} slices of {config['slice_s']:.0f} s each way."), "",
             "| run | requests | p50 s | p95 s | p99 s | errors |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['sentences']} | {cell(run['latency_p50_s'])} | {cell(run['latency_p95_s'])} "
                     f"| {cell(run['latency_p99_s'])} | {run['errors']} |")
    lines += ["", (f"Greedy p95 mixed / greedy only: **{cell(results['greedy_p95_ratio'])}** "
              f"(bound ≤ {results['bound']}: {results['status']})"), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--model", default="translate-en-it")
    parser.add_argument("--out", type=Path, default=Path("bench/results/beam_mix"))
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--load", type=float, default=0.6, help="offered rate / greedy capacity (default 0.6)")
    parser.add_argument("--concurrency", type=int, default=64, help="of the capacity run (default 64)")
    parser.add_argument("--slices", type=int, default=6)
    parser.add_argument("--slice-s", type=float, default=20.0)
    parser.add_argument("--beam-share", type=float, default=0.1)
    parser.add_argument("--beam-size", type=int, default=4)
    args = parser.parse_args(argv)
    texts = read_lines(args.data_dir / args.model / "test.src", args.sentences)
    results = run(args.models, texts, args.out, args.load, args.concurrency, args.slices, args.slice_s,
                  args.beam_share, args.beam_size, command=shlex.join(["python", "-m", "bench.beam_mix",
                                                                       *(argv or sys.argv[1:])]))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
