"""The fixed workload, free ports, the service command line and RSS sampling."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench import workload
from bench.rss import PeakRss, tree_rss_bytes
from bench.servers import free_port, service_command


def test_workload_cuts_to_the_source_limit(tmp_path: Path, tiny_repository_tokenizer) -> None:
    (tmp_path / "m").mkdir()
    lines = ["abc de", "", "a b c d e f g h i j k l m n o a b c d e f g h i j k l m n o", "fg"]
    (tmp_path / "m" / "test.src").write_text("\n".join(lines) + "\n", encoding="utf-8")
    loaded = workload.load(tmp_path, "m", "translate", tiny_repository_tokenizer, max_source_len=24, count=2)
    assert len(loaded) == 2  # the empty line is skipped
    assert loaded.texts[0] == "abc de"
    assert loaded.source_ids[0] == tiny_repository_tokenizer.encode("abc de") + [tiny_repository_tokenizer.eos_id]
    assert all(ids[-1] == tiny_repository_tokenizer.eos_id for ids in loaded.source_ids)
    assert len(loaded.source_ids[1]) <= 24 - 6 + 1  # the margin: a quarter of 24
    with pytest.raises(FileNotFoundError, match="no test split"):
        workload.load(tmp_path, "other", "translate", tiny_repository_tokenizer, 24, 2)


def test_workload_reads_the_other_set(tmp_path: Path, tiny_repository_tokenizer) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "test.src").write_text("abc\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="no other split"):
        workload.load(tmp_path, "m", "translate", tiny_repository_tokenizer, 24, 2, split="other")
    (tmp_path / "m" / "other.src").write_text("fg\nde\n", encoding="utf-8")
    assert workload.load(tmp_path, "m", "translate", tiny_repository_tokenizer, 24, 5, split="other").texts == ["fg", "de"]
    assert workload.load(tmp_path, "m", "translate", tiny_repository_tokenizer, 24, 5).texts == ["abc"]
    with pytest.raises(ValueError, match="split one of"):
        workload.load(tmp_path, "m", "translate", tiny_repository_tokenizer, 24, 2, split="train")


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_service_command_modes() -> None:
    on = service_command(Path("models"), 8123)
    dynamic = service_command(Path("models"), 8123, "dynamic")
    off = service_command(Path("models"), 8123, "batching_off")
    assert "--max-batch-size" not in on and "--no-continuous-batching" not in on
    assert dynamic[-1] == "--no-continuous-batching" and "--max-batch-size" not in dynamic
    assert off[off.index("--max-batch-size") + 1] == "1" and off[off.index("--max-wait-ms") + 1] == "0"
    assert on[on.index("--port") + 1] == "8123"
    assert on[on.index("--providers") + 1] == "CPUExecutionProvider"


def test_peak_rss_counts_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 * 2**20); import time; time.sleep(30)"])
    try:
        sampler = PeakRss(os.getpid(), interval_s=0.05).start()
        for _ in range(100):
            if tree_rss_bytes(child.pid) > 64 * 2**20:
                break
            import time

            time.sleep(0.05)
        peak = sampler.stop()
        assert peak >= tree_rss_bytes(child.pid) > 64 * 2**20
    finally:
        child.kill()
        child.wait()
    assert tree_rss_bytes(child.pid) == 0


def test_a_baseline_checkout_serves_its_own_models_when_the_path_is_relative(tmp_path: Path) -> None:
    from bench.servers import service_process

    checkout = tmp_path / "checkout"
    servers = [service_process(models, tmp_path / "log", ["--x"], checkout=at)
               for models, at in ((Path("models"), checkout), (Path("models"), None), (tmp_path / "mine", checkout))]
    assert str((checkout / "models").resolve()) in servers[0].command  # the checkout's own models
    assert servers[0].cwd == checkout.resolve() and servers[0].env["PYTHONPATH"] == str(checkout.resolve())
    assert str(Path("models").resolve()) in servers[1].command and servers[1].cwd is None
    assert str(tmp_path / "mine") in servers[2].command  # an absolute path is served as given
    assert all(server.command[-1] == "--x" for server in servers)
