"""bench.levers on the tiny model: one server per variant, its flags applied, results written."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.levers import (
    BASELINE,
    ConnectionSampler,
    baseline_name,
    connections_per_process,
    cpu_seconds,
    event_loop_cpu_seconds,
    main,
)


def _levers(dirs: tuple[Path, Path], out: Path, *options: str) -> dict:
    """`bench.levers` on the tiny model over 8 sentences with `options`; its results."""
    models, data = dirs
    assert main(["--models", str(models), "--data-dir", str(data), "--out", str(out),
                 "--model", "tiny-reverse", "--sentences", "8", *options]) == 0
    return json.loads((out / "levers.json").read_text(encoding="utf-8"))


def test_levers_measure_each_variant(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "levers"
    variants = ["defaults (continuous batching)", "request-level (dynamic) batching"]
    results = _levers(tiny_bench_dirs, out, "--concurrency", "3", "--repeats", "2", "--variants", *variants)
    assert list(results["variants"]) == variants
    continuous, dynamic = (results["variants"][v] for v in variants)
    assert len(continuous["runs"]) == len(dynamic["runs"]) == 2
    assert continuous["sentences"] == dynamic["sentences"] == 8
    assert continuous["errors"] == dynamic["errors"] == 0
    assert continuous["batching"]["continuous"] and not dynamic["batching"]["continuous"]
    # the server's CPU is not asserted here: it comes in clock ticks, and 8 tiny requests may take
    # less than one (`cpu_seconds` is tested on a child that spins, below)
    assert dynamic["flags"] == ["--no-continuous-batching"]
    # the running batch's key/value memory; request-level batches hold none between requests
    assert continuous["batching"]["max_cache_bytes"] > 0 == dynamic["batching"]["max_cache_bytes"]
    table = (out / "levers.md").read_text(encoding="utf-8")
    assert "| request-level (dynamic) batching | `--no-continuous-batching` |" in table
    row = next(line for line in table.splitlines() if line.startswith("| defaults (continuous batching) |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    low, high = (float(mb) for mb in cells[9].split("-"))  # peak RSS over the two runs
    assert 0 < low <= high and float(cells[10]) == round(continuous["batching"]["max_cache_bytes"] / 2**20, 1)
    # the load generator's CPU per request, beside the server's event loop's
    assert continuous["load_generator_ms_per_request"] > 0
    assert cells[7].startswith(f"{continuous['load_generator_ms_per_request']:.2f} (")


def test_the_connections_each_serving_process_holds_are_counted() -> None:
    """A process listening on a port, holding three accepted connections (its own client ends,
    whose local ports differ, do not count), and the sampler's busiest reading of it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [listener.accept()[0] for _ in clients]
    try:
        assert connections_per_process(os.getpid(), port) == [3]
        sampler = ConnectionSampler(os.getpid(), port, interval_s=0.02)
        sampler.start()
        time.sleep(0.2)
        accepted.pop().close()
        time.sleep(0.2)
        sampler.stop()
        assert sampler.busiest == [3] and connections_per_process(os.getpid(), port) == [2]
    finally:
        for end in [*clients, *accepted, listener]:
            end.close()


