"""One translation request of many sentences at a time: its latency through the server.

    python -m bench.documents --models models --data-dir data --out bench/results/documents --baseline ../base

Each request is `--texts` texts of `--sentences-per-text` consecutive test sentences joined by
spaces (the server splits them into sentences again: one row each), sent one after the other to
`attnserve serve` with its defaults; the first `--warmup` requests are not timed. With
`--baseline DIR` the server of another checkout (serving its own models when `--models` is a
relative path) runs too, the two in alternating turns, each turn a fresh server and the same
requests. The report gives each server's median latency per turn and sentences/s over the timed
requests.

With `--singles-concurrency C`, each turn then runs the same requests back to back beside a
closed loop of C clients sending the first `--singles` test sentences one per request: what a
stream of large requests costs the small ones beside them (their p50 and p95), and the large
ones' latency meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import load, machine
from bench.servers import service_process

THIS = "this checkout"
BASELINE = "baseline checkout"


def request_bodies(sentences: list[str], texts: int, per_text: int, count: int) -> list[dict[str, Any]]:
    """`count` request bodies of `texts` texts of `per_text` consecutive sentences each, taking
    the sentences in order (cycled when they run out)."""
    size = texts * per_text
    bodies = []
    for index in range(count):
        chunk = [sentences[(index * size + i) % len(sentences)] for i in range(size)]
        bodies.append({"texts": [" ".join(chunk[t * per_text:(t + 1) * per_text]) for t in range(texts)]})
    return bodies


def time_requests(url: str, bodies: list[dict[str, Any]], warmup: int) -> list[float]:
    """Seconds of each request after the first `warmup`, sent one after the other to `url`."""
    latencies = []
    with httpx.Client(timeout=300) as client:
        for index, body in enumerate(bodies):
            started = time.perf_counter()
            response = client.post(url, json=body)
            took = time.perf_counter() - started
            if response.status_code != 200:
                raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
            if index >= warmup:
                latencies.append(took)
    return latencies


def beside_singles(url: str, bodies: list[dict[str, Any]], singles: list[str], concurrency: int) -> dict[str, Any]:
    """`bodies` sent back to back, over and over, while `concurrency` clients send `singles` one
    sentence per request (a closed loop, each once): the singles' p50 and p95, and the median
    latency of the large requests that ended while the singles ran."""
    stop = threading.Event()
    latencies: list[float] = []
    failures: list[str] = []

    def large() -> None:
        with httpx.Client(timeout=300) as client:
            index = 0
            while not stop.is_set():
                started = time.perf_counter()
                response = client.post(url, json=bodies[index % len(bodies)])
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text[:200]}")
                    return
                if not stop.is_set():
                    latencies.append(time.perf_counter() - started)
                index += 1

    sender = threading.Thread(target=large, name="large-requests")
    sender.start()
    try:
        result = asyncio.run(load.closed_loop(url, load.text_bodies(singles), concurrency))
    finally:
        stop.set()
        sender.join()
    if failures:
        raise RuntimeError(f"{url}: a large request failed: {failures[0]}")
    stats = result.stats()
    return {"singles_p50_s": stats.latency_p50_s, "singles_p95_s": stats.latency_p95_s,
            "singles_errors": result.errors, "large_requests": len(latencies),
            "large_median_s": round(statistics.median(latencies), 4) if latencies else None}


def run_turns(models_dir: Path, bodies: list[dict[str, Any]], warmup: int, turns: int, log_dir: Path,
              baseline: Path | None = None, singles: list[str] | None = None,
              concurrency: int = 0) -> tuple[dict[str, list[list[float]]], dict[str, list[dict[str, Any]]]]:
    """Each server's request latencies per turn (A B, B A, ...), a fresh server per turn; with
    `singles` and `concurrency`, each turn's run of them beside the large requests too
    (`beside_singles`)."""
    checkouts: dict[str, Path | None] = {THIS: None}
    if baseline is not None:
        checkouts[BASELINE] = baseline
    runs: dict[str, list[list[float]]] = {name: [] for name in checkouts}
    mixed: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for turn in range(turns):
        for name in (list(checkouts) if turn % 2 == 0 else list(checkouts)[::-1]):
            server = service_process(models_dir, log_dir / f"documents-{len(runs[name])}-{name.split()[0]}.log",
                                     checkout=checkouts[name])
            server.start()
            try:
                url = server.url + "/v1/translate"
                runs[name].append(time_requests(url, bodies, warmup))
                if singles and concurrency:
                    mixed[name].append(beside_singles(url, bodies, singles, concurrency))
            finally:
                server.stop()
    return runs, mixed


def markdown(result: dict[str, Any]) -> str:
    lines = ["# One request of many sentences", "", f"Command: `{result['command']}`", "",
             (f"{result['requests']} requests one after the other (after {result['warmup']} untimed), each "
              f"{result['texts']} texts of {result['sentences_per_text']} test sentences; {result['turns']} "
              "alternating turns, a fresh server each."), "",
             "| server | median s per request, per turn | median of the turns | sentences/s |", "|---|---|---|---|"]
    for name, medians in result["median_s"].items():
        lines.append(f"| {name} | {', '.join(f'{m:.3f}' for m in medians)} | {statistics.median(medians):.3f} | "
                     f"{result['sentences_per_s'][name]:.1f} |")
    if result.get("beside_singles"):
        lines += ["", (f"Beside {result['singles_concurrency']} clients sending {result['singles']} test sentences "
                       "one per request, per turn:"), "",
                  "| server | singles p50 s, per turn | singles p95 s, per turn | large requests' median s, per turn |",
                  "|---|---|---|---|"]
        for name, turns in result["beside_singles"].items():
            cells = [", ".join(f"{t[key]:.3f}" if t[key] is not None else "-" for t in turns)
                     for key in ("singles_p50_s", "singles_p95_s", "large_median_s")]
            lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.documents", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--sentences-per-text", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--baseline", type=Path, help="another checkout whose server runs in the same turns")
    parser.add_argument("--singles-concurrency", type=int, default=0,
                        help="also run the large requests beside this many clients of single sentences")
    parser.add_argument("--singles", type=int, default=1000, help="single sentences those clients send")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sentences = (args.data_dir / "translate-en-it" / "test.src").read_text(encoding="utf-8").splitlines()
    bodies = request_bodies(sentences, args.texts, args.sentences_per_text, args.warmup + args.requests)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="documents-") as logs:  # server logs name this machine's paths
        runs, mixed = run_turns(args.models, bodies, args.warmup, args.turns, Path(logs), args.baseline,
                                sentences[:args.singles], args.singles_concurrency)
    per_request = args.texts * args.sentences_per_text
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.documents", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine.describe(), "texts": args.texts, "sentences_per_text": args.sentences_per_text,
        "requests": args.requests, "warmup": args.warmup, "turns": args.turns, "latencies_s": runs,
        "median_s": {name: [round(statistics.median(turn), 4) for turn in turns] for name, turns in runs.items()},
        "sentences_per_s": {name: round(per_request * sum(map(len, turns)) / sum(map(sum, turns)), 1)
                            for name, turns in runs.items()},
        "singles_concurrency": args.singles_concurrency, "singles": args.singles,
        "beside_singles": mixed if args.singles_concurrency else {},
    }
    (args.out / "documents.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "documents.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
