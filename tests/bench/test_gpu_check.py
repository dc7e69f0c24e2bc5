"""`make gpu-check`: it skips cleanly without a GPU, and its benchmark runs end to end (on the
CPU provider, the same code) over the tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from service.runtime import CPU, CUDA


def test_without_a_gpu_it_says_why_and_exits_0(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)  # no nvidia-smi
    assert gpu_check.main(["--provider", CUDA]) == 0
    assert capsys.readouterr().out.strip() == "gpu-check skipped: no NVIDIA GPU: nvidia-smi is missing or lists no device"
    assert gpu_check.main(["--provider", CUDA, "--require-gpu"]) == 1


def test_a_dry_run_on_the_cpu_writes_every_part(tiny_model_repository: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "ALONE", 16)  # one sentence at a time: the first 16 of the 24
    models = tmp_path / "models"
    shutil.copytree(tiny_model_repository, models / "tiny")
    texts = tmp_path / "texts" / "tiny"
    texts.mkdir(parents=True)
    shutil.copy(tiny_model_repository.parent / "data" / "test.src", texts / "test.src")
    shutil.copy(tiny_model_repository.parent / "data" / "test.tgt", texts / "test.tgt")
    out = tmp_path / "out"
    status = gpu_check.main(["--provider", CPU, "--models", str(models), "--texts", str(tmp_path / "texts"),
                             "--model", "tiny", "--out", str(out), "--sentences", "24", "--concurrency", "1", "4",
                             "--batch-sizes", "8", "--service-batch-sizes", "8", "16", "--service-processes", "2",
                             "--no-tests"])
    assert status == 0
    (folder,) = out.iterdir()
    results = json.loads((folder / "gpu-check.json").read_text())
    (report,) = results["models"]
    assert results["complete"] is True and "skipped" not in report
    assert report["provider"] == report["service_provider"] == CPU
    assert set(report["service"]) == {"1", "4"} and set(report["in_process"]) == {"8"}
    # the service's rows per batch: 8 at every concurrency, 16 at the top one; the best of them is compared
    assert report["service_batch_sizes"]["8"] == report["service"]["4"] and set(report["service_batch_sizes"]) == {"8", "16"}
    # and as two server processes at 8 rows and the top concurrency; the best setting is compared
    (processes,) = report["service_processes"].items()
    assert processes[0] == "2" and processes[1]["max_batch_size"] == 8 and processes[1]["concurrency"] == 4
    # the largest batch (8) is above the top concurrency: the service also with 8 clients and 8 rows,
    # in one process and in two, WIDE_WAVES requests a client (the 24 sentences sent again)
    wide, wide_processes = report["service_wide"], report["service_wide_processes"]["2"]
    assert (wide["concurrency"], wide["max_batch_size"], wide["processes"]) == (8, 8, 1)
    assert (wide_processes["concurrency"], wide_processes["processes"]) == (8, 2)
    assert wide["stats"]["sentences"] == wide_processes["stats"]["sentences"] == gpu_check.WIDE_WAVES * 8 == 32
    # the target: the best setting at the top concurrency (4)
    grid = {(int(b), 1): s["sentences_per_s"] for b, s in report["service_batch_sizes"].items()}
    grid[(8, 2)] = processes[1]["stats"]["sentences_per_s"]
    best = max(grid, key=grid.__getitem__)
    target = report["target"]
    assert (target["service_max_batch_size"], target["service_processes"], target["service_concurrency"]) == (*best, 4)
    assert target["service_sentences_per_s"] == max(grid.values())
    assert report["in_process_alone"]["sentences"] == 16 and report["in_process_alone"]["latency_p50_s"] > 0
    assert report["service"]["1"]["sentences"] == 16
    running = report["running_batch"]  # continuous batching in-process, its parts timed
    assert running["rows"] == gpu_check.RUNNING_ROWS and running["steps"] > 0 and running["leaves"] > 0
    assert running["total_s"] >= running["join_s"] + running["step_s"] and running["step_s"] > running["leave_s"] > 0
    assert running["join_s"] > running["encode_s"] > 0 and running["encodes"] > 0
    alone = report["step_graph_alone"]  # one sentence at a time on the step graph, then profiled
    assert alone["sentences"] == 16 and alone["steps"] >= 16 and alone["ms_per_sentence"] > alone["ms_per_step"] > 0
    assert alone["ms_per_sentence"] > alone["join_ms_per_sentence"] > alone["encode_ms_per_sentence"] > 0
    assert set(alone["profile"]["nodes_per_step"]) == {CPU} and alone["profile"]["nodes_per_step"][CPU] > 10
    assert alone["profile"]["memcpy_per_step"] == 0  # one device: nothing crosses
    fixed = report["static_step"]  # the lone row on a graph of fixed shapes: the same tokens, logits within float rounding
    assert fixed["static"]["same_tokens"] == 1.0 and fixed["static"]["max_logit_difference"] < 1e-5
    assert fixed["dynamic"]["steps"] == fixed["static"]["steps"] > 0 and "CUDA provider" in fixed["cuda_graph"]["error"]
    for stats in [report["service"]["4"], *report["service_batch_sizes"].values(), processes[1]["stats"],
                  *report["in_process"].values(),
                  *report["pytorch"]["batches"].values()]:
        assert stats["sentences"] == 24 and stats["errors"] == 0 and stats["tokens_per_s"] > 0
    # the same-device alternatives: CTranslate2 on the CPU (int8) beside PyTorch, and the target line
    assert set(report["ctranslate2"]["compute_types"]) == {"int8"}
    assert report["ctranslate2"]["compute_types"]["int8"]["8"]["sentences"] == 24
    assert target["ratio"] > 0 and target["best_alternative"].startswith(("CTranslate2", "PyTorch"))
    # no alternative batch holds at most 4 sentences: no ratio at the same sentences in flight
    assert target["in_flight_alternative"] is target["in_flight_ratio"] is None
    # each wide run against the best alternative of at most 8 sentences a batch
    alternatives = [*report["pytorch"]["batches"].values(), *report["ctranslate2"]["compute_types"]["int8"].values()]
    for run in (wide, wide_processes):
        assert run["stats"]["errors"] == 0 and run["best_alternative"].endswith("batch 8")
        assert run["ratio"] == pytest.approx(run["stats"]["sentences_per_s"] / max(a["sentences_per_s"] for a in alternatives))
    text = (folder / "gpu-check.md").read_text()
    assert "| service, concurrency 4, 8 rows per batch |" in text and "| CTranslate2 int8, batch 8 |" in text
    assert "| service, concurrency 4, 16 rows per batch |" in text
    assert "| service, concurrency 4, 2 server processes, 8 rows per batch |" in text
    assert "| service, concurrency 8, 8 rows per batch |" in text
    assert "| service, concurrency 8, 2 server processes, 8 rows per batch |" in text
    assert "Service at concurrency 8 (8 rows per batch) / best alternative with at most as many sentences in flight" in text
    assert "Service at concurrency 8 (8 rows per batch, 2 server processes) / best alternative with at most" in text
    assert "| ONNX in-process, one sentence at a time (16 sentences) |" in text
    assert report["latency_target"]["service_p50_s"] == report["service"]["1"]["latency_p50_s"]
    assert "p50 of a single request: service " in text
    stages = report["latency_target"]["server_timing_ms"]  # the service's Server-Timing at concurrency 1
    assert stages == report["service_server_timing"]["1"] and stages["total"] <= stages["client"]
    assert {"prepare", "queue", "inference"} <= set(stages) and "Its stages (`Server-Timing`, medians): prepare " in text
    assert "Continuous batching on the step graph in-process (64 slots, 8 newcomers per join)" in text
    assert f"(the encoder {running['encode_s']:.2f} s over {running['encodes']} calls)" in text
    assert "One sentence at a time on the step graph in-process (the service's path at concurrency 1, 16 sentences)" in text
    assert f"ms joining (the encoder {alone['encode_ms_per_sentence']:.2f} ms)" in text
    assert "A lone row on the step graph with fixed shapes (16 sentences" in text
    assert f"- static ({fixed['graph_nodes']['static']} nodes): " in text
    # quality on the provider against the CPU's fp32 (the dry run: the CPU's own variant, int8 or fp32)
    scored = report["quality"]
    assert scored["variant"] == report["variant"] and scored["scores"]["rows"] == scored["cpu_fp32"]["rows"] > 0
    assert scored["within_bound"] == all(scored["scores"][m] >= scored["cpu_fp32"][m] - 1.0 for m in ("bleu", "chrf"))
    assert f"Quality of {report['variant']} on CPUExecutionProvider against fp32 on the CPU" in text
    # the target line names the best setting: its rows per batch, and its processes if several
    setting = f"{target['service_max_batch_size']} rows per batch"
    setting += ", 2 server processes" if target["service_processes"] == 2 else ""
    assert f"Service at concurrency 4 ({setting}) / best alternative (" in text
    assert "service_modes" not in report and report["service_step_graph"] is True  # other modes: on CUDA only
    report["service_modes"] = {"request-level batches": {"max_batch_size": 8, "concurrency": 4, "stats": report["service"]["4"]}}
    assert "| service request-level batches, concurrency 4, 8 rows per batch |" in gpu_check.markdown(results)
    report["target"] |= {"in_flight_alternative": "PyTorch fp32, batch 4", "in_flight_ratio": 1.5}
    assert "in flight (PyTorch fp32, batch 4): 1.50." in gpu_check.markdown(results)


def test_past_its_budget_it_skips_the_later_service_runs_and_keeps_what_it_measured(
        tiny_model_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--budget-s 0` the service runs only with its default settings (at every
    concurrency); the others are listed as skipped. A run that stops midway (here the
    PyTorch baseline fails) leaves its JSON with every part measured before, `complete` false."""
    assert gpu_check.service_runs(CPU, [1, 4], [8], (8, 16), (2,)) == \
        [(8, "default", 1), (8, "wide", 1), (8, "wide", 2), (16, "default", 1), (8, "default", 2)]
    assert [mode for _, mode, _ in gpu_check.service_runs(CUDA, [1, 256], [256], (256,), ())] == \
        ["default", *gpu_check.SERVICE_MODES]  # no batch above the top concurrency: no wide run
    monkeypatch.setattr(gpu_check, "ALONE", 8)
    monkeypatch.setattr(gpu_check, "STATIC_ALONE", 2)

    def stopped(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the machine went away")

    monkeypatch.setattr(gpu_check, "torch_baseline", stopped)
    models = tmp_path / "models"
    shutil.copytree(tiny_model_repository, models / "tiny")
    texts = tmp_path / "texts" / "tiny"
    texts.mkdir(parents=True)
    for name in ("test.src", "test.tgt"):
        shutil.copy(tiny_model_repository.parent / "data" / name, texts / name)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="went away"):
        gpu_check.main(["--provider", CPU, "--models", str(models), "--texts", str(tmp_path / "texts"),
                        "--model", "tiny", "--out", str(out), "--sentences", "8", "--concurrency", "1", "4",
                        "--batch-sizes", "8", "--service-batch-sizes", "8", "16", "--service-processes", "2",
                        "--no-tests", "--budget-s", "0"])
    (folder,) = out.iterdir()
    results = json.loads((folder / "gpu-check.json").read_text())
    (report,) = results["models"]
    assert results["complete"] is False and not (folder / "gpu-check.md").exists()
    assert set(report["service"]) == {"1", "4"} and report["service"]["4"]["errors"] == 0
    assert report["skipped"] == [{"max_batch_size": 8, "mode": "wide", "processes": 1},
                                 {"max_batch_size": 8, "mode": "wide", "processes": 2},
                                 {"max_batch_size": 16, "mode": "default", "processes": 1},
                                 {"max_batch_size": 8, "mode": "default", "processes": 2}]
    assert "service_wide" not in report and "service_processes" not in report and "pytorch" not in report
    report |= {"pytorch": {"precision": "fp32", "batches": {}}, "target": {}}
    assert "Not run, past `--budget-s`: the service wide, 8 rows per batch; the service wide, 8 rows per batch, " \
           "2 server processes; the service default, 16 rows per batch; the service default, 8 rows per batch, " \
           "2 server processes." in gpu_check.markdown(results)