def test_a_supervisors_shared_socket_counts_its_workers_not_itself() -> None:
    """A child that accepts on the parent's listening socket (a supervisor's worker, one shared
    socket) is the serving process; the parent, listening too, is not counted."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = ("import socket, sys, time\n"
            "s = socket.socket(fileno=int(sys.argv[1]))\n"
            "held = [s.accept()[0] for _ in range(2)]\n"
            "print('accepted', flush=True)\n"
            "time.sleep(30)\n")
    with subprocess.Popen([sys.executable, "-c", code, str(listener.fileno())], pass_fds=[listener.fileno()],
                          stdout=subprocess.PIPE, text=True) as worker:
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "accepted"
            assert connections_per_process(os.getpid(), port) == [2]
        finally:
            worker.kill()
            for end in [*clients, listener]:
                end.close()


def test_levers_time_ctranslate2_in_the_same_turns(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    out = tmp_path / "levers"
    results = _levers(tiny_bench_dirs, out, "--concurrency", "3", "--repeats", "2",
                      "--variants", "defaults (continuous batching)", "--ctranslate2")
    reference = results["ctranslate2"]
    assert len(reference["runs"]) == 2 and reference["sentences"] == 8 and reference["sentences_per_s"] > 0
    ratio = results["variants"]["defaults (continuous batching)"]["sentences_per_s"] / reference["sentences_per_s"]
    table = (out / "levers.md").read_text(encoding="utf-8")
    assert f"| {ratio:.2f} |" in table and "| CTranslate2 int8 `translate_batch`" in table
    # its setting is the best point of its grid, timed before the turns (not its defaults)
    from bench.ctranslate2_runs import settings_grid

    tuning = results["ctranslate2_tuning"]
    assert len(tuning["points"]) == len(settings_grid())
    best = max(tuning["points"], key=lambda p: p["sentences_per_s"])["settings"]
    assert (reference["replicas"], reference["intra_threads"], reference["max_batch_size"], reference["batch_type"]) == \
        (best["inter_threads"], best["intra_threads"], best["max_batch_size"], best["batch_type"])
    assert "tuned once before the turns" in table


def test_at_concurrency_1_ctranslate2_runs_its_fastest_thread_pair_for_one_sentence(
        tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    from bench.ctranslate2_runs import thread_grid

    out = tmp_path / "levers"
    results = _levers(tiny_bench_dirs, out, "--concurrency", "1", "--repeats", "1",
                      "--variants", "defaults (continuous batching)", "--ctranslate2")
    reference, tuning = results["ctranslate2"], results["ctranslate2_tuning"]
    assert reference["single"]
    pairs = [(p["settings"]["inter_threads"], p["settings"]["intra_threads"]) for p in tuning["single_points"]]
    assert pairs == thread_grid()
    fastest = min(tuning["single_points"], key=lambda p: p["latency_p50_s"])["settings"]
    assert (reference["replicas"], reference["intra_threads"]) == (fastest["inter_threads"], fastest["intra_threads"])
    assert "its single-sentence p50" in (out / "levers.md").read_text(encoding="utf-8")


def test_levers_time_ctranslate2_at_a_chosen_setting(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    models, data = tiny_bench_dirs
    out = tmp_path / "levers"
    reference = _levers(tiny_bench_dirs, out, "--concurrency", "3", "--repeats", "1", "--variants",
                        "defaults (continuous batching)", "--ctranslate2-setting", "2", "1", "16", "tokens")["ctranslate2"]
    assert (reference["replicas"], reference["intra_threads"], reference["max_batch_size"], reference["batch_type"]) == \
        (2, 1, 16, "tokens")
    assert reference["sentences"] == 8 and reference["sentences_per_s"] > 0
    assert "(in-process, 2 replica(s) x 1 threads, batches of 16 tokens)" in (out / "levers.md").read_text(encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["--models", str(models), "--data-dir", str(data), "--out", str(out),
              "--ctranslate2-setting", "2", "1", "16", "sentences"])


def test_levers_open_loop_at_a_rate(tiny_bench_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "levers"
    results = _levers(tiny_bench_dirs, out, "--rate", "10", "--duration-s", "1.5", "--repeats", "1",
                      "--variants", "defaults (continuous batching)")
    run = results["variants"]["defaults (continuous batching)"]
    assert results["rate"] == 10 and run["errors"] == 0
    assert run["sentences"] == 15  # 10/s for 1.5 s, the 8 sentences cycled
    assert "at an offered load of 10 requests/s" in (out / "levers.md").read_text(encoding="utf-8")


def test_levers_run_a_baseline_checkout_in_the_same_turns(
    tiny_bench_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(__file__).resolve().parents[2]
    checkout = tmp_path / "checkout"
    for package in ("attnserve", "bench", "export", "model", "service"):
        shutil.copytree(root / package, checkout / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "baseline-ran"
    # the checkout's code, not this one's, leaves a mark when the server imports it
    with (checkout / "service" / "__init__.py").open("a", encoding="utf-8") as init:
        init.write('\nimport os\nopen(os.environ["LEVERS_TEST_MARK"], "a").close()\n')
    monkeypatch.setenv("LEVERS_TEST_MARK", str(marker))
    out = tmp_path / "levers"
    results = _levers(tiny_bench_dirs, out, "--concurrency", "3", "--repeats", "1",
                      "--variants", "defaults (continuous batching)", "--baseline", str(checkout),
                      "--baseline-variant", "one batch worker (one running batch on all cores)")
    assert marker.exists()
    baseline = "one batch worker (one running batch on all cores), baseline checkout"  # that variant's flags
    assert list(results["variants"]) == [baseline, "defaults (continuous batching)"]
    assert results["variants"][baseline]["flags"] == ["--batch-workers", "1"]
    for run in results["variants"].values():  # too short a run for CPU times at clock-tick resolution to compare
        assert run["errors"] == 0 and run["event_loop_cpu_s"] >= 0 and run["server_cpu_s"] >= 0
    assert f"| {baseline} | `--batch-workers 1` |" in (out / "levers.md").read_text(encoding="utf-8")
    assert baseline_name(None) == BASELINE


def test_at_concurrency_1_ctranslate2_translates_one_sentence_per_call(tiny_bench_dirs: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    out = tmp_path / "levers"
    results = _levers(tiny_bench_dirs, out, "--concurrency", "1", "--repeats", "1",
                      "--variants", "defaults (continuous batching)", "--ctranslate2-setting", "1", "1", "16", "examples")
    reference = results["ctranslate2"]
    assert reference["single"] and reference["max_batch_size"] == 1 and reference["latency_p50_s"] > 0
    ours = results["variants"]["defaults (continuous batching)"]
    table = (out / "levers.md").read_text(encoding="utf-8")
    assert "one sentence per call" in table and "p50 / CTranslate2's single-sentence p50" in table
    assert f"| {ours['latency_p50_s'] / reference['latency_p50_s']:.2f} |" in table



def _own_main_thread_seconds() -> float:
    import psutil

    thread = next(t for t in psutil.Process().threads() if t.id == os.getpid())
    return float(thread.user_time + thread.system_time)


def test_the_event_loops_cpu_counts_each_server_process_main_thread() -> None:
    # a child whose main thread spins for half a second, then sleeps: as a `--workers` server's worker does
    child = subprocess.Popen([sys.executable, "-c", ("import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\ntime.sleep(30)")])
    try:
        for _ in range(100):
            if event_loop_cpu_seconds(os.getpid()) - _own_main_thread_seconds() >= 0.5:
                break
            time.sleep(0.05)
        assert event_loop_cpu_seconds(os.getpid()) - _own_main_thread_seconds() >= 0.5  # the child's counted
        assert cpu_seconds(child.pid) >= 0.5  # and in the process tree's CPU
    finally:
        child.kill()
        child.wait()
