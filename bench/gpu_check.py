"""`make gpu-check`: verify the CUDA execution provider on a GPU machine, then measure it.

1. The machine: the GPU and driver (`nvidia-smi`), onnxruntime's version and providers. Without
   a GPU, or with onnxruntime's CPU build, it says why and exits 0 (`--require-gpu`: exits 1).
2. The `gpu`-marked tests (`pytest -m gpu`), their JUnit XML kept beside the results.
3. A short benchmark on the provider, in one run: the service over HTTP at each
   `--concurrency` (its p50 at concurrency 1, over the first 128 sentences, is the single-request
   latency), and at the top one
   with each other `--service-batch-sizes` as its rows per batch (on CUDA also in the other
   batching modes of `SERVICE_MODES`, the lone slot's off at concurrency 1, and as
   `--service-processes` server processes), and with as many clients and rows per batch as the
   largest of `--batch-sizes` where that is above the top concurrency (one process and each of
   `--service-processes`; `WIDE_WAVES` requests a client, the sentences sent again as needed, so
   the batch runs full past the first wave); the service's
   graphs in-process at each `--batch-sizes` and one sentence at a time (the first 128); and the alternatives that run on the same GPU
   without our code: CTranslate2 on the same weights (float16 and int8_float16 on CUDA, int8 on
   the CPU; recorded as an error when its wheel does not run against the machine's CUDA) and
   the repository's PyTorch model with its KV cache, batched, in fp16 autocast. The target line
   compares the service's best setting at its top concurrency (rows per batch, server processes;
   continuous batching, the default mode) with the fastest of them, and with the fastest whose
   batch holds at most as many sentences as the service has clients; each wide run has its own
   line against the fastest of at most as many sentences in flight. GPU memory in use is
   read from `nvidia-smi` after each part.
4. Writes `<out>/<gpu name>/gpu-check.json` and `gpu-check.md`: every number, the device, the
   driver, onnxruntime's version and the provider each part actually ran on. The JSON is
   written again after each part (`complete` false until the end), so a run stopped midway (a
   lent machine's time running out) keeps what it measured; `--budget-s` skips the service runs
   still to come once that many seconds have passed, the default settings at every concurrency
   excepted (`service_runs`: the runs most wanted first), and lists them.

`--provider CPUExecutionProvider` runs steps 3-4 on the CPU (a dry run of the same code, used by
its test on the tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import onnxruntime as ort

from bench import gqa_cuda, join_cost, machine, static_step, step_graph_parity
from bench.in_process import load_runtime, run_batches
from bench.load import closed_loop, text_bodies
from bench.servers import ServerProcess, free_port, service_command
from bench.stats import summarise, timed_calls
from bench.workload import load as load_workload
from service.core.settings import BATCH_ROWS
from service.repository.manifest import read_manifest
from service.runtime import CPU, CUDA, ModelRuntime
from service.runtime.providers import cuda_unavailable_reason, prepare_cuda

TASK_MODELS = {"translate": "translate-en-it", "summarize": "summarize-en"}
ALONE = 128  # sentences decoded one at a time in-process
QUALITY_ROWS = 200  # test rows scored on the provider and on the CPU (fp32)
# On CUDA, the service also in these batching modes (flags of `attnserve serve`) beside its default
# (continuous batching on the step graph): continuous batching on the merged decoder (whose running
# batch copies the cache to the host every step), request-level batches only, and a lone request
# on the batch's step graph instead of the lone slot's CUDA graph (at concurrency 1: `SINGLE_MODES`)
SERVICE_MODES = {"on the merged decoder": ["--no-step-graph"], "request-level batches": ["--no-continuous-batching"],
                 "without the lone slot": ["--no-lone-step"]}
SINGLE_MODES = {"without the lone slot"}  # run with one client (the first ALONE sentences), not the top concurrency
LATENCY_BOUND_S = 0.010  # p50 of a single request on a GPU
# continuous batching on the step graph in-process (`bench.join_cost`): sentences, slots, newcomers per join
RUNNING_SENTENCES, RUNNING_ROWS, RUNNING_GROUP = 512, 64, 8
PROFILED_ALONE = 16  # sentences of the profiled replay, one at a time on the step graph
WIDE_WAVES = 4  # requests a client sends in the wide runs (the sentences sent again as needed)
STATIC_ALONE = 16  # sentences decoded alone on a step graph of fixed shapes (and as a CUDA graph)


def gpu(pids: Collection[int] = ()) -> dict[str, Any] | None:
    """Name, driver and memory of the first GPU as `nvidia-smi` reports them, or None; with
    `pids`, also the memory those processes hold (`processes_used_mib`, None where nvidia-smi
    lists none of them: another PID namespace), apart from what other processes (this one's
    in-process sessions among them) hold."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-gpu=name,driver_version,memory.total,memory.used"
    result = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    name, driver, total, used = (part.strip() for part in result.stdout.splitlines()[0].split(","))
    found: dict[str, Any] = {"name": name, "driver": driver, "memory_total_mib": total, "memory_used_mib": used}
    if pids:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_gpu_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=False)
        held = [int(mib) for pid, mib in (line.split(",") for line in apps.stdout.splitlines() if line.count(",") == 1)
                if pid.strip().isdigit() and int(pid) in pids and mib.strip().isdigit()]
        found["processes_used_mib"] = sum(held) if held else None
    return found


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (at most 65,536): the
    1024-client run opens a socket per client here, and the servers started from here inherit
    it. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    return soft


