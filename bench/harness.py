"""One invocation, every system: service over HTTP (continuous, dynamic and no batching; closed and open loop), the
ONNX models in-process, the naive PyTorch server, and CTranslate2 on the same weights.

Each task's model folder under `--models` is benchmarked on the first N inputs of
`<data-dir>/<model>/test.src`; the results land in `<out>/<name>.json|.md|-<task>.png`.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import load, machine, report, targets
from bench.servers import ServerProcess, free_port, service_command
from bench.workload import Workload

logger = logging.getLogger(__name__)

ROUTES = {"translate": "/v1/translate", "summarize": "/v1/summarize"}
OPEN_LOOP_LOAD = 0.7  # offered rate as a fraction of the best measured throughput
SYSTEMS = ("service", "in_process", "naive", "ctranslate2")


@dataclass
class BenchConfig:
    """Everything `attnserve bench` takes."""

    models_dir: Path = Path("models")
    data_dir: Path = Path("data")
    out_dir: Path = Path("bench/results/cpu")
    name: str = "bench"
    sentences: int = 1000  # translation inputs
    split: str = "test"  # which translation sentences: the test split or the other set (`bench.workload.SPLITS`)
    summaries: int = 300  # summarization inputs
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    duration_s: float = 120.0  # cap on each closed-loop run and each baseline pass
    rate: float | None = None  # open-loop requests/s; None = 70% of the best closed-loop throughput
    open_duration_s: float = 30.0
    open_repeats: int = 5  # turns of open loops of dynamic and continuous batching (the median turn counts)
    open_slices: int = 6  # each turn's open loops alternate between the two modes in this many slices
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    # batch-worker counts also tried with continuous batching at the top concurrency (the
    # server's own default is always run): our knobs tuned as CTranslate2's are
    service_workers: list[int] = field(default_factory=lambda: [1, 4])
    # server processes (`--workers`, one batch worker each) also tried at the top concurrency
    service_processes: list[int] = field(default_factory=list)
    single_sentences: int = 200  # CTranslate2 one-sentence-per-call latency sample
    naive_requests: int = 200  # the naive server is slow: it answers at most this many per task
    threads: int = 0  # onnxruntime / CTranslate2 / torch intra-op threads (0 = each one's default)
    providers: tuple[str, ...] = ("CPUExecutionProvider",)  # onnxruntime, for the service and in-process
    systems: tuple[str, ...] = SYSTEMS
    label: str = ""
    command: str = ""


def discover(models_dir: Path) -> list[tuple[Path, str, str]]:
    """(folder, model name, task) of every model repository folder under `models_dir`."""
    from service.repository.manifest import read_manifest

    found = []
    for manifest in sorted(models_dir.glob("*/manifest.json")):
        parsed = read_manifest(manifest.parent)
        found.append((manifest.parent, parsed.name, parsed.task))
    return found


def _timed(label: str, action: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`action(*args, **kwargs)`, logged with its duration."""
    started = time.perf_counter()
    logger.info("%s ...", label)
    value = action(*args, **kwargs)
    logger.info("%s done in %.1fs", label, time.perf_counter() - started)
    return value


def _stats(result: load.LoadResult, **extra: Any) -> dict[str, Any]:
    values = result.stats().to_dict()
    if result.error_samples:
        values["error_samples"] = result.error_samples
    return {**values, **extra}


