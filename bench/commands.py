"""Subcommands of `attnserve` provided by `bench/`: bench."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from bench.workload import SPLITS

logger = logging.getLogger(__name__)
CORES = os.cpu_count() or 1

QUICK = {"sentences": 16, "summaries": 8, "concurrency": [1, 4], "duration_s": 20.0, "open_duration_s": 5.0,
         "open_repeats": 1, "open_slices": 2,
         "batch_sizes": [1, 8], "single_sentences": 8, "naive_requests": 8, "service_workers": [1],
         "service_processes": []}


def register(subcommands: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to the `attnserve` parser."""
    from bench.harness import SYSTEMS

    p = subcommands.add_parser(
        "bench", help="benchmark the service against in-process ONNX, naive PyTorch and CTranslate2",
        description="Run the fixed workload (translation and summarization test inputs) against the "
        "service over HTTP (continuous, dynamic and no batching; closed and open loop), the ONNX models in-process, a naive "
        "one-request-at-a-time PyTorch server and CTranslate2 on the same weights; write "
        "<out>/<name>.json, .md and one PNG per task.")
    p.add_argument("--models", type=Path, default=Path("models"), help="model repository (default ./models)")
    p.add_argument("--data-dir", type=Path, default=Path("data"),
                   help="prepared data; reads <data-dir>/<model>/test.src (default ./data)")
    p.add_argument("--split", choices=SPLITS, default="test",
                   help="the translation sentences: the test split, or the other set of English descriptions "
                   "no translation example came from (<data-dir>/translate-en-it/other.src; default test)")
    p.add_argument("--out", type=Path, default=Path("bench/results/cpu"), help="results folder")
    p.add_argument("--name", default="bench", help="file name stem of the results (default bench)")
    p.add_argument("--sentences", type=int, default=1000, help="translation inputs (default 1000)")
    p.add_argument("--summaries", type=int, default=300, help="summarization inputs (default 300)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64],
                   help="closed-loop client counts (default 1 8 32 64)")
    p.add_argument("--duration-s", type=float, default=120.0,
                   help="cap on each closed-loop run and baseline pass, seconds (default 120)")
    p.add_argument("--rate", type=float, default=None,
                   help="open-loop requests/s (default 70%% of the best closed-loop throughput)")
    p.add_argument("--open-duration-s", type=float, default=30.0, help="each mode's open-loop seconds per turn (default 30)")
    p.add_argument("--open-repeats", type=int, default=5,
                   help="turns of open loops of dynamic and continuous batching, each at 70%% of the dynamic server's "
                   "throughput measured at its start; the turn with the median p95 ratio counts (default 5)")
    p.add_argument("--open-slices", type=int, default=6,
                   help="each turn's open loops alternate between dynamic and continuous batching in this many "
                   "slices of --open-duration-s, pooled per mode, so both see the machine alike (default 6)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64],
                   help="in-process batch sizes (default 1 8 32 64)")
    p.add_argument("--service-workers", type=int, nargs="*", default=[1, 4],
                   help="batch-worker counts also tried with continuous batching at the top concurrency "
                   "(default 1 4; the server's default always runs)")
    p.add_argument("--service-processes", type=int, nargs="*", default=[CORES] if CORES > 1 else [],
                   help="server-process counts also tried at the top concurrency, each process one batch worker "
                   "(`attnserve serve --workers N --batch-workers 1`, the cores divided among them; default: one per core)")
    p.add_argument("--single-sentences", type=int, default=200,
                   help="CTranslate2 single-sentence latency sample (default 200)")
    p.add_argument("--naive-requests", type=int, default=200,
                   help="requests sent to the naive PyTorch server per task (default 200)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of every engine (0 = defaults)")
    p.add_argument("--providers", default="CPUExecutionProvider",
                   help="onnxruntime providers of the service and in-process runs, comma-separated "
                   "(default CPUExecutionProvider; CTranslate2 and PyTorch run on the CPU)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="what to run")
    p.add_argument("--label", default="", help="a line stored with the results (e.g. 'smoke run')")
    p.add_argument("--quick", action="store_true",
                   help="a small run (16 sentences, 8 summaries, concurrency 1 4, batch sizes 1 8)")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from bench.harness import BenchConfig, run

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    values = {"sentences": args.sentences, "summaries": args.summaries, "concurrency": args.concurrency,
              "duration_s": args.duration_s, "open_duration_s": args.open_duration_s,
              "open_repeats": args.open_repeats, "open_slices": args.open_slices,
              "batch_sizes": args.batch_sizes, "single_sentences": args.single_sentences,
              "naive_requests": args.naive_requests, "service_workers": args.service_workers,
              "service_processes": args.service_processes}
    if args.quick:
        values.update(QUICK)
    config = BenchConfig(models_dir=args.models, data_dir=args.data_dir, out_dir=args.out, name=args.name,
                         split=args.split, rate=args.rate, threads=args.threads,
                         providers=tuple(p.strip() for p in args.providers.split(",") if p.strip()),
                         systems=tuple(args.systems), label=args.label,
                         command=shlex.join(["attnserve", *sys.argv[1:]]), **values)
    results, paths = run(config)
    for target in results.get("targets", []):
        ratio = "-" if target["ratio"] is None else f"{target['ratio']:.3f}"
        logger.info("target %s: %s (%s)", target["name"], ratio, target["status"])
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return 0
