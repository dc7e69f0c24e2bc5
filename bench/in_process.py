"""The ceiling: the service's ONNX models and generation loops called in-process, no HTTP, no
batcher; tuned over a grid as CTranslate2 is (engine, batch size, replicas x threads)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import machine
from bench.stats import RunStats, summarise
from bench.workload import SPLITS
from service.batching.slot_batch import generate_running
from service.generation.hooks import RowHooks
from service.generation.sampling import Sampling
from service.generation.search import GenerationResult, generate
from service.process.offline import Shared
from service.runtime import CPU, ModelRuntime

logger = logging.getLogger(__name__)


def load_runtime(model_dir: Path, threads: int = 0, variant: str | None = None,
                 providers: Sequence[str] = (CPU,)) -> ModelRuntime:
    """The model as the service would load it (its default variant unless `variant` is given)."""
    runtime = ModelRuntime.load(model_dir, list(providers), threads=threads, variant=variant)
    runtime.warmup()
    return runtime


def run_batches(runtime: ModelRuntime, sources: list[list[int]], batch_size: int, beam_size: int = 1,
                max_new_tokens: int | None = None,
                sort_by_length: bool = False) -> tuple[RunStats, list[GenerationResult]]:
    """Generate for `sources` in consecutive batches of `batch_size` rows; outputs in workload order.

    `sort_by_length` batches sources of similar length together (less padding), the lever the
    service's batcher could use. Latency of a sentence = the wall time of its batch. Tokens exclude EOS.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    limit = max_new_tokens or runtime.max_target_len
    order = list(range(len(sources)))
    if sort_by_length:
        order.sort(key=lambda i: len(sources[i]))
    latencies: list[float] = []
    outputs: dict[int, GenerationResult] = {}
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch_started = time.perf_counter()
        generated = generate(runtime, [sources[i] for i in rows], beam_size, limit, greedy_scores=False)
        latencies += [time.perf_counter() - batch_started] * len(rows)
        outputs.update(zip(rows, generated, strict=True))
    elapsed = time.perf_counter() - started
    ordered = [outputs[i] for i in range(len(sources))]
    return summarise(latencies, sum(len(o.tokens) for o in ordered), elapsed), ordered


ENGINES = ("batches", "running", "running-sorted")
CTRANSLATE2 = "CTranslate2"  # its row in `turns`


