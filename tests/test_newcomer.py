"""A newcomer's first run, as the README tells it: a fresh clone, `make serve`, every README
example with its documented output, SIGTERM; then the package built as a wheel and served from
outside the source tree. Marked `newcomer` (`make test-newcomer`; CI runs it on every
submission): it installs the serving extra into the clone's own virtualenv."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tests.readme_examples import MANUAL, examples, mismatch
from tests.service.test_serve import free_port

pytestmark = pytest.mark.newcomer

ROOT = Path(__file__).resolve().parents[1]
INSTALL_AND_START_S = 900  # venv creation, the serving extra from the package index, model loading


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def _running(argv: list[str], cwd: Path, port: int, log: Path, timeout_s: float) -> Iterator[subprocess.Popen]:
    """Start `argv`, wait until the server on `port` is ready, and yield the process; on exit
    kill whatever is left of its process group."""
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")})
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(port):
            if process.poll() is not None:
                pytest.fail(f"{' '.join(argv)} exited {process.returncode} before it was ready:\n"
                            + log.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                pytest.fail(f"not ready after {timeout_s} s:\n" + log.read_text(errors="replace")[-3000:])
            time.sleep(1)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _sigterm_server(process: subprocess.Popen) -> None:
    """SIGTERM the `attnserve serve` process (the command itself or its child under make), as
    a process manager would, and expect the command to exit 0."""
    parent = psutil.Process(process.pid)
    servers = [p for p in [parent, *parent.children(recursive=True)]
               if any(Path(part).name == "attnserve" for part in p.cmdline()[:2])]
    assert servers, "no attnserve process"
    servers[0].send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of this repository's committed HEAD."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: nothing to clone")
    target = tmp_path_factory.mktemp("newcomer") / "attnserve"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(target)], check=True)
    return target


def test_make_serve_runs_every_readme_example(clone: Path, tmp_path: Path) -> None:
    port = free_port()
    with _running(["make", "serve", f"PORT={port}"], clone, port, tmp_path / "serve.log",
                  INSTALL_AND_START_S) as server:
        found = [(page, e) for page in MANUAL for e in examples((clone / page).read_text(encoding="utf-8"))]
        assert len(found) >= 10 and {page for page, _ in found} == set(MANUAL)
        failures = []
        for page, example in found:
            result = example.run(f"localhost:{port}")
            if result.returncode != 0:
                failures.append(f"{page} line {example.line}: exit {result.returncode}: {result.stderr[-500:]}")
            elif (differs := mismatch(example, result.stdout)) is not None:
                failures.append(f"{page} line {example.line}: {differs}")
        assert not failures, "\n".join(failures)
        _sigterm_server(server)


def test_the_serving_environment_has_no_training_stack_and_says_what_is_missing(clone: Path) -> None:
    """After `make serve` (the test above), the clone's virtualenv has the serve extra only."""
    attnserve = clone / ".venv" / "bin" / "attnserve"
    if not attnserve.exists():
        pytest.skip("make serve did not run")
    python = clone / ".venv" / "bin" / "python"
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, check=False).returncode != 0
    subprocess.run([attnserve, "--help"], capture_output=True, check=True)
    for command in (["bench", "--quick"], ["train", "--config", "x.yaml"]):
        result = subprocess.run([attnserve, *command], capture_output=True, text=True, check=False)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "pip install 'attnserve[" in result.stderr


def test_the_built_wheel_serves_the_default_models(clone: Path, tmp_path: Path) -> None:
    pytest.importorskip("build")
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(clone)],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "Warning" not in built.stdout + built.stderr
    wheel = next((tmp_path / "dist").glob("attnserve-*.whl"))
    assert next((tmp_path / "dist").glob("attnserve-*.tar.gz"))

    venv = clone / ".venv"  # make serve's: the serving extra is there; the wheel replaces the editable install
    if not (venv / "bin" / "attnserve").exists():
        pytest.skip("make serve did not run")
    subprocess.run([venv / "bin" / "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)],
                   check=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run([venv / "bin" / "python", "-c", "import service; print(service.__file__)"],
                           cwd=outside, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in where and str(venv) in where  # the installed package, not a source tree

    port = free_port()
    argv = [str(venv / "bin" / "attnserve"), "serve", "--port", str(port), "--models", str(clone / "models")]
    with _running(argv, outside, port, tmp_path / "wheel.log", 300) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert "attention explorer" in page.read().decode().lower()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/translate", headers={"content-type": "application/json"},
            data=json.dumps({"text": "This package contains the shared library."}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["outputs"][0]["text"] == "Questo pacchetto contiene la libreria condivisa."
        _sigterm_server(server)
