"""Serving levers, one at a time: the service at one closed-loop concurrency (or one open-loop
rate) with one flag changed.

    python -m bench.levers --models models --data-dir data --out bench/results/levers

For each variant it starts `attnserve serve` (CPU, the translation model's test sentences),
warms it up, runs the closed loop, and records throughput, latency percentiles, the server's
CPU seconds and its batching counters; it writes `<out>/levers.json` and `<out>/levers.md`.
The variants run in turn `--repeats` times (ABC ABC ...), so a drift of the machine's speed
during the run shows as spread instead of favouring whichever ran last; the table gives each
variant's median run and the range.

With `--rate R`, each run is an open loop instead: Poisson arrivals at R requests/s for
`--duration-s` seconds (the latency columns then count from each request's scheduled arrival).

With `--baseline DIR`, one more variant runs the defaults from the code of another checkout
(e.g. `git worktree add DIR <commit>`; run in DIR, its packages first on the path, serving its
own models when `--models` is a relative path) in the same turns: a change to the code or the
models measured against the commit before it; `--baseline-variant NAME` gives that checkout one
variant's flags instead of the defaults.

While the load runs it reads, twice a second, how many connections each serving process holds
(`connections_per_process`: with `--workers`, each worker's), and keeps the reading with the
most: how evenly the connections spread over the processes.

Each run records the server's CPU seconds and, of them, its event loop's (the main thread's:
HTTP, validation, tokenization, responses) per request; the rest is the batch workers'. It also
records the load generator's CPU per request (this process's while the load runs: the load
generator's, and a sampler of the server's memory ten times a second), which takes its share of
the server's cores when both run on one machine.

With `--ctranslate2`, CTranslate2 int8 `translate_batch` on the same weights and sentences
(in-process, no HTTP: the reference of the throughput target) runs in the same turns, and
the table gives each variant's throughput as a ratio of it. Its setting is tuned first, as its
users would tune it: the best point of its grid of replicas, threads and batch sizes over the
same sentences (`tuned_ctranslate2`, recorded in the results); `--ctranslate2-setting` gives
one instead (e.g. the best point of `attnserve bench`'s grid). At `--concurrency 1` (closed loop)
CTranslate2 translates one sentence per call instead, at its thread pair of the lowest
single-sentence p50, and the ratio is of the p50 latencies (ours / its single-sentence p50: the
latency target's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import load, machine
from bench import workload as workload_module
from bench.servers import service_process

logger = logging.getLogger(__name__)

# variant -> extra `attnserve serve` flags (after the defaults, so they win)
VARIANTS: dict[str, list[str]] = {
    "defaults (continuous batching)": [],
    "one batch worker (one running batch on all cores)": ["--batch-workers", "1"],
    "three batch workers": ["--batch-workers", "3"],
    "four batch workers": ["--batch-workers", "4"],
    # each process has its own models, event loop and interpreter lock (`--workers`)
    "two server processes, one batch worker and thread each": [
        "--workers", "2", "--batch-workers", "1", "--threads", "1"],
    "three server processes, one batch worker and thread each": [
        "--workers", "3", "--batch-workers", "1", "--threads", "1"],
    "two server processes, max_batch_size 32 (groups of 8 join)": [
        "--workers", "2", "--batch-workers", "1", "--threads", "1", "--max-batch-size", "32"],
    "batch workers take the least loaded, not by length": ["--no-length-routing"],
    "request-level (dynamic) batching": ["--no-continuous-batching"],
    "request-level batching, two batch workers": ["--no-continuous-batching", "--batch-workers", "2"],
    "continuous, rows join at once (no groups)": ["--max-join-wait-ms", "0"],
    "two server processes, rows join at once (no groups)": [
        "--workers", "2", "--batch-workers", "1", "--threads", "1", "--max-join-wait-ms", "0"],
    "two server processes, a group waits at most 20 ms": [
        "--workers", "2", "--batch-workers", "1", "--threads", "1", "--max-join-wait-ms", "20"],
    "continuous, a group waits at most 30 ms": ["--max-join-wait-ms", "30"],
    "continuous, a group waits at most 300 ms": ["--max-join-wait-ms", "300"],
    "continuous, rows join a batch of any age": ["--max-join-age", "0"],
    "continuous, max_batch_size 32": ["--max-batch-size", "32"],
    "onnxruntime threads spin between calls": ["--spinning"],
    "two onnxruntime threads per session (workers share them)": ["--threads", "2"],
    "onnxruntime CPU memory arena on": ["--cpu-memory-arena"],
    "max_batch_tokens 16384": ["--max-batch-tokens", "16384"],
    "vocabulary shortlist at steps of at most 8 rows": ["--shortlist-rows", "8"],
    "vocabulary shortlist for a row decoding alone": ["--shortlist-rows", "1"],
    "greedy results scored (a log-softmax per step)": ["--greedy-scores"],
    "request-level batching, greedy results scored": ["--no-continuous-batching", "--greedy-scores"],
}


BASELINE = "defaults, baseline checkout"


def baseline_name(variant: str | None) -> str:
    """The name of the baseline checkout's runs: with `variant`'s flags, or the defaults."""
    return BASELINE if variant is None else f"{variant}, baseline checkout"


def connections_per_process(pid: int, port: int) -> list[int]:
    """The connections on `port` that each serving process of the server `pid` holds, fewest
    first: its descendants listening on `port` (the workers), or else `pid` itself (a supervisor
    that holds the workers' shared socket serves nothing)."""
    def held(process: psutil.Process) -> int | None:  # None: not listening on `port`
        try:
            mine = [c for c in process.net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
        except psutil.Error:
            return None
        if not any(c.status == psutil.CONN_LISTEN for c in mine):
            return None
        return sum(c.status == psutil.CONN_ESTABLISHED for c in mine)

    server = psutil.Process(pid)
    workers = [n for n in map(held, server.children(recursive=True)) if n is not None]
    alone = held(server)
    return sorted(workers) if workers else [] if alone is None else [alone]


class ConnectionSampler:
    """Reads `connections_per_process` twice a second in a thread while the load runs and keeps
    the sample with the most connections (the load generator's pool all open)."""

    def __init__(self, pid: int, port: int, interval_s: float = 0.5) -> None:
        self.pid, self.port, self.interval_s = pid, port, interval_s
        self.busiest: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                counts = connections_per_process(self.pid, self.port)
            except psutil.Error:
                return
            if sum(counts) > sum(self.busiest):
                self.busiest = counts

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def event_loop_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the main threads of a process and its children: the server's
    event loop, or with `--workers` each worker process's (and the supervisor's, which idles)."""
    total = 0.0
    process = psutil.Process(pid)
    for member in [process, *process.children(recursive=True)]:
        try:
            thread = next(t for t in member.threads() if t.id == member.pid)
        except (psutil.NoSuchProcess, StopIteration):
            continue
        total += thread.user_time + thread.system_time
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children."""
    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        times = p.cpu_times()
        total += times.user + times.system
    return total


def measure(models_dir: Path, model: str, texts: list[str], concurrency: int, flags: list[str],
            log_path: Path, rate: float | None = None, duration_s: float = 30.0,
            checkout: Path | None = None) -> dict[str, Any]:
    """One server with `flags` (from the code of `checkout`, if given, serving the checkout's own
    `models_dir` when that path is relative): warm-up, then the closed loop over `texts` (or,
    with `rate`, an open loop for `duration_s`)."""
    server = service_process(models_dir, log_path, flags, checkout, env={"ATTNSERVE_MAX_TEXT_CHARS": "100000"})
    server.start()
    try:
        url = server.url + "/v1/translate"  # the repository's translation model
        asyncio.run(load.closed_loop(url, load.text_bodies(texts[: 2 * concurrency]), concurrency))  # warm-up
        assert server.process is not None
        cpu_before = cpu_seconds(server.process.pid)
        loop_before = event_loop_cpu_seconds(server.process.pid)
        generator_before = time.process_time()  # this process's CPU: the load generator's
        port = int(server.url.rsplit(":", 1)[1])
        sampler = ConnectionSampler(server.process.pid, port)
        sampler.start()
        try:
            if rate is None:
                result = asyncio.run(load.closed_loop(url, load.text_bodies(texts), concurrency))
            else:
                result = asyncio.run(load.open_loop(url, load.text_bodies(texts), rate, duration_s))
        finally:
            sampler.stop()
        generator_cpu = time.process_time() - generator_before
        cards = httpx.get(server.url + "/v1/models", timeout=10).json()["models"]
        cpu = cpu_seconds(server.process.pid) - cpu_before
        loop_cpu = event_loop_cpu_seconds(server.process.pid) - loop_before
    finally:
        peak = server.stop()
    stats = result.stats().to_dict()
    batching = next(c["batching"] for c in cards if c["name"] == model)
    answered = max(len(result.samples), 1)
    return {**stats, "flags": flags, "server_cpu_s": round(cpu, 2), "event_loop_cpu_s": round(loop_cpu, 2),
            "event_loop_ms_per_request": round(1000 * loop_cpu / answered, 3),
            "load_generator_ms_per_request": round(1000 * generator_cpu / answered, 3),
            "peak_rss_mb": round(peak, 1), "batching": batching,
            "connections_per_process": sampler.busiest}


def ctranslate2_reference(model_dir: Path, workload: workload_module.Workload, out_dir: Path,
                          setting: tuple[int, int, int, str] | None = None,
                          single: bool = False) -> Callable[[], dict[str, Any]]:
    """A function that times one CTranslate2 int8 greedy `translate_batch` over the workload,
    at `setting` (replicas, intra threads (0: its default), batch size, batch type "examples" or
    "tokens"; by default one replica, default threads, 64 examples); with `single`, one sentence
    per call."""
    from bench import ctranslate2_runs
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.model")
    pieces = [tokenizer.pieces(ids) for ids in workload.source_ids]
    replicas, threads, batch, batch_type = setting or (1, 0, ctranslate2_runs.MAX_BATCH_SIZE, "examples")
    run = ctranslate2_runs.int8_greedy(model_dir, out_dir, pieces, read_manifest(model_dir).max_target_len,
                                       ctranslate2_runs.Ct2Settings(replicas, threads, batch, batch_type), single)

    def measure_once() -> dict[str, Any]:
        return {**run().to_dict(), "flags": [], "max_batch_size": 1 if single else batch, "batch_type": batch_type,
                "replicas": replicas, "intra_threads": threads, "single": single}

    return measure_once


def tuned_ctranslate2(model_dir: Path, workload: workload_module.Workload, out_dir: Path,
                      single: bool = False, single_sentences: int = 100) -> tuple[tuple[int, int, int, str], dict[str, Any]]:
    """CTranslate2's setting as its users would tune it on this machine, before the turns: the
    best point of its grid (`ctranslate2_runs.settings_grid`: replicas x threads x batch sizes)
    over the workload, or with `single` the thread pair of the lowest single-sentence p50 over the
    first `single_sentences` sentences. Returns the setting (replicas, intra threads, batch,
    batch type) and the grid's points."""
    from bench import ctranslate2_converter, ctranslate2_runs
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.model")
    pieces = [tokenizer.pieces(ids) for ids in workload.source_ids]
    ct2_dir = ctranslate2_converter.convert(model_dir, out_dir / "ctranslate2-grid")
    limit = read_manifest(model_dir).max_target_len
    if single:
        grid = [ctranslate2_runs.Ct2Settings(inter, intra) for inter, intra in ctranslate2_runs.thread_grid()]
        found = ctranslate2_runs.run_grid(ct2_dir, "int8", pieces[:single_sentences], limit, grid,
                                          single=pieces[:single_sentences])
        best = found["best_single"]["settings"]
    else:
        found = ctranslate2_runs.run_grid(ct2_dir, "int8", pieces, limit, ctranslate2_runs.settings_grid())
        best = found["best"]["settings"]
    setting = (best["inter_threads"], best["intra_threads"], best["max_batch_size"], best["batch_type"])
    logger.info("CTranslate2 tuned: %s", setting)
    return setting, found


def _rss_range(run: dict[str, Any]) -> str:
    """The server's peak RSS over the variant's runs (its processes together), min-max."""
    peaks = [r["peak_rss_mb"] for r in run["runs"] if "peak_rss_mb" in r]
    return f"{min(peaks):.0f}-{max(peaks):.0f}" if peaks else "-"


def _cache_mb(run: dict[str, Any]) -> str:
    """The most bytes the median run's running batches held at once (`max_cache_bytes` of the
    model's card: with `--workers`, the worker that answered), in MiB."""
    held = run["batching"].get("max_cache_bytes")
    return f"{held / 2**20:.1f}" if held is not None else "-"


def markdown(results: dict[str, Any]) -> str:
    load = (f"an offered load of {results['rate']:g} requests/s (open loop, {results['duration_s']:g} s)"
            if results.get("rate") else f"concurrency {results['concurrency']}")
    lines = [f"# Serving levers at {load}", "",
             (f"{results['sentences']} translation sentences of the {results.get('split', 'test')} set per run "
              "(cycled in the open loop), "
              f"{results['repeats']} runs per variant (in turn); sentences/s: median (min-max); the other "
              f"columns: the median run ({'by p95' if results.get('rate') else 'by sentences/s'})."), "",
             f"Command: `{results['command']}`", "",
             f"Machine: {results['machine'].get('cpu', '?')}, {results['machine'].get('cpu_count', '?')} cores", "",
             ("| variant | flags | sentences/s | p50 s | p95 s | server CPU s | event loop ms/request "
              "| load generator ms/request | joins (batches) | peak RSS MB, all runs | batch cache MB, most "
              "| failed requests, all runs | vs CTranslate2 |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    reference = results.get("ctranslate2")
    single = bool(reference and reference.get("single"))
    if single:
        lines[2] += " At concurrency 1 the last column is p50 / CTranslate2's single-sentence p50."
    for name, run in results["variants"].items():
        speeds = [r["sentences_per_s"] for r in run["runs"]]
        ratio = "-"
        if reference:
            ratio = (f"{run['latency_p50_s'] / reference['latency_p50_s']:.2f}" if single
                     else f"{run['sentences_per_s'] / reference['sentences_per_s']:.2f}")
        lines.append(f"| {name} | `{' '.join(run['flags']) or '-'}` | {run['sentences_per_s']:.1f} "
                     f"({min(speeds):.1f}-{max(speeds):.1f}) | "
                     f"{run['latency_p50_s']:.3f} | {run['latency_p95_s']:.3f} | {run['server_cpu_s']:.1f} | "
                     f"{_loop_ms(run)} | {_loop_ms(run, 'load_generator_ms_per_request')} | "
                     f"{run['batching']['batches']} | {_rss_range(run)} | {_cache_mb(run)} "
                     f"| {sum(r.get('errors', 0) for r in run['runs'])} | {ratio} |")
    if reference:
        speeds = [r["sentences_per_s"] for r in reference["runs"]]
        setting = (f"{reference.get('replicas', 1)} replica(s) x {reference.get('intra_threads', 0) or 'default'} "
                   f"threads, batches of {reference['max_batch_size']} {reference.get('batch_type', 'examples')}")
        if single:
            setting = f"{reference.get('replicas', 1)} replica(s) x {reference.get('intra_threads', 0) or 'default'} threads"
            lines.append(f"| CTranslate2 int8, one sentence per call (in-process, {setting}) | - | "
                         f"{reference['sentences_per_s']:.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | "
                         f"{reference['latency_p50_s']:.3f} | {reference['latency_p95_s']:.3f} | - | - | - | - | - | - | - | 1.00 |")
        else:
            lines.append(f"| CTranslate2 int8 `translate_batch` (in-process, {setting}) | - | "
                         f"{reference['sentences_per_s']:.1f} "
                         f"({min(speeds):.1f}-{max(speeds):.1f}) | - | - | - | - | - | - | - | - | - | 1.00 |")
    spread = [(name, run) for name, run in results["variants"].items() if len(run.get("connections_per_process", [])) > 1]
    if spread:
        lines += ["", ("Connections each server process held when most were open (fewest first): the median run's; "
                       "the fewest any process held in any run:")]
        lines += [f"- {name}: {'/'.join(map(str, run['connections_per_process']))}; "
                  f"{min(min(r['connections_per_process']) for r in run['runs'] if r.get('connections_per_process'))}"
                  for name, run in spread]
    tuning = results.get("ctranslate2_tuning")
    if tuning:
        def point(p: dict[str, Any]) -> str:
            where = p["settings"]
            name = f"{where['inter_threads']}x{where['intra_threads'] or 'default'}"
            if single:
                return f"{name} threads {p['latency_p50_s']:.3f} s"
            return f"{name} threads, {where['max_batch_size']} {where['batch_type']} {p['sentences_per_s']:.1f}/s"
        points = tuning["single_points"] if single else tuning["points"]
        lines += ["", ("CTranslate2's setting, tuned once before the turns (replicas x threads"
                       + (", its single-sentence p50): " if single else ", batches: sentences/s): ")
                       + "; ".join(point(p) for p in points) + ".")]
    return "\n".join(lines) + "\n"


def _loop_ms(run: dict[str, Any], key: str = "event_loop_ms_per_request") -> str:
    """A run's CPU ms per request, the event loop's (or another `key`: the load generator's): the
    median run's (min-max over the runs)."""
    values = [r[key] for r in run["runs"] if key in r]
    if not values:
        return "-"
    return f"{run[key]:.2f} ({min(values):.2f}-{max(values):.2f})"


def _run_in_turns(args: argparse.Namespace, workload: workload_module.Workload,
                  runs: dict[str, list[dict[str, Any]]],
                  reference: Callable[[], dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`args.repeats` rounds of every variant (and the reference first); returns its runs."""
    reference_runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        if reference is not None:
            reference_runs.append(reference())
            logger.info("CTranslate2 int8: %.1f sentences/s", reference_runs[-1]["sentences_per_s"])
        for index, name in enumerate(args.variants):
            logger.info("%s (run %d) ...", name, repeat + 1)
            baseline = name == baseline_name(args.baseline_variant)
            flags = VARIANTS.get(args.baseline_variant or "", []) if baseline else VARIANTS.get(name, [])
            run = measure(args.models, args.model, workload.texts, args.concurrency, flags,
                          args.out / "logs" / f"{index}-{repeat}.log", args.rate, args.duration_s,
                          checkout=args.baseline if baseline else None)
            logger.info("%s: %.1f sentences/s", name, run["sentences_per_s"])
            runs[name].append(run)
    return reference_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/levers"))
    parser.add_argument("--model", default="translate-en-it", help="the translation model of --models (the one /v1/translate serves)")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--split", choices=workload_module.SPLITS, default="test",
                        help="the sentences: the test split or the other set (<data-dir>/<model>/<split>.src)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=None, help="open loop at this many requests/s instead")
    parser.add_argument("--duration-s", type=float, default=30.0, help="length of each open-loop run")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--baseline", type=Path, default=None,
                        help="also run the defaults from the code of this checkout, in the same turns")
    parser.add_argument("--baseline-variant", choices=list(VARIANTS), default=None,
                        help="the flags of this variant for the --baseline checkout (default: none)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, in turn")
    parser.add_argument("--ctranslate2", action="store_true",
                        help="also time CTranslate2 int8 translate_batch in the same turns (needs ctranslate2), "
                        "at the best point of its grid found first (at concurrency 1: its best thread pair "
                        "for one sentence)")
    parser.add_argument("--ctranslate2-setting", nargs=4, metavar=("REPLICAS", "THREADS", "BATCH", "TYPE"),
                        default=None, help="CTranslate2's setting instead of tuning it, e.g. the best point of "
                        "`attnserve bench`'s grid: 2 1 32 examples")
    args = parser.parse_args(argv)
    setting = None
    if args.ctranslate2_setting is not None:
        replicas, threads, batch, batch_type = args.ctranslate2_setting
        if not (replicas.isdigit() and threads.isdigit() and batch.isdigit()) or batch_type not in ("examples", "tokens"):
            parser.error("--ctranslate2-setting: REPLICAS THREADS BATCH as integers, TYPE examples or tokens")
        setting = (int(replicas), int(threads), int(batch), batch_type)
    if args.baseline is not None:
        args.variants = [baseline_name(args.baseline_variant), *args.variants]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    folder = args.models / args.model
    tokenizer = Tokenizer.from_file(folder / "tokenizer.model")
    workload = workload_module.load(args.data_dir, args.model, "translate", tokenizer,
                                    read_manifest(folder).max_source_len, args.sentences, args.split)
    results: dict[str, Any] = {
        "command": "python -m bench.levers " + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": machine.describe(), "concurrency": args.concurrency, "sentences": len(workload),
        "split": args.split,
        "rate": args.rate, "duration_s": args.duration_s,
        "repeats": args.repeats, "variants": {},
    }
    if args.baseline is not None:
        results["baseline_commit"] = subprocess.run(
            ["git", "-C", str(args.baseline), "rev-parse", "HEAD"], capture_output=True, text=True,
            check=False).stdout.strip() or None
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory(prefix="levers-") as scratch:
        single = args.concurrency == 1 and args.rate is None  # the latency target's reference
        if args.ctranslate2 and setting is None:  # tuned as its users would, not its defaults
            setting, results["ctranslate2_tuning"] = tuned_ctranslate2(folder, workload, Path(scratch), single)
        reference = (ctranslate2_reference(folder, workload, Path(scratch), setting, single)
                     if args.ctranslate2 or setting else None)
        reference_runs = _run_in_turns(args, workload, runs, reference)
    median_by = "latency_p95_s" if args.rate else "sentences_per_s"  # open loop: all keep the rate
    for name, variant_runs in runs.items():
        ordered = sorted(variant_runs, key=lambda r: r[median_by])
        results["variants"][name] = {**ordered[len(ordered) // 2], "runs": variant_runs}
    if reference_runs:
        ordered = sorted(reference_runs, key=lambda r: r["latency_p50_s"] if r["single"] else r["sentences_per_s"])
        results["ctranslate2"] = {**ordered[len(ordered) // 2], "runs": reference_runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "levers.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (args.out / "levers.md").write_text(markdown(results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