@dataclass(frozen=True)
class InProcessSettings:
    """One in-process run, as a user tunes it: the engine (`batches`: request-level `generate`
    over batches of `size` sources of similar length; `running`: `generate_running`, a running
    batch of `size` slots taking the sources in workload order, as the server takes requests;
    `running-sorted`: the same taking them shortest first, as `batches` and CTranslate2's
    `translate_batch` order a list they are given), `replicas` (threads, each running its own batches, taking the work from
    one shared queue as it goes), `threads` (intra-op threads of the sessions they share) and, for
    the running engines, `join_at` (newcomers take the free slots once at least that many are
    free, as the server's join policy groups them; `generate_running`)."""

    engine: str
    size: int
    replicas: int = 1
    threads: int = 1
    join_at: int = 1

    def __post_init__(self) -> None:
        if self.engine not in ENGINES or min(self.size, self.replicas, self.threads, self.join_at) < 1:
            raise ValueError(f"engine one of {ENGINES}, size, replicas, threads and join_at >= 1: {self}")
        if self.join_at > 1 and (self.engine == "batches" or self.join_at > self.size):
            raise ValueError(f"join_at is for a running engine, at most its size: {self}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def thread_grid(cores: int | None = None) -> list[tuple[int, int]]:
    """(replicas, threads) pairs covering `cores` cores: one replica on every core, one
    single-threaded replica per core, and two replicas sharing the cores when there are at least
    four (CTranslate2's grid, `bench.ctranslate2_runs.thread_grid`, without its default)."""
    cores = cores or os.cpu_count() or 1
    pairs = [(1, cores), (cores, 1)]
    if cores >= 4:
        pairs.append((2, cores // 2))
    return list(dict.fromkeys(pairs))


def settings_grid(sizes: Sequence[int] = (32, 64), cores: int | None = None) -> list[InProcessSettings]:
    """Every engine at every size of `sizes` with every pair of `thread_grid`; the running engines
    also with newcomers joining once a quarter of the slots is free (the server's join group,
    `service.batching.policy.BatchLimits.join_rows`)."""
    return [InProcessSettings(engine, size, replicas, threads, join_at)
            for replicas, threads in thread_grid(cores) for engine in ENGINES for size in sizes
            for join_at in dict.fromkeys((1, *((max(1, size // 4),) if engine != "batches" else ())))]


def run_settings(runtime: ModelRuntime, sources: list[list[int]], settings: InProcessSettings,
                 max_new_tokens: int | None = None,
                 sampling: Sampling | None = None) -> tuple[RunStats, list[GenerationResult]]:
    """Greedy outputs of `sources` (in workload order) at `settings` on `runtime` (loaded with
    `settings.threads`), or with `sampling` sampled ones, and the run's stats. Latency of a
    sentence: its batch's wall time (`batches`), or from its joining the running batch to its
    row's end (`running`)."""
    limit = max_new_tokens or runtime.max_target_len
    outputs: dict[int, GenerationResult] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    if settings.engine == "batches":
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        batches = Shared(order[start:start + settings.size] for start in range(0, len(order), settings.size))

        def replica() -> None:
            for rows in batches:
                started = time.perf_counter()
                hooks = None if sampling is None else [RowHooks(sampler=sampling.sampler(i)) for i in rows]
                generated = generate(runtime, [sources[i] for i in rows], 1, limit, hooks=hooks, greedy_scores=False)
                took = time.perf_counter() - started
                with lock:
                    latencies.extend([took] * len(rows))
                    outputs.update(zip(rows, generated, strict=True))
    else:
        joined: dict[int, float] = {}
        order = list(range(len(sources)))
        if settings.engine == "running-sorted":
            order.sort(key=lambda i: len(sources[i]))

        def timed() -> Iterator[tuple[int, list[int]]]:
            for i in order:
                joined[i] = time.perf_counter()
                yield i, sources[i]

        feed = Shared(timed())

        def replica() -> None:
            for i, result in generate_running(runtime, feed, settings.size, limit, join_at=settings.join_at,
                                              sampling=sampling):
                with lock:
                    latencies.append(time.perf_counter() - joined[i])
                    outputs[i] = result

    started = time.perf_counter()
    with ThreadPoolExecutor(settings.replicas) as pool:
        for future in [pool.submit(replica) for _ in range(settings.replicas)]:
            future.result()
    elapsed = time.perf_counter() - started
    ordered = [outputs[i] for i in range(len(sources))]
    return summarise(latencies, sum(len(o.tokens) for o in ordered), elapsed), ordered


def run_grid(model_dir: Path, sources: list[list[int]], grid: Sequence[InProcessSettings],
             max_new_tokens: int | None = None, variant: str | None = None,
             providers: Sequence[str] = (CPU,)) -> dict[str, Any]:
    """Every point of `grid` (one runtime loaded per thread count; running-batch points only for a
    model with a step graph): `points` (settings and stats each) and `best` (the highest
    sentences/s)."""
    points: list[dict[str, Any]] = []
    for threads in dict.fromkeys(s.threads for s in grid):
        runtime = load_runtime(model_dir, threads, variant, providers)
        for settings in (s for s in grid if s.threads == threads and (s.engine == "batches" or runtime.step)):
            stats, _ = run_settings(runtime, sources, settings, max_new_tokens)
            points.append({"settings": settings.to_dict(), **stats.to_dict()})
        del runtime
    return {"points": points, "best": max(points, key=lambda p: p["sentences_per_s"])}


def parse_settings(text: str) -> InProcessSettings:
    """`ENGINE:SIZE:REPLICAS:THREADS[:JOIN_AT]` (e.g. `running:64:2:1`, `running:64:2:1:16`) as settings."""
    engine, *numbers = text.split(":")
    if len(numbers) not in (3, 4) or not all(n.isdigit() for n in numbers):
        raise ValueError(f"expected ENGINE:SIZE:REPLICAS:THREADS[:JOIN_AT], got {text!r}")
    return InProcessSettings(engine, *map(int, numbers))


def turns(model_dir: Path, sources: list[list[int]], points: Sequence[InProcessSettings],
          count: int, ctranslate2: Callable[[], RunStats] | None = None,
          against: Path | None = None) -> dict[str, Any]:
    """`points` (and CTranslate2's `run`, when given; the same points on the repository
    `against`, when given, named `<point> against`) in `count` alternating turns (A B C, C B A,
    ...) on one machine state: each one's sentences/s per turn, and per turn the best point's
    throughput (of `model_dir`) over CTranslate2's."""
    runs: dict[str, Callable[[], RunStats]] = {}
    for directory, suffix in ((model_dir, ""), *(((against, " against"),) if against is not None else ())):
        runtimes = {threads: load_runtime(directory, threads) for threads in dict.fromkeys(p.threads for p in points)}
        runs.update({_name(p) + suffix: functools.partial(_stats, runtimes[p.threads], sources, p) for p in points})
    if ctranslate2 is not None:
        runs[CTRANSLATE2] = ctranslate2
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for turn in range(count):
        for name in (list(runs) if turn % 2 == 0 else list(runs)[::-1]):
            rates[name].append(round(runs[name]().sentences_per_s, 1))
            logger.info("turn %d %s: %.1f sentences/s", turn + 1, name, rates[name][-1])
    result: dict[str, Any] = {"sentences": len(sources), "turns": count, "sentences_per_s": rates,
                              "median": {name: statistics.median(values) for name, values in rates.items()}}
    if ctranslate2 is not None:
        ours = [max(rates[_name(p)][t] for p in points) for t in range(count)]
        result["ratio_per_turn"] = [round(o / c, 3) for o, c in zip(ours, rates[CTRANSLATE2], strict=True)]
        result["ratio_median"] = statistics.median(result["ratio_per_turn"])
    return result


def _stats(runtime: ModelRuntime, sources: list[list[int]], settings: InProcessSettings) -> RunStats:
    return run_settings(runtime, sources, settings)[0]


def _name(settings: InProcessSettings) -> str:
    name = f"{settings.engine}:{settings.size}:{settings.replicas}:{settings.threads}"
    return name if settings.join_at == 1 else f"{name}:{settings.join_at}"


def markdown(result: dict[str, Any]) -> str:
    """The turns as a markdown table: each run's median sentences/s and its range, and the ratio."""
    lines = ["# In-process runs in alternating turns", "", f"Command: `{result['command']}`", "",
             f"{result['sentences']} sentences of the {result.get('split', 'test')} set, {result['turns']} turns (A B C, C B A, ...), greedy, int8.", "",
             "| run (engine:size:replicas:threads[:join_at]) | sentences/s, median (range) | per turn |", "|---|---|---|"]
    for name, values in result["sentences_per_s"].items():
        lines.append(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) | "
                     f"{', '.join(f'{v:.1f}' for v in values)} |")
    if "ratio_per_turn" in result:
        lines += ["", (f"Best in-process point / CTranslate2, per turn: {', '.join(map(str, result['ratio_per_turn']))}; "
                       f"median **{result['ratio_median']:.3f}** (target ≥ 1.3)."), ""]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.in_process`: in-process points (and CTranslate2) in alternating turns."""
    parser = argparse.ArgumentParser(prog="python -m bench.in_process", description=main.__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/translate-en-it"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--split", choices=SPLITS, default="test",
                        help="the sentences: the test split or the other set (<data-dir>/<model>/<split>.src)")
    parser.add_argument("--points", nargs="+", default=["running:64:2:1", "batches:32:2:1"],
                        help="ENGINE:SIZE:REPLICAS:THREADS[:JOIN_AT] each (default: the grid's best two points)")
    parser.add_argument("--ctranslate2-setting", nargs=4, metavar=("REPLICAS", "THREADS", "BATCH", "TYPE"),
                        help="also CTranslate2 int8 translate_batch at this setting (e.g. 2 1 32 examples)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--against", type=Path,
                        help="another repository of the model (e.g. an older commit's) whose points run in the same turns")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        points = [parse_settings(text) for text in args.points]
    except ValueError as exc:
        parser.error(str(exc))
    from bench import ctranslate2_runs
    from bench import workload as workload_module
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    manifest = read_manifest(args.model)
    tokenizer = Tokenizer.from_file(args.model / "tokenizer.model")
    work = workload_module.load(args.data_dir, args.model.name, manifest.task, tokenizer, manifest.max_source_len,
                                args.sentences, args.split)
    with tempfile.TemporaryDirectory(prefix="ct2-") as scratch:
        reference = None
        if args.ctranslate2_setting:
            replicas, threads, batch, batch_type = args.ctranslate2_setting
            setting = ctranslate2_runs.Ct2Settings(int(replicas), int(threads), int(batch), batch_type)
            pieces = [tokenizer.pieces(ids) for ids in work.source_ids]
            reference = ctranslate2_runs.int8_greedy(args.model, Path(scratch), pieces, manifest.max_target_len, setting)
        result = turns(args.model, work.source_ids, points, args.turns, reference, args.against)
    result["command"] = shlex.join(["python", "-m", "bench.in_process", *(sys.argv[1:] if argv is None else argv)])
    result["machine"] = machine.describe()
    result["split"] = args.split
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "in_process.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "in_process.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise SystemExit(main())