def served_gpu(server: ServerProcess) -> dict[str, Any] | None:
    """`gpu`, with the memory the server's processes hold apart."""
    return gpu(process_tree(server.process.pid) if server.process is not None else ())


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (a server and its workers), from Linux's /proc."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in children.read_text().split() if int(child) not in found]
            except (OSError, ValueError):
                continue
    return found


def skip_reason(provider: str) -> str | None:
    """Why the check cannot run on `provider` here, or None."""
    if provider != CUDA:
        return None
    if gpu() is None:
        return "no NVIDIA GPU: nvidia-smi is missing or lists no device"
    prepare_cuda()
    return cuda_unavailable_reason()


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def run_gpu_tests(out: Path) -> dict[str, Any]:
    """`pytest -m gpu`; its exit status and the JUnit counts."""
    xml = out / "gpu-tests.xml"
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                             f"--junitxml={xml}"], capture_output=True, text=True, check=False)
    (out / "gpu-tests.log").write_text(result.stdout + result.stderr, encoding="utf-8")
    counts = {}
    if xml.exists():
        head = re.search(r"<testsuite [^>]*>", xml.read_text(encoding="utf-8"))
        for key in ("tests", "failures", "errors", "skipped"):
            found = re.search(rf'\b{key}="(\d+)"', head.group(0)) if head else None
            counts[key] = int(found.group(1)) if found else None
    return {"exit_status": result.returncode, **counts}


def torch_baseline(model_dir: Path, sources: list[list[int]], batch_sizes: list[int], max_new_tokens: int,
                   device: str) -> dict[str, Any]:
    """The repository's PyTorch model with its KV cache, greedy, batched; fp16 autocast on CUDA."""
    import torch

    from model.checkpoint import load_model
    from model.decoding import greedy_decode, pad_batch

    model = load_model(model_dir, device=device).eval()
    pad = model.config.pad_id
    runs = {}
    for batch_size in batch_sizes:
        latencies, tokens = [], 0
        started = time.perf_counter()
        with torch.inference_mode(), torch.autocast(device_type=device.split(":")[0], dtype=torch.float16,
                                                    enabled=device.startswith("cuda")):
            for first in range(0, len(sources), batch_size):
                batch = sources[first:first + batch_size]
                t0 = time.perf_counter()
                outputs = greedy_decode(model, pad_batch(batch, pad).to(device), max_new_tokens)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                latencies += [time.perf_counter() - t0] * len(batch)
                tokens += sum(len(o.tokens) - (o.finish_reason == "eos") for o in outputs)
        runs[str(batch_size)] = summarise(latencies, tokens, time.perf_counter() - started).to_dict()
    precision = "fp16 autocast" if device.startswith("cuda") else "fp32"
    return {"device": device, "precision": precision, "batches": runs}


def ctranslate2_baseline(model_dir: Path, pieces: list[list[str]], batch_sizes: list[int], max_new_tokens: int,
                         device: str) -> dict[str, Any]:
    """CTranslate2 on the repository's weights, greedy `translate_batch` at each batch size, in
    each compute type its users pick on `device`; `error` says why it could not run."""
    import tempfile

    try:
        import ctranslate2

        from bench import ctranslate2_converter, ctranslate2_runs
    except ImportError as error:
        return {"error": f"ctranslate2 not installed ({error})"}
    compute_types = ("float16", "int8_float16") if device == "cuda" else ("int8",)
    runs: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ct2-") as tmp:
            ct2_dir = ctranslate2_converter.convert(model_dir, Path(tmp) / "m")
            for compute_type in compute_types:
                translator = ctranslate2.Translator(str(ct2_dir), device=device, compute_type=compute_type)
                runs[compute_type] = {
                    str(b): ctranslate2_runs.run_batch(translator, pieces, 1, max_new_tokens, max_batch_size=b)[0].to_dict()
                    for b in batch_sizes}
                del translator
    except (RuntimeError, ValueError, OSError) as error:  # a wheel built for another CUDA, no device: recorded
        return {"error": f"{type(error).__name__}: {error}", "compute_types": runs}
    return {"device": device, "version": ctranslate2.__version__, "compute_types": runs}