def run_service(config: BenchConfig, workloads: dict[str, Workload], results: dict[str, Any]) -> None:
    """`attnserve serve` with request-level (dynamic) batching, continuous batching, then none:
    closed loop at each concurrency (and, without batching, one open loop); then the open loops
    of continuous and dynamic batching in turns (`run_open_loops_in_turns`). The open loop's
    rate (unless given) is 70% of the dynamic server's best closed-loop throughput."""
    rates: dict[str, float] = {}
    for mode in ("dynamic", "continuous", "batching_off"):
        server = _start_service(config, mode, results)
        try:
            for model, workload in workloads.items():
                url = server.url + ROUTES[workload.task]
                asyncio.run(load.closed_loop(url, load.text_bodies(workload.texts[:2]), 2))  # warm-up
                closed: dict[str, Any] = {}
                for level in config.concurrency:
                    result = _timed(f"service {mode} {model} c{level}", asyncio.run,
                                    load.closed_loop(url, load.text_bodies(workload.texts), level, config.duration_s))
                    closed[f"c{level}"] = _stats(result)
                entry = results["tasks"][model].setdefault("service", {}).setdefault(mode, {})
                entry["closed"] = closed
                if model not in rates:
                    best = max(v["sentences_per_s"] for v in closed.values())
                    rates[model] = config.rate or max(OPEN_LOOP_LOAD * best, 0.1)
                if mode == "batching_off":
                    entry["open"] = _open_loop(config, server, mode, model, workload, rates[model])
        finally:
            _record_peak_rss(results, mode, server.stop(), workloads)
    run_worker_grid(config, workloads, results)
    run_open_loops_in_turns(config, workloads, results)


def run_worker_grid(config: BenchConfig, workloads: dict[str, Workload], results: dict[str, Any]) -> None:
    """Continuous batching with each batch-worker count of `config.service_workers` (the cores
    divided among the workers), and with each count of `config.service_processes` server
    processes of one batch worker each (the cores divided among them), closed loop at the top concurrency:
    `service/continuous_w<N>`, `service/continuous_p<N>`."""
    top = max(config.concurrency)
    grid = [(f"continuous_w{workers}", {"ATTNSERVE_BATCH_WORKERS": str(workers)}) for workers in config.service_workers]
    # `--threads 0` (the command's default) then gives each process's batch worker its share of the cores
    grid += [(f"continuous_p{processes}", {"ATTNSERVE_WORKERS": str(processes), "ATTNSERVE_BATCH_WORKERS": "1"})
             for processes in config.service_processes]
    for name, env in grid:
        server = _start_service(config, "continuous", results, log_suffix=f"-{name.rsplit('_', 1)[1]}", name=name,
                                env=env)
        try:
            for model, workload in workloads.items():
                url = server.url + ROUTES[workload.task]
                asyncio.run(load.closed_loop(url, load.text_bodies(workload.texts[:2]), 2))  # warm-up
                result = _timed(f"service {name} {model} c{top}", asyncio.run,
                                load.closed_loop(url, load.text_bodies(workload.texts), top, config.duration_s))
                entry = results["tasks"][model].setdefault("service", {}).setdefault(name, {})
                entry["closed"] = {f"c{top}": _stats(result)}
        finally:
            _record_peak_rss(results, name, server.stop(), workloads)


