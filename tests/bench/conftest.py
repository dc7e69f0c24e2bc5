"""Fixtures of the benchmark tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def tiny_bench_dirs(tiny_model_repository: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(models folder holding `tiny-reverse`, data folder with its `test.src`), as the bench reads them."""
    models = tmp_path / "models"
    shutil.copytree(tiny_model_repository, models / "tiny-reverse")
    data = tmp_path / "data"
    (data / "tiny-reverse").mkdir(parents=True)
    shutil.copy(tiny_model_repository.parent / "data" / "test.src", data / "tiny-reverse" / "test.src")
    return models, data