def agreement(reference: ModelRuntime, sources: list[list[int]], outputs: list[Any],
              max_new_tokens: int) -> dict[str, Any]:
    """How many of `outputs` (greedy, on the provider) are the `reference` runtime's (CPU fp32) tokens."""
    expected = run_batches(reference, sources, 64, max_new_tokens=max_new_tokens)[1]
    identical = sum(o.tokens == e.tokens for o, e in zip(outputs, expected, strict=True))
    return {"reference": "CPU fp32", "rows": len(expected), "identical": identical}


def quality(runtime: ModelRuntime, reference: ModelRuntime, data_dir: Path, task: str) -> dict[str, Any]:
    """BLEU/chrF (ROUGE for summaries) of the runtime's greedy outputs on the test split of
    `data_dir` and of the `reference` runtime's (CPU fp32), and whether the first is within
    `MAX_DROP` of the second."""
    from export.quality import MAX_DROP, measure_quality, within_bound

    if not (data_dir / "test.tgt").is_file():
        return {"error": f"no references ({data_dir.name}/test.tgt)"}
    try:
        measured = measure_quality(runtime, data_dir, QUALITY_ROWS)
    except ImportError as error:  # the metric's package (sacrebleu, rouge-score) is not on the host
        return {"error": f"cannot score: {error}"}
    expected = measure_quality(reference, data_dir, QUALITY_ROWS)
    return {"variant": runtime.variant, "scores": measured, "cpu_fp32": expected, "max_drop": MAX_DROP,
            "within_bound": within_bound(task, expected, measured)}


def best_alternative(report: dict[str, Any], max_batch: int | None = None) -> tuple[str, float] | None:
    """The fastest same-device alternative run (name, sentences/s) of a model's report, among
    the batches of at most `max_batch` sentences if given (as many in flight as a service's clients)."""
    runs = [(f"PyTorch {report['pytorch']['precision']}, batch {b}", int(b), s["sentences_per_s"])
            for b, s in report.get("pytorch", {}).get("batches", {}).items()]
    for compute_type, batches in report.get("ctranslate2", {}).get("compute_types", {}).items():
        runs += [(f"CTranslate2 {compute_type}, batch {b}", int(b), s["sentences_per_s"]) for b, s in batches.items()]
    best = max((run for run in runs if max_batch is None or run[1] <= max_batch), key=lambda run: run[2], default=None)
    return None if best is None else (best[0], best[2])


def _alone_replay(runtime: ModelRuntime, sources: list[list[int]]) -> dict[str, float]:
    """The sources one at a time through a one-row running batch on the step graph: mean
    milliseconds per sentence, per step, and per sentence in its join, of which its encoder call
    (the runtime's, or the lone slot's own)."""
    owners = [runtime, *([runtime.lone] if runtime.lone is not None else [])]
    with timed_calls(owners, "encode") as encoding:  # the encoder's share of each join
        alone = join_cost.replay(runtime, sources, 1, 1, join_cost.MODES[join_cost.STEP_MODE])
    count = max(len(sources), 1)
    return {"steps": alone["steps"], "ms_per_sentence": 1000 * alone["total_s"] / count,
            "ms_per_step": 1000 * alone["step_s"] / max(alone["steps"], 1),
            "join_ms_per_sentence": 1000 * alone["join_s"] / count, "encode_ms_per_sentence": 1000 * encoding[0] / count}


def step_graph_alone(runtime: ModelRuntime, model_dir: Path, sources: list[list[int]], provider: str) -> dict[str, Any]:
    """The service's path at concurrency 1 without the server: the first `ALONE` sources one at a
    time through a one-row running batch on the step graph (`_alone_replay`; on CUDA in the
    runtime's lone slot, replayed as a CUDA graph, its source encoded by the slot's own encoder),
    again with the lone slot's encoder detached (`copied_source`: encoded as a batch's, then
    copied into the slot), then `PROFILED_ALONE` of them on profiled sessions of the batch's step
    graph: the kernels per step on each provider and the host <-> device copies among them,
    which a single sentence's step pays in launches and synchronisations (`join_cost.profile`)."""
    result: dict[str, Any] = {"sentences": len(sources[:ALONE]), **_alone_replay(runtime, sources[:ALONE])}
    lone = runtime.lone
    if lone is not None and lone.encoder is not None:
        encoder, lone.encoder = lone.encoder, None
        try:
            result["copied_source"] = _alone_replay(runtime, sources[:ALONE])
        finally:
            lone.encoder = encoder
    profiled = join_cost.profile(model_dir, sources[:PROFILED_ALONE], 1, 1,
                                 (provider,) if provider == CPU else (provider, CPU))["step_graph"]
    result["profile"] = {key: profiled[key] for key in ("step_ms", "nodes_per_step", "memcpy_per_step")}
    return result


