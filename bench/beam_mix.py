"""Greedy latency with beam-search requests mixed in: does a beam request hold back the greedy
rows of the running batch?

One server (continuous batching, its defaults) gets Poisson arrivals of translation requests at
`--load` times its greedy closed-loop throughput (measured first at `--concurrency`). In each
slice the same arrivals are sent in turns, each arm once:
- `greedy_only`: the requests that ask for beam search (a share `--beam-share`, `--beam-size`)
  left out;
- `mixed`: all of them;
- `as_greedy`: each beam request sent as `--beam-size` greedy requests of its text at its
  arrival time, about the rows of work the beam request brings, without beam search.
The greedy requests are the same in every arm, so the ratio of their p95 latencies (mixed /
greedy only) is what the beam requests cost them; the issue's bound is 1.5. The `as_greedy`
ratio is what the same extra work costs when it is greedy: a mixed ratio near it means the beam
requests cost the greedy rows their work and no blocking. Slices rotate which arm goes first.

With `--baseline DIR`, a second server from the code of another checkout (serving its own
models when `--models` is relative) runs every arm of every slice too, at the same offered rate,
the servers taking turns. Results: `<out>/beam_mix.json` and `.md`.

    python -m bench.beam_mix --models models --data-dir data --out bench/results/beam_mix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import machine
from bench.load import LoadResult, arrival_times, client, closed_loop, request, text_bodies
from bench.servers import ServerProcess, service_process
from bench.workload import read_lines

BOUND = 1.5  # greedy p95 with beam requests mixed in / greedy-only p95
STAGES = ("queue", "join", "inference", "total", "client")  # the Server-Timing stages the report shows
ARMS = ("greedy_only", "mixed", "as_greedy")
THIS = "this checkout"
BASELINE = "baseline checkout"


def beam_requests(count: int, share: float, seed: int) -> list[bool]:
    """Which of `count` requests ask for beam search: each with probability `share`, seeded."""
    rng = random.Random(seed)
    return [rng.random() < share for _ in range(count)]


async def mixed_open_loop(url: str, texts: Sequence[str], rate: float, duration_s: float, beams: Sequence[bool],
                          beam_size: int, arm: str, seed: int, first_text: int = 0
                          ) -> tuple[LoadResult, LoadResult]:
    """Poisson arrivals at `rate` for `duration_s`; request i asks for beam search when
    `beams[i]`, in the way of `arm` (`ARMS`: left out, sent, or sent as `beam_size` greedy
    requests). Returns (greedy, the beam requests' or their stand-ins') results; latencies count
    from the scheduled arrival."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}")
    offsets = [o for o in arrival_times(rate, len(beams), seed) if o < duration_s]
    async with client(0) as session:
        t0 = time.perf_counter()
        tasks, kinds = [], []
        for i, offset in enumerate(offsets):
            if beams[i] and arm == "greedy_only":
                continue
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            text = texts[(first_text + i) % len(texts)]
            if beams[i] and arm == "mixed":
                bodies = [{"text": text, "beam_size": beam_size}]
            else:
                bodies = [{"text": text}] * (beam_size if beams[i] else 1)
            for body in bodies:
                tasks.append(asyncio.create_task(request(session, url, body, t0, since=t0 + offset)))
                kinds.append(beams[i])
        samples = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    greedy = LoadResult(duration_s, [s for s, b in zip(samples, kinds, strict=True) if not b], elapsed_s=elapsed)
    beam = LoadResult(duration_s, [s for s, b in zip(samples, kinds, strict=True) if b], elapsed_s=elapsed)
    return greedy, beam


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


def _summary(pooled: dict[str, LoadResult]) -> dict[str, Any]:
    """One server's pooled runs and its ratios."""
    runs = {name: result.stats().to_dict() | {"server_timing_p95_ms": result.server_timing_ms(0.95)}
            for name, result in pooled.items()}
    only = runs["greedy_only"]["latency_p95_s"]
    ratio = _ratio(runs["mixed_greedy"]["latency_p95_s"], only)
    return {"runs": runs, "greedy_p95_ratio": ratio,
            "as_greedy_p95_ratio": _ratio(runs["as_greedy_greedy"]["latency_p95_s"], only),
            "status": "not measured" if ratio is None else ("met" if ratio <= BOUND else "missed")}


