"""What the benchmark ran on: CPU model, cores, load, library versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
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


# Other distributions that install the same module (onnxruntime's CUDA build is `onnxruntime-gpu`)
DISTRIBUTIONS = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu")}


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Version of each package: the imported module's `__version__` when it is imported (the one
    in use, whichever distribution installed it), else the first installed distribution's; None
    when it is not installed."""
    found: dict[str, str | None] = {}
    for name in packages:
        found[name] = getattr(sys.modules.get(name), "__version__", None)
        for distribution in DISTRIBUTIONS.get(name, (name,)):
            if found[name] is not None:
                break
            try:
                found[name] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                pass
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