def measure(models: Path, model: str, texts_dir: Path, provider: str, sentences: int, concurrency: list[int],
            batch_sizes: list[int], out: Path, service_batch_sizes: tuple[int, ...] = (64,),
            service_processes: tuple[int, ...] = (), report: dict[str, Any] | None = None,
            save: Callable[[], None] = lambda: None, deadline: float | None = None) -> dict[str, Any]:
    """Steps 3 of the module docstring for one model, into `report` (a new dict by default),
    `save` called after each part; the service with each of `service_batch_sizes` as its rows
    per batch (the first at every concurrency), and with each of `service_processes` server
    processes (`--workers`) at the first rows per batch and the top concurrency. Once
    `time.monotonic()` passes `deadline`, the service runs after the first (the default settings
    at every concurrency) are skipped and listed in `skipped`: the runs go first to last as
    `service_runs` orders them."""
    report = {} if report is None else report
    manifest = read_manifest(models / model)
    runtime = load_runtime(models / model, providers=[provider] if provider == CPU else [provider, CPU])
    workload = load_workload(texts_dir, model, manifest.task, runtime.tokenizer, manifest.max_source_len, sentences)
    texts = (workload.texts * (sentences // max(len(workload), 1) + 1))[:sentences]
    sources = (workload.source_ids * (sentences // max(len(workload), 1) + 1))[:sentences]
    max_new_tokens = manifest.max_target_len
    report |= {"model": model, "provider": runtime.provider, "variant": runtime.variant, "sentences": len(texts)}

    report["in_process"], outputs = {}, []
    for b in batch_sizes:
        stats, results = run_batches(runtime, sources, b, max_new_tokens=max_new_tokens)
        report["in_process"][str(b)], outputs = stats.to_dict(), outputs or results
        save()
    reference = load_runtime(models / model, variant="fp32", providers=[CPU])  # what the provider's outputs are held to
    report["agreement"] = agreement(reference, sources[:128], outputs[:128], max_new_tokens)
    report["quality"] = quality(runtime, reference, texts_dir / model, manifest.task)
    save()
    del reference
    # one sentence at a time: the engine's own latency, beside the service's at concurrency 1
    report["in_process_alone"] = run_batches(runtime, sources[:ALONE], 1, max_new_tokens=max_new_tokens)[0].to_dict()
    if runtime.step is not None:  # where continuous batching's time goes: joins, steps, departures
        report["running_batch"] = {"rows": RUNNING_ROWS, "group": RUNNING_GROUP, **join_cost.replay(
            runtime, sources[:RUNNING_SENTENCES], RUNNING_ROWS, RUNNING_GROUP, join_cost.MODES[join_cost.STEP_MODE])}
        report["step_graph_alone"] = step_graph_alone(runtime, models / model, sources, provider)
        # the same lone row on a step graph of fixed shapes, and replayed as a CUDA graph
        report["static_step"] = static_step.measure(models / model, runtime, sources[:STATIC_ALONE], max_new_tokens)
        save()
    pieces = [runtime.tokenizer.pieces(ids) for ids in sources]  # what CTranslate2 takes
    del runtime
    report["memory_after_in_process"] = gpu()

    providers = [provider] if provider == CPU else [provider, CPU]
    runs = service_runs(provider, concurrency, batch_sizes, service_batch_sizes, service_processes)
    wide = next((rows for rows, mode, _ in runs if mode == "wide"), None)
    for index, (rows, mode, processes) in enumerate(runs):
        if index and deadline is not None and time.monotonic() > deadline:
            report.setdefault("skipped", []).append({"max_batch_size": rows, "mode": mode, "processes": processes})
            save()
            continue
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1/{manifest.task}"
        command = service_command(models, port, providers=providers, max_queue_size=max(4096, 4 * max(concurrency)))
        command += ["--max-batch-size", str(rows), "--max-batch-tokens", str(rows * manifest.max_source_len),
                    "--max-connections", str(max(1000, 2 * max(*concurrency, wide or 0)))]  # every client in
        command += SERVICE_MODES.get(mode, []) + (["--workers", str(processes)] if processes > 1 else [])
        log = out / (f"service-{model}-{rows}{'' if mode in ('default', 'wide') else '-' + SERVICE_MODES[mode][0][2:]}"
                     f"{f'-p{processes}' if processes > 1 else ''}.log")
        with ServerProcess(command, port, log) as server:
            if mode == "wide":
                wide_texts = [texts[i % len(texts)] for i in range(max(len(texts), WIDE_WAVES * rows))]
                result = asyncio.run(closed_loop(url, text_bodies(wide_texts), rows))
                run = {"max_batch_size": rows, "concurrency": rows, "processes": processes,
                       "stats": result.stats().to_dict()}
                if processes > 1:
                    report.setdefault("service_wide_processes", {})[str(processes)] = run
                else:
                    report["service_wide"] = run
                report[f"memory_during_service_{rows}{f'_p{processes}' if processes > 1 else ''}"] = served_gpu(server)
            elif processes > 1:
                result = asyncio.run(closed_loop(url, text_bodies(texts), max(concurrency)))
                report.setdefault("service_processes", {})[str(processes)] = {
                    "max_batch_size": rows, "concurrency": max(concurrency), "stats": result.stats().to_dict()}
                report[f"memory_during_service_p{processes}"] = served_gpu(server)
            elif mode != "default":
                clients = 1 if mode in SINGLE_MODES else max(concurrency)
                result = asyncio.run(closed_loop(url, text_bodies(texts if clients > 1 else texts[:ALONE]), clients))
                report.setdefault("service_modes", {})[mode] = {
                    "max_batch_size": rows, "concurrency": clients, "stats": result.stats().to_dict()}
            elif rows == service_batch_sizes[0]:
                info = json.loads(_get(server.url + "/v1/models"))
                served = next(m for m in info["models"] if m["name"] == model)
                report["service_provider"], report["service_variant"] = served["provider"], served["variant"]
                report["service_step_graph"] = served.get("step_graph")
                report["service"], report["service_server_timing"] = {}, {}
                for clients in concurrency:  # one client at a time: the first ALONE sentences, as in-process
                    result = asyncio.run(closed_loop(url, text_bodies(texts if clients > 1 else texts[:ALONE]), clients))
                    report["service"][str(clients)] = result.stats().to_dict()
                    report["service_server_timing"][str(clients)] = result.server_timing_ms()
                report["memory_during_service"] = served_gpu(server)
                report["service_peak_rss_mib"] = server.rss.peak_bytes / 2**20 if server.rss else None
                report["service_batch_sizes"] = {str(rows): report["service"][str(max(concurrency))]}
            else:
                result = asyncio.run(closed_loop(url, text_bodies(texts), max(concurrency)))
                report["service_batch_sizes"][str(rows)] = result.stats().to_dict()
                report[f"memory_during_service_{rows}"] = served_gpu(server)
        save()

    device = "cuda" if provider == CUDA else "cpu"
    report["pytorch"] = torch_baseline(models / model, sources, batch_sizes, max_new_tokens, device)
    if manifest.task == "translate":
        report["ctranslate2"] = ctranslate2_baseline(models / model, pieces, batch_sizes, max_new_tokens, device)
    best = best_alternative(report)
    # the default batching mode at the top concurrency, each setting a user tunes (rows per batch,
    # server processes): the best
    settings = [(int(r), 1, s["sentences_per_s"]) for r, s in report["service_batch_sizes"].items()]
    settings += [(run["max_batch_size"], int(n), run["stats"]["sentences_per_s"])
                 for n, run in report.get("service_processes", {}).items()]
    rows, processes, top = max(settings, key=lambda setting: setting[2])
    # the alternatives' best batch may hold more sentences than the service's clients send at once:
    # the ratio against the best at most as large as the concurrency is beside it
    in_flight = best_alternative(report, max(concurrency))
    report["target"] = {"service_concurrency": max(concurrency), "service_sentences_per_s": top,
                        "service_max_batch_size": rows, "service_processes": processes,
                        "best_alternative": best[0] if best else None,
                        "ratio": top / best[1] if best and best[1] else None, "bound": 1.0,
                        "in_flight_alternative": in_flight[0] if in_flight else None,
                        "in_flight_ratio": top / in_flight[1] if in_flight and in_flight[1] else None}
    for wide in wide_runs(report):  # the service with as many sentences in flight as the largest batch
        wide_best = best_alternative(report, wide["concurrency"])
        wide |= {"best_alternative": wide_best[0] if wide_best else None,
                 "ratio": wide["stats"]["sentences_per_s"] / wide_best[1] if wide_best and wide_best[1] else None}
    if "1" in report["service"]:  # the single request's latency (the issue's bound: 10 ms on a GPU)
        report["latency_target"] = {"service_p50_s": report["service"]["1"]["latency_p50_s"],
                                    "in_process_alone_p50_s": report["in_process_alone"]["latency_p50_s"],
                                    "bound_s": LATENCY_BOUND_S,
                                    "server_timing_ms": report["service_server_timing"].get("1", {})}
    return report


def wide_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's wide runs (as many clients and rows per batch as the largest batch), one
    server process first."""
    return ([report["service_wide"]] if "service_wide" in report else []) + list(
        report.get("service_wide_processes", {}).values())


def service_runs(provider: str, concurrency: list[int], batch_sizes: list[int], service_batch_sizes: tuple[int, ...],
                 service_processes: tuple[int, ...]) -> list[tuple[int, str, int]]:
    """The service's runs, (rows per batch, mode, server processes), most wanted first: the
    default settings at every concurrency (the first rows per batch); as many clients and rows
    per batch as the largest batch in-process, where that is above the top concurrency (the
    sentences in flight of the alternatives' best batch), in one server process and in each of
    `service_processes`; the other rows per batch at the top concurrency; on CUDA the other
    batching modes (`SERVICE_MODES`, at the top concurrency or at one client, `SINGLE_MODES`);
    server processes."""
    runs = [(service_batch_sizes[0], "default", 1)]
    if max(batch_sizes) > max(concurrency):
        runs += [(max(batch_sizes), "wide", processes) for processes in dict.fromkeys((1, *service_processes))]
    runs += [(rows, "default", 1) for rows in service_batch_sizes[1:]]
    runs += [(service_batch_sizes[0], mode, 1) for mode in SERVICE_MODES] * (provider == CUDA)
    runs += [(service_batch_sizes[0], "default", processes) for processes in service_processes if processes > 1]
    return runs


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def markdown(results: dict[str, Any]) -> str:
    """The report: the machine, the tests, then one table per model."""
    device = results["gpu"] or {"name": results["provider"]}
    lines = [f"# gpu-check on {device['name']}", "",
             f"- command: `{results['command']}`",
             (f"- driver: {device.get('driver', '-')}; onnxruntime {results['onnxruntime']} "
              f"(providers {', '.join(results['onnxruntime_providers'])})"),
             f"- gpu tests: {results['tests']}"]
    for provider, cases in results.get("step_graph_attention", {}).get("providers", {}).items():
        errors = ", ".join(f"{name}: {c.get('error') or format(c['max_abs_error'], '.2g')}" for name, c in cases.items())
        lines.append(f"- step graph's GroupQueryAttention on {provider}, largest error against numpy: {errors}")
    for parity in results.get("step_graph_parity", []):
        if "error" in parity:
            lines.append(f"- step graph parity: {parity['error']}")
            continue
        first = parity["first_departing"][0]["node"] if parity["first_departing"] else "none"
        lines.append(f"- {parity['model']} {parity['variant']} step graph on {parity['provider']} against the CPU"
                     f"{' (totals fed from the host)' if parity['host_totals'] else ''}: {parity['departing_nodes']} "
                     f"of {parity['nodes']} nodes depart (first: {first}), logits differ by at most "
                     f"{parity['logits_max_abs_diff']:.3g}, same next token on {parity['same_next_token']} of "
                     f"{parity['rows']} rows")
    lines.append("")
    for report in results["models"]:
        lines += [(f"## {report['model']}: service on {report['service_provider']} ({report['service_variant']}), "
                   f"in-process on {report['provider']} ({report['variant']})"), "",
                  "| run | sentences/s | tokens/s | p50 s | p95 s |", "|---|---|---|---|---|"]
        grid = report.get("service_batch_sizes", {})  # absent from reports written before the grid
        first = next(iter(grid), None)
        suffix = f", {first} rows per batch" if len(grid) > 1 else ""
        rows = [(f"service, concurrency {c}{suffix}", s) for c, s in report["service"].items()]
        rows += [(f"service, concurrency {max(map(int, report['service']))}, {b} rows per batch", s)
                 for b, s in grid.items() if b != first]
        for processes, run in report.get("service_processes", {}).items():
            name = (f"service, concurrency {run['concurrency']}, {processes} server processes, "
                    f"{run['max_batch_size']} rows per batch")
            rows.append((name, run["stats"]))
        for wide in wide_runs(report):
            processes = wide.get("processes", 1)
            name = (f"service, concurrency {wide['concurrency']}"
                    f"{f', {processes} server processes' if processes > 1 else ''}, {wide['max_batch_size']} rows per batch")
            rows.append((name, wide["stats"]))
        for mode, run in report.get("service_modes", {}).items():
            rows.append((f"service {mode}, concurrency {run['concurrency']}, {run['max_batch_size']} rows per batch",
                         run["stats"]))
        if "in_process_alone" in report:
            alone = report["in_process_alone"]
            rows.append((f"ONNX in-process, one sentence at a time ({alone['sentences']} sentences)", alone))
        rows += [(f"ONNX in-process, batch {b}", s) for b, s in report["in_process"].items()]
        rows += [(f"PyTorch {report['pytorch']['precision']}, batch {b}", s)
                 for b, s in report["pytorch"]["batches"].items()]
        ct2 = report.get("ctranslate2", {})
        rows += [(f"CTranslate2 {compute_type}, batch {b}", s)
                 for compute_type, batches in ct2.get("compute_types", {}).items() for b, s in batches.items()]
        for name, s in rows:
            p50 = "-" if s["latency_p50_s"] is None else f"{s['latency_p50_s']:.4f}"
            p95 = "-" if s["latency_p95_s"] is None else f"{s['latency_p95_s']:.4f}"
            lines.append(f"| {name} | {s['sentences_per_s']:.1f} | {s['tokens_per_s']:.0f} | {p50} | {p95} |")
        running = report.get("running_batch")
        if running:
            lines += ["", (f"Continuous batching on the step graph in-process ({running['rows']} slots, "
                           f"{running['group']} newcomers per join): {running['total_s']:.2f} s, of which joins "
                           f"{running['join_s']:.2f} s"
                           + (f" (the encoder {running['encode_s']:.2f} s over {running['encodes']} calls)"
                              if "encode_s" in running else "")
                           + f", steps {running['step_s']:.2f} s over {running['steps']} steps "
                           f"(departures {running['leave_s']:.2f} s over {running['leaves']}), resizes "
                           f"{running['copy_s']:.2f} s over {running['copies']}.")]
        alone = report.get("step_graph_alone")
        if alone:
            nodes = ", ".join(f"{count:g} on {name}" for name, count in alone["profile"]["nodes_per_step"].items())
            lines += ["", (f"One sentence at a time on the step graph in-process (the service's path at concurrency 1, "
                           f"{alone['sentences']} sentences): {alone['ms_per_sentence']:.1f} ms per sentence, "
                           f"{alone['ms_per_step']:.2f} ms per step"
                           + (f", {alone['join_ms_per_sentence']:.2f} ms joining (the encoder "
                              f"{alone['encode_ms_per_sentence']:.2f} ms)" if "join_ms_per_sentence" in alone else "")
                           + (f"; the source encoded as a batch's and copied into the lone slot: "
                              f"{alone['copied_source']['ms_per_sentence']:.1f} ms per sentence, "
                              f"{alone['copied_source']['join_ms_per_sentence']:.2f} ms joining"
                              if "copied_source" in alone else "")
                           + f"; profiled on the batch's step graph, a step runs {nodes} "
                           f"({alone['profile']['memcpy_per_step']:g} host <-> device copies).")]
        fixed = report.get("static_step")
        if fixed:
            lines += ["", (f"A lone row on the step graph with fixed shapes ({fixed.get('sentences', 0)} sentences, "
                           "each alone; `bench.static_step`):")]
            node_counts = fixed.get("graph_nodes", {})
            ways = {way: run for way, run in fixed.items()
                    if isinstance(run, dict) and way not in ("fixed_dimensions", "graph_nodes")}
            if "error" in fixed:
                lines.append(f"- {fixed['error']}")
            for way, run in ways.items():
                found = run["error"] if "error" in run else (
                    f"{run['ms_per_step']:.3f} ms per step"
                    + (f", tokens as dynamic's for {run['same_tokens']:.0%} of sentences, "
                       f"largest logit difference {run['max_logit_difference']:.2g}" if "same_tokens" in run else ""))
                graph = f" ({node_counts[way]} nodes)" if way in node_counts else ""
                lines.append(f"- {way}{graph}: {found}")
        same = report.get("agreement")
        if same:
            lines += ["", (f"In-process outputs identical to the {same['reference']} variant's: "
                           f"{same['identical']} of {same['rows']} sentences.")]
        memory = report.get("memory_during_service") or {}
        if ct2.get("error"):
            lines += ["", f"CTranslate2: {ct2['error']}"]
        target = report.get("target", {})
        if target.get("ratio") is not None:
            status = "met" if target["ratio"] >= target["bound"] else "missed"
            processes = target.get("service_processes", 1)
            lines += ["", (f"Service at concurrency {target['service_concurrency']} "
                           f"({target.get('service_max_batch_size', 64)} rows per batch"
                           f"{f', {processes} server processes' if processes > 1 else ''}) / best alternative "
                           f"({target['best_alternative']}): **{target['ratio']:.2f}** (bound ≥ 1.0: {status}).")]
            if target.get("in_flight_ratio") is not None and target["in_flight_alternative"] != target["best_alternative"]:
                lines[-1] += (f" Against the best alternative with at most {target['service_concurrency']} sentences "
                              f"in flight ({target['in_flight_alternative']}): {target['in_flight_ratio']:.2f}.")
        for wide in wide_runs(report):
            if wide.get("ratio") is not None:
                processes = wide.get("processes", 1)
                lines += ["", (f"Service at concurrency {wide['concurrency']} ({wide['max_batch_size']} rows per batch"
                               f"{f', {processes} server processes' if processes > 1 else ''}) / best alternative "
                               f"with at most as many sentences in flight ({wide['best_alternative']}): "
                               f"**{wide['ratio']:.2f}**.")]
        scored = report.get("quality", {})
        if "scores" in scored:
            metrics = [m for m in ("bleu", "chrf", "rouge1", "rouge2", "rougeL") if m in scored["scores"]]
            versus = ", ".join(f"{m} {scored['scores'][m]} vs {scored['cpu_fp32'][m]}" for m in metrics)
            status = "met" if scored["within_bound"] else "missed"
            lines += ["", (f"Quality of {scored['variant']} on {report['provider']} against fp32 on the CPU "
                           f"({scored['scores']['rows']} test rows): {versus} (within {scored['max_drop']}: {status}).")]
        elif "error" in scored:
            lines += ["", f"Quality: {scored['error']}"]
        latency = report.get("latency_target")
        if latency and latency["service_p50_s"] is not None:
            status = "met" if latency["service_p50_s"] <= latency["bound_s"] else "missed"
            lines += ["", (f"p50 of a single request: service {latency['service_p50_s'] * 1000:.1f} ms, the graphs "
                           f"in-process {latency['in_process_alone_p50_s'] * 1000:.1f} ms "
                           f"(bound ≤ {latency['bound_s'] * 1000:.0f} ms: {status}).")]
            stages = dict(latency.get("server_timing_ms") or {})
            client = stages.pop("client", None)
            if stages:  # the service's own account of where that time went
                lines[-1] += " Its stages (`Server-Timing`, medians): " + ", ".join(
                    f"{name} {ms:.2f} ms" for name, ms in stages.items()) + (
                    f"; the client's latency {client:.2f} ms." if client is not None else ".")
        if report.get("skipped"):
            lines += ["", "Not run, past `--budget-s`: " + "; ".join(
                f"the service {run['mode']}, {run['max_batch_size']} rows per batch"
                + (f", {run['processes']} server processes" if run["processes"] > 1 else "")
                for run in report["skipped"]) + "."]
        own = memory.get("processes_used_mib")
        lines += ["", (f"GPU memory in use while serving: {memory.get('memory_used_mib', '-')} MiB "
                       f"of {memory.get('memory_total_mib', '-')}"
                       + (f", the server's own processes {own} MiB (the rest: this process's in-process "
                          "sessions and the others')." if own is not None else ".")), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("models"), help="model repository (default ./models)")
    parser.add_argument("--texts", type=Path, default=Path("tests/fixtures/default_models"),
                        help="folder with <model>/test.src (default: the test fixtures, no prepared data needed)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu"), help="results folder")
    parser.add_argument("--provider", default=CUDA, choices=[CUDA, CPU])
    parser.add_argument("--tasks", nargs="+", default=["translate"], choices=sorted(TASK_MODELS))
    parser.add_argument("--model", action="append", default=None, help="model folder names (default: by --tasks)")
    parser.add_argument("--sentences", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="batch sizes of the graphs in-process and of the alternatives (default: 64 and 256, "
                        "on CUDA also 1024: a GPU's best batch is often the largest one that fits)")
    parser.add_argument("--service-batch-sizes", type=int, nargs="+", default=None,
                        help="the service's --max-batch-size: the first at every concurrency, the others at the "
                        "top one (default: the provider's default rows per batch, then 64 and 256)")
    parser.add_argument("--service-processes", type=int, nargs="*", default=None,
                        help="also the service as this many server processes (--workers) at the top concurrency "
                        "and the first rows per batch (default: 4 on CUDA, none on the CPU)")
    parser.add_argument("--no-tests", action="store_true", help="skip `pytest -m gpu`")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 instead of 0 when it cannot run")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="past this many seconds from the start, skip the service runs after each model's "
                        "first (its default settings at every concurrency) and list them in the report")
    args = parser.parse_args(argv)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    raise_open_files_limit()

    reason = skip_reason(args.provider)
    if reason is not None:
        print(f"gpu-check skipped: {reason}")
        return 1 if args.require_gpu else 0
    device = gpu()
    out = args.out / slug(device["name"] if device and args.provider == CUDA else f"dry-run-{args.provider}")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
        "complete": False,
        "provider": args.provider, "gpu": device, "machine": machine.describe(),
        "onnxruntime": ort.__version__, "onnxruntime_providers": ort.get_available_providers(),
        "tests": "not run",
    }

    def save() -> None:  # what the run has measured so far: a run stopped midway keeps it
        (out / "gpu-check.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")

    results["tests"] = "not run" if args.no_tests else run_gpu_tests(out)
    results |= {"step_graph_attention": gqa_cuda.check(), "step_graph_parity": [], "models": []}
    save()
    default_rows = BATCH_ROWS[args.provider]
    batch_sizes = args.batch_sizes or [64, 256, *[1024] * (args.provider == CUDA)]
    service_batch_sizes = tuple(args.service_batch_sizes or dict.fromkeys([default_rows, 64, 256]))
    service_processes = tuple(args.service_processes if args.service_processes is not None
                              else (4,) if args.provider == CUDA else ())
    for model in args.model or [TASK_MODELS[t] for t in args.tasks]:
        if args.provider == CUDA:  # where the fp16 step graph departs from the CPU's, with and without host totals
            results["step_graph_parity"] += [step_graph_parity.compare(args.models / model, "fp16", CUDA, host)
                                             for host in (False, True)]
        results["models"].append({})
        measure(args.models, model, args.texts, args.provider, args.sentences, args.concurrency, batch_sizes, out,
                service_batch_sizes, service_processes, report=results["models"][-1], save=save, deadline=deadline)
    results["complete"] = True
    save()
    (out / "gpu-check.md").write_text(markdown(results), encoding="utf-8")
    print(f"wrote {out / 'gpu-check.md'}")
    tests = results["tests"]
    return 0 if not isinstance(tests, dict) or tests["exit_status"] in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