def run(models_dir: Path, texts: Sequence[str], out_dir: Path, load: float, concurrency: int, slices: int,
        slice_s: float, beam_share: float, beam_size: int, command: str = "",
        baseline: Path | None = None, flags: Sequence[str] = (),
        baseline_flags: Sequence[str] = ()) -> dict[str, Any]:
    """The measurement described in the module docstring; writes and returns the results. `flags`
    are given to this checkout's server, `baseline_flags` to the baseline's."""
    servers: dict[str, ServerProcess] = {THIS: service_process(models_dir, out_dir / "logs" / "beam_mix-service.log",
                                                               flags=flags)}
    if baseline is not None:
        servers[BASELINE] = service_process(models_dir, out_dir / "logs" / "beam_mix-baseline.log",
                                            flags=baseline_flags, checkout=baseline)
    pooled = {name: {run: LoadResult() for run in ("greedy_only", "mixed_greedy", "mixed_beam",
                                                   "as_greedy_greedy", "as_greedy_extra")}
              for name in servers}
    per_slice: list[dict[str, Any]] = []
    try:
        for server in servers.values():
            server.start()
            asyncio.run(closed_loop(f"{server.url}/v1/translate", text_bodies(texts[:4]), 2))  # warm-up
        url = f"{servers[THIS].url}/v1/translate"
        capacity = asyncio.run(closed_loop(url, text_bodies(texts), concurrency, 30.0)).stats().sentences_per_s
        rate = load * capacity
        turns = [(name, arm) for name in servers for arm in ARMS]
        for index in range(slices):
            count = max(1, int(rate * slice_s * 2))
            beams = beam_requests(count, beam_share, seed=index)
            shift = index % len(turns)
            entry: dict[str, Any] = {}
            for name, arm in turns[shift:] + turns[:shift]:
                greedy, other = asyncio.run(mixed_open_loop(
                    f"{servers[name].url}/v1/translate", texts, rate, slice_s, beams, beam_size, arm,
                    seed=index, first_text=index * count))
                runs = pooled[name]
                if arm == "greedy_only":
                    runs["greedy_only"].merge(greedy)
                elif arm == "mixed":
                    runs["mixed_greedy"].merge(greedy)
                    runs["mixed_beam"].merge(other)
                else:
                    runs["as_greedy_greedy"].merge(greedy)
                    runs["as_greedy_extra"].merge(other)
                entry[f"{name}: {arm} greedy p95 s"] = greedy.stats().latency_p95_s
            per_slice.append(entry)
    finally:
        for server in servers.values():
            server.stop()
    summaries = {name: _summary(runs) for name, runs in pooled.items()}
    mine = summaries[THIS]
    results: dict[str, Any] = {
        "command": command, "machine": machine.describe(),
        "config": {"load": load, "concurrency": concurrency, "slices": slices, "slice_s": slice_s,
                   "beam_share": beam_share, "beam_size": beam_size, "flags": list(flags),
                   "baseline_flags": list(baseline_flags)},
        "greedy_capacity_sentences_per_s": capacity, "offered_rate": rate,
        "runs": mine["runs"], "slices": per_slice,
        "greedy_p95_ratio": mine["greedy_p95_ratio"], "as_greedy_p95_ratio": mine["as_greedy_p95_ratio"],
        "bound": BOUND, "status": mine["status"],
    }
    if baseline is not None:
        results["baseline"] = {"checkout": str(baseline), **summaries[BASELINE], "commit": subprocess.run(
            ["git", "-C", str(baseline), "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "beam_mix.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out_dir / "beam_mix.md").write_text(markdown(results), encoding="utf-8")
    return results


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def named(label: str, flags: Sequence[str]) -> str:
        return f"{label}, `{shlex.join(flags)}`" if flags else label

    servers = [(named(THIS, config.get("flags", [])), results)]
    if "baseline" in results:
        servers.append((named(f"{BASELINE} ({results['baseline']['commit'][:7]})", config.get("baseline_flags", [])),
                        results["baseline"]))
    lines = ["# Greedy latency with beam-search requests mixed in", "",
             f"Command: `{results['command']}`", "",
             (f"Machine: {results['machine'].get('cpu')}, {results['machine'].get('cpu_count')} cores. Greedy "
              f"capacity {results['greedy_capacity_sentences_per_s']:.1f} sentences/s at concurrency "
              f"{config['concurrency']}; offered {results['offered_rate']:.1f} requests/s ({config['load']:.0%}); "
              f"{config['beam_share']:.0%} of them beam {config['beam_size']} in the mixed runs (sent as "
              f"{config['beam_size']} greedy requests each in the as_greedy runs); {config['slices']} slices "
              f"of {config['slice_s']:.0f} s, every arm in each."), "",
             "| server | run | requests | p50 s | p95 s | p99 s | errors |", "|---|---|---|---|---|---|---|"]
    for label, summary in servers:
        for name, run in summary["runs"].items():
            lines.append(f"| {label} | {name} | {run['sentences']} | {cell(run['latency_p50_s'])} "
                         f"| {cell(run['latency_p95_s'])} | {cell(run['latency_p99_s'])} | {run['errors']} |")
    lines += ["", ("Each stage's own p95 over the run's requests, from their `Server-Timing` (ms; the stages "
                   "do not add up at a percentile):"), "",
              "| server | run | " + " | ".join(STAGES) + " |", "|---|---|" + "---|" * len(STAGES)]
    for label, summary in servers:
        for name, run in summary["runs"].items():
            stages = run.get("server_timing_p95_ms", {})
            lines.append(f"| {label} | {name} | " + " | ".join(
                "-" if stage not in stages else f"{stages[stage]:.1f}" for stage in STAGES) + " |")
    lines.append("")
    for label, summary in servers:
        lines.append(f"{label}: greedy p95 mixed / greedy only **{cell(summary['greedy_p95_ratio'])}** "
                     f"(bound ≤ {results['bound']}: {summary['status']}); as_greedy / greedy only "
                     f"{cell(summary['as_greedy_p95_ratio'])}.")
    lines.append("")
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
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout whose server runs every arm too, in turns")
    parser.add_argument("--flags", default="", help="serve flags of this checkout's server, one string "
                        "(e.g. --flags='--max-join-wait-ms 30')")
    parser.add_argument("--baseline-flags", default="", help="serve flags of the baseline's server")
    args = parser.parse_args(argv)
    texts = read_lines(args.data_dir / args.model / "test.src", args.sentences)
    results = run(args.models, texts, args.out, args.load, args.concurrency, args.slices, args.slice_s,
                  args.beam_share, args.beam_size, command=shlex.join(["python", "-m", "bench.beam_mix",
                                                                       *(argv or sys.argv[1:])]),
                  baseline=args.baseline, flags=shlex.split(args.flags),
                  baseline_flags=shlex.split(args.baseline_flags))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
