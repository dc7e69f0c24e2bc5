"""What the benchmark ran on: CPU model, cores, load, library versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

PACKAGES = ("onnxruntime", "ctranslate2", "torch", "numpy", "fastapi", "uvicorn", "httpx")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each package, None when it is not installed."""
    found: dict[str, str | None] = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def describe() -> dict[str, Any]:
    """Machine facts to store beside the results."""
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "versions": versions(),
    }