def test_the_lone_path_is_timed_with_and_without_the_slots_encoder(tiny_model_repository: Path) -> None:
    """On a runtime with a lone slot (the CPU device here), the single sentence's replay runs
    with the slot's own encoder and again with the source copied in; both encoder calls are
    timed, and the runtime and the slot get their own `encode` back."""
    from service.runtime import ModelRuntime

    runtime = ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32", io_binding=True,
                                lone_step=True)
    assert runtime.lone is not None and runtime.lone.encoder is not None
    sources = [[*runtime.tokenizer.encode(text), runtime.eos_id] for text in ("abc de", "fgh", "ab cd ef")]
    alone = gpu_check.step_graph_alone(runtime, tiny_model_repository, sources, CPU)
    copied = alone["copied_source"]
    for run in (alone, copied):
        assert run["ms_per_sentence"] > run["join_ms_per_sentence"] > run["encode_ms_per_sentence"] > 0
        assert run["steps"] >= len(sources)
    assert runtime.lone.encoder is not None and "encode" not in vars(runtime) and "encode" not in vars(runtime.lone)


def test_the_gpu_memory_of_given_processes_is_read_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi's compute apps: the memory the given processes hold, summed; None when it
    lists none of them."""
    answers = {"--query-gpu=name,driver_version,memory.total,memory.used": "NVIDIA H100, 580.1, 81559, 14723\n",
               "--query-compute-apps=pid,used_gpu_memory": "100, 9000\n200, 2500\n300, 2700\n"}

    def nvidia_smi(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, 0, answers[command[1]], "")

    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpu_check.subprocess, "run", nvidia_smi)
    assert gpu_check.gpu() == {"name": "NVIDIA H100", "driver": "580.1", "memory_total_mib": "81559",
                               "memory_used_mib": "14723"}
    assert gpu_check.gpu({200, 300})["processes_used_mib"] == 5200
    assert gpu_check.gpu({400})["processes_used_mib"] is None
    grandchild = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"
    with subprocess.Popen([sys.executable, "-c", grandchild]) as child:
        deadline = time.monotonic() + 10
        while len(tree := gpu_check.process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in tree - {child.pid}:
            os.kill(pid, 9)
        child.kill()
    assert child.pid in tree and len(tree) == 2 and os.getpid() not in tree  # the child and its own child


def test_the_open_files_limit_is_raised_for_a_thousand_clients() -> None:
    """From a soft limit of 256, up to the hard limit (at most 65,536)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = before[1]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        soft = gpu_check.raise_open_files_limit()
        assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert soft == (65536 if hard == resource.RLIM_INFINITY else min(hard, 65536))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_quality_says_why_it_could_not_score(tmp_path: Path, monkeypatch) -> None:
    """Without references, or without the metric's package on the host, the report says why."""
    import export.quality

    assert gpu_check.quality(None, None, tmp_path, "translate") == {"error": f"no references ({tmp_path.name}/test.tgt)"}
    (tmp_path / "test.tgt").write_text("a\n")

    def no_package(*args, **kwargs):
        raise ImportError("No module named 'rouge_score'")

    monkeypatch.setattr(export.quality, "measure_quality", no_package)
    assert gpu_check.quality(None, None, tmp_path, "summarize") == {
        "error": "cannot score: No module named 'rouge_score'"}