def run_open_loops_in_turns(config: BenchConfig, workloads: dict[str, Workload], results: dict[str, Any]) -> None:
    """The open loops of dynamic and continuous batching in `config.open_repeats` turns, on two
    servers started together, so that a drift of the machine's speed is seen by both modes alike.

    Each turn first measures the dynamic server's throughput at the top concurrency and offers
    70% of it (unless `config.rate` is given), then runs the open loops of both modes at that
    rate, interleaved in slices (`_interleaved_open_loops`): a rate set once, minutes earlier,
    may exceed what the machine does now, and its speed changes within a minute. Each task's
    `turns` lists every turn's rate and p95s; each mode's `open` is its run from the turn with
    the median p95 ratio (continuous / dynamic), so the target reads the median turn."""
    modes = ("dynamic", "continuous")
    servers: dict[str, ServerProcess] = {}
    turns: dict[str, list[dict[str, Any]]] = {model: [] for model in workloads}
    top = max(config.concurrency)
    try:
        for mode in modes:
            servers[mode] = _start_service(config, mode, results, log_suffix="-open")
        for mode, server in servers.items():  # warm-up
            for workload in workloads.values():
                asyncio.run(load.closed_loop(server.url + ROUTES[workload.task], load.text_bodies(workload.texts[:2]), 2))
        for index in range(config.open_repeats):
            for model, workload in workloads.items():
                turn: dict[str, Any] = {}
                rate = config.rate
                if rate is None:
                    best = _timed(f"service dynamic {model} c{top} (this turn's rate)", asyncio.run,
                                  load.closed_loop(servers["dynamic"].url + ROUTES[workload.task],
                                                   load.text_bodies(workload.texts), top, config.duration_s))
                    turn["dynamic_sentences_per_s"] = best.stats().sentences_per_s
                    rate = max(OPEN_LOOP_LOAD * turn["dynamic_sentences_per_s"], 0.1)
                turn.update(_timed(f"service {' and '.join(servers)} {model} open {rate:.2f}/s", _interleaved_open_loops,
                                   config, servers, workload, rate, seed=index * config.open_slices))
                turns[model].append(turn)
    finally:
        for mode, server in servers.items():
            _record_peak_rss(results, mode, server.stop(), workloads)
    for model, model_turns in turns.items():
        if not model_turns:
            continue
        ordered = sorted(model_turns, key=_p95_ratio)
        median = ordered[(len(ordered) - 1) // 2]
        for mode in modes:
            results["tasks"][model]["service"][mode]["open"] = median[mode]
        results["tasks"][model]["service_open_turns"] = [
            {"offered_rate": turn["dynamic"]["offered_rate"], "dynamic_p95_s": turn["dynamic"]["latency_p95_s"],
             "continuous_p95_s": turn["continuous"]["latency_p95_s"], "p95_ratio": _p95_ratio(turn),
             "slices": len(turn["continuous"]["slice_p95_s"]),
             "slices_continuous_lower": sum(c is not None and d is not None and c < d for c, d in zip(
                 turn["continuous"]["slice_p95_s"], turn["dynamic"]["slice_p95_s"], strict=True))}
            for turn in model_turns]


def _interleaved_open_loops(config: BenchConfig, servers: dict[str, ServerProcess], workload: Workload,
                            rate: float, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each server's open loop at `rate` for `config.open_duration_s`, cut into
    `config.open_slices` slices that alternate between the servers (their order flips every
    slice). In a slice every server gets the same arrivals and texts, so a change of the
    machine's speed within the turn reaches them alike, not whichever ran in that half minute.
    Each server's stats pool its slices, and `slice_p95_s` lists the p95 of each."""
    slices = max(1, config.open_slices)
    slice_s = config.open_duration_s / slices
    per_slice = max(1, int(rate * slice_s))  # requests per slice (`load.open_loop`'s count)
    pooled = {mode: load.LoadResult() for mode in servers}
    slice_p95: dict[str, list[float | None]] = {mode: [] for mode in servers}
    modes = list(servers)
    for index in range(slices):
        for mode in modes if index % 2 == 0 else modes[::-1]:
            part = asyncio.run(load.open_loop(servers[mode].url + ROUTES[workload.task], load.text_bodies(workload.texts), rate,
                                                 slice_s, seed=seed + index, first=index * per_slice))
            pooled[mode].merge(part)
            slice_p95[mode].append(part.stats().latency_p95_s)
    return {mode: _stats(result, offered_rate=rate, slice_p95_s=slice_p95[mode]) for mode, result in pooled.items()}


def _p95_ratio(turn: dict[str, Any]) -> float:
    """continuous / dynamic p95 of one turn (infinite when either is missing)."""
    dynamic, continuous = turn["dynamic"]["latency_p95_s"], turn["continuous"]["latency_p95_s"]
    return continuous / dynamic if dynamic and continuous is not None else float("inf")


def _start_service(config: BenchConfig, mode: str, results: dict[str, Any], log_suffix: str = "",
                   name: str | None = None, env: dict[str, str] | None = None) -> ServerProcess:
    """A started `attnserve serve` in batching `mode` (with `env` added to its environment); its
    models' variants go to `results` under `service_<name>` (`name` defaults to `mode`)."""
    port = free_port()
    command = service_command(config.models_dir, port, mode, config.threads, config.providers)
    log_path = config.out_dir / "logs" / f"{config.name}-service-{mode}{log_suffix}.log"
    server = ServerProcess(command, port, log_path,
                           env={"ATTNSERVE_MAX_TEXT_CHARS": "100000", **(env or {})})
    _timed(f"start service ({name or mode})", server.start)
    cards = httpx.get(server.url + "/v1/models", timeout=10).json().get("models", [])
    results["servers"].setdefault(f"service_{name or mode}", {})["variants"] = {
        c.get("name"): f"{c.get('variant')} on {c.get('provider')}" for c in cards}
    return server


def _open_loop(config: BenchConfig, server: ServerProcess, mode: str, model: str, workload: Workload,
               rate: float) -> dict[str, Any]:
    result = _timed(f"service {mode} {model} open {rate:.2f}/s", asyncio.run,
                    load.open_loop(server.url + ROUTES[workload.task], load.text_bodies(workload.texts), rate,
                                   config.open_duration_s))
    return _stats(result, offered_rate=rate)


def _record_peak_rss(results: dict[str, Any], mode: str, peak_mb: float, workloads: dict[str, Workload]) -> None:
    """Keep the largest peak RSS a server of `mode` reached (it may be started more than once)."""
    server = results["servers"].setdefault(f"service_{mode}", {})
    server.update(peak_rss_mb=round(max(peak_mb, server.get("peak_rss_mb", 0.0)), 1), models=list(workloads))
    for model in workloads:
        entry = results["tasks"][model].setdefault("service", {}).setdefault(mode, {})
        entry["peak_rss_mb"] = server["peak_rss_mb"]


def run_naive(config: BenchConfig, models: dict[str, Path], workloads: dict[str, Workload],
              results: dict[str, Any]) -> None:
    """The one-request-at-a-time PyTorch server, one process per model, at concurrency 1."""
    import sys

    for model, workload in workloads.items():
        port = free_port()
        command = [sys.executable, "-m", "bench.naive_server", "--model-dir", str(models[model]),
                   "--port", str(port), "--threads", str(config.threads)]
        server = ServerProcess(command, port, config.out_dir / "logs" / f"{config.name}-naive-{model}.log")
        _timed(f"start naive server ({model})", server.start)
        try:
            url = server.url + ROUTES[workload.task]
            texts = workload.texts[:config.naive_requests]
            asyncio.run(load.closed_loop(url, load.text_bodies(texts[:1]), 1))  # warm-up
            result = _timed(f"naive {model} c1", asyncio.run, load.closed_loop(url, load.text_bodies(texts), 1, config.duration_s))
        finally:
            peak = server.stop()
        results["tasks"][model]["naive"] = {"closed": {"c1": _stats(result)}, "peak_rss_mb": round(peak, 1)}
        results["servers"][f"naive_{model}"] = {"peak_rss_mb": round(peak, 1)}


def run_in_process_and_ctranslate2(config: BenchConfig, models: dict[str, Path], workloads: dict[str, Workload],
                                   results: dict[str, Any]) -> None:
    """ONNX in-process: the service's default variant at each batch size and length-sorted at the
    largest; on the CPU its grid (`in_process.settings_grid`: every engine at the batch sizes of
    at least 32, with each replicas x threads pair, the running ones joining one by one and in
    groups of a quarter; `best` is what the targets compare); fp32 at the largest (the int8
    lever, and the reference CTranslate2 is compared with); then CTranslate2 fp32/int8,
    greedy/beam 4, and agreement."""
    from bench import in_process

    largest = max(config.batch_sizes)
    for model, workload in workloads.items():
        task_results = results["tasks"][model]
        sources = workload.source_ids
        references: dict[str, list[Any]] = {}
        runtime = _timed(f"load {model}", in_process.load_runtime, models[model], config.threads,
                         providers=config.providers)
        if "in_process" in config.systems:
            entry: dict[str, Any] = {"variant": runtime.variant}
            for size in config.batch_sizes:
                stats, outputs = _timed(f"in-process {model} b{size}", in_process.run_batches,
                                        runtime, sources, size)
                entry[f"b{size}"] = stats.to_dict()
            stats, _ = _timed(f"in-process {model} b{largest} length-sorted", in_process.run_batches,
                              runtime, sources, largest, sort_by_length=True)
            entry[f"b{largest}_length_sorted"] = stats.to_dict()
            if tuple(config.providers) == (in_process.CPU,):  # replicas x threads: a CPU grid
                sizes = sorted({size for size in config.batch_sizes if size >= 32} or {largest})
                grid = _timed(f"in-process {model} grid", in_process.run_grid, models[model], sources,
                              in_process.settings_grid(sizes))
                entry["grid"], entry["best"] = grid["points"], grid["best"]
            task_results["in_process"] = entry
            references[f"onnx_{runtime.variant}"] = outputs
        if runtime.variant != "fp32":
            fp32 = in_process.load_runtime(models[model], config.threads, variant="fp32",
                                           providers=config.providers)
            stats, references["onnx_fp32"] = _timed(f"in-process {model} fp32 b{largest}",
                                                in_process.run_batches, fp32, sources, largest)
            task_results["in_process_fp32"] = {"variant": "fp32", f"b{largest}": stats.to_dict()}
        elif "onnx_fp32" not in references:
            references["onnx_fp32"] = in_process.run_batches(runtime, sources, largest)[1]
        if "ctranslate2" not in config.systems:
            continue
        task_results["ctranslate2"] = run_ctranslate2(config, models[model], workload, runtime, references)
        for key in [k for k in task_results["ctranslate2"] if k.startswith("agreement")]:
            task_results[key] = task_results["ctranslate2"].pop(key)


def run_ctranslate2(config: BenchConfig, model_dir: Path, workload: Workload, runtime: Any,
                    references: dict[str, list[Any]]) -> dict[str, Any]:
    """Convert, then tune CTranslate2 as its users would: int8 greedy `translate_batch` over the
    grid of `ctranslate2_runs.settings_grid` (replicas x threads, batch size in examples and in
    tokens) and single-sentence calls with each thread pair. `int8_greedy_batch` and
    `int8_greedy_single` are the best points, which the targets compare with; fp32 and beam 4
    run with the best point's settings.

    Agreement: CT2 fp32 greedy vs our ONNX fp32 greedy (same weights, same search), and CT2 int8
    vs our ONNX int8 when the service runs int8 (both quantize, differently)."""
    from bench import ctranslate2_converter, ctranslate2_runs

    pieces = [runtime.tokenizer.pieces(ids) for ids in workload.source_ids]
    ours = {name: [runtime.tokenizer.pieces(r.tokens) for r in outputs] for name, outputs in references.items()}
    limit = runtime.max_target_len
    entry: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ct2-") as tmp:
        ct2_dir = _timed("convert to CTranslate2", ctranslate2_converter.convert, model_dir, Path(tmp) / "m")
        grid = _timed("ctranslate2 int8 greedy grid", ctranslate2_runs.run_grid, ct2_dir, "int8", pieces, limit,
                      ctranslate2_runs.settings_grid(), single=pieces[:config.single_sentences])
        entry["int8_greedy_grid"] = grid["points"]
        entry["int8_greedy_single_grid"] = grid["single_points"]
        entry["int8_greedy_batch"] = grid["best"]
        entry["int8_greedy_single"] = grid["best_single"]
        tuned = ctranslate2_runs.Ct2Settings(**grid["best"]["settings"])
        entry["settings"] = tuned.to_dict()
        for compute_type, key in (("float32", "fp32"), ("int8", "int8")):
            translator = ctranslate2_runs.load_translator(ct2_dir, compute_type, tuned.intra_threads,
                                                          tuned.inter_threads)
            for beam, beam_key in ((1, "greedy"), (4, "beam4")):
                stats, outputs = _timed(f"ctranslate2 {key} {beam_key}", ctranslate2_runs.run_batch,
                                        translator, pieces, beam, limit, tuned.max_batch_size, tuned.batch_type)
                if f"{key}_{beam_key}_batch" not in entry:
                    entry[f"{key}_{beam_key}_batch"] = {"settings": tuned.to_dict(), **stats.to_dict()}
                if beam == 1:
                    for name in (f"onnx_{key}", "onnx_fp32"):
                        if name in ours:
                            entry[f"agreement_{key}_vs_{name}"] = ctranslate2_runs.agreement(ours[name], outputs)
    return entry


def run_roofline(config: BenchConfig, model_dir: Path, workload: Workload, task_results: dict[str, Any]) -> dict[str, Any]:
    """FLOPs per sentence of the workload (source lengths as tokenized, the target length of the
    service's top-concurrency run, else the in-process largest batch), the machine's int8 and
    fp32 matrix-multiply ceilings at the model's shapes, and each system's share of the ceiling."""
    from bench import roofline
    from service.repository.manifest import read_manifest

    shapes = roofline.Shapes.from_config(read_manifest(model_dir).model_config)
    top = f"c{max(config.concurrency)}"
    runs = {
        "service": targets.best_service(task_results, top),
        "in_process": max((v for v in task_results.get("in_process", {}).values() if isinstance(v, dict)),
                          key=lambda v: v["sentences_per_s"], default=None),
        "ctranslate2": task_results.get("ctranslate2", {}).get("int8_greedy_batch"),
    }
    reference = runs["service"] or runs["in_process"]
    if reference is None or not reference.get("sentences"):
        raise ValueError("no service or in-process run to take the target length from")
    target_len = round(reference["target_tokens"] / reference["sentences"])
    flops = roofline.workload_flops(shapes, [len(ids) for ids in workload.source_ids],
                                    [target_len] * len(workload.source_ids))
    peaks = roofline.peaks(shapes, config.threads)
    entry: dict[str, Any] = {"flops_per_sentence": flops, "mean_target_tokens": target_len, **peaks}
    for name, run in runs.items():
        rate = run["sentences_per_s"] if run else None
        entry[f"{name}_fraction_int8"] = roofline.fraction(rate, flops, peaks["int8"]["peak_gflops"])
    return entry


def run(config: BenchConfig) -> tuple[dict[str, Any], list[Path]]:
    """Run every system in `config.systems` on every task; write and return the results."""
    from bench import workload as workload_module
    from model.tokenizer import Tokenizer

    counts = {"translate": config.sentences, "summarize": config.summaries}
    models: dict[str, Path] = {}
    workloads: dict[str, Workload] = {}
    for folder, name, task in discover(config.models_dir):
        if counts.get(task, 0) <= 0:
            continue
        from service.repository.manifest import read_manifest

        manifest = read_manifest(folder)
        tokenizer = Tokenizer.from_file(folder / "tokenizer.model")
        workloads[name] = workload_module.load(config.data_dir, name, task, tokenizer, manifest.max_source_len,
                                               counts[task], config.split if task == "translate" else "test")
        models[name] = folder
    if not workloads:
        raise FileNotFoundError(f"no model repository with a translate/summarize task in {config.models_dir}")
    results: dict[str, Any] = {
        "name": config.name, "label": config.label, "command": config.command,
        "machine": machine.describe(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "servers": {},
        "tasks": {name: {"task": w.task, "sentences": len(w),
                         "split": config.split if w.task == "translate" else "test"} for name, w in workloads.items()},
    }
    steps: list[tuple[str, Callable[[], None]]] = [
        ("in_process+ctranslate2", lambda: run_in_process_and_ctranslate2(config, models, workloads, results)),
        ("service", lambda: run_service(config, workloads, results)),
        ("naive", lambda: run_naive(config, models, workloads, results)),
    ]
    for step, action in steps:
        if not set(step.split("+")) & set(config.systems):
            continue
        try:  # one system failing must not lose the others' results
            action()
        except Exception as error:  # recorded in the results and logged
            logger.exception("%s failed", step)
            results.setdefault("failures", {})[step] = f"{type(error).__name__}: {error}"
    translation = next((results["tasks"][m] for m, w in workloads.items() if w.task == "translate"), None)
    for model, workload in workloads.items():
        if workload.task == "translate":
            try:
                results["tasks"][model]["roofline"] = _timed(f"roofline {model}", run_roofline, config, models[model],
                                                             workload, results["tasks"][model])
            except Exception as error:  # recorded in the results and logged
                logger.exception("roofline failed")
                results.setdefault("failures", {})["roofline"] = f"{type(error).__name__}: {error}"
    if translation is not None:
        results["targets"] = [t.to_dict() for t in targets.evaluate(translation, max(config.concurrency))]
    return results, report.write(results, config.out_dir, config.name)
