"""An app over fake models of known capacity, for load tests run as a separate server process.

    python -m uvicorn tests.service.load_app:create_load_app --factory --port 8000

The fake model sleeps `ATTNSERVE_FAKE_DELAY_S` (default 0.05) per batch in the worker thread,
so with `ATTNSERVE_MAX_BATCH_SIZE` rows per batch and `ATTNSERVE_BATCH_WORKERS` workers the
capacity is about workers x max_batch_size / delay requests per second, whatever else the
machine does. Every other
setting comes from the `ATTNSERVE_*` environment as usual.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fastapi import FastAPI

from service.api.app import create_app
from service.core.settings import Settings
from tests.service.fakes import FakeLoader, FakeModel, write_models


def create_load_app() -> FastAPI:
    """The app: fake translate and summarize models in a temporary models folder."""
    models = write_models(Path(tempfile.mkdtemp(prefix="attnserve-load-")) / "models",
                          {"translate-en-it": "translate", "summarize-en": "summarize"})
    model = FakeModel(delay_s=float(os.environ.get("ATTNSERVE_FAKE_DELAY_S", "0.05")))
    model.seen = _NotRecorded()  # a long run must not grow the test's memory
    model.batches = _NotRecorded()
    model.steps = _NotRecorded()
    return create_app(Settings(models_dir=models), loader=FakeLoader(),
                      generator=lambda runtime: model.generate)


class _NotRecorded(list):  # type: ignore[type-arg]
    """A list that forgets what is added (the fake model's records, unbounded otherwise)."""

    def append(self, item: object) -> None:
        pass

    def extend(self, items: object) -> None:
        pass
