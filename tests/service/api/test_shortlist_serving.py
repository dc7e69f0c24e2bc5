"""The real app serving a repository with a vocabulary shortlist (`attnserve add-shortlist`): the
int8 runtime loads it, `/v1/models` says at how many rows it is used, and the translations are
the whole vocabulary's (the tiny reversal model's outputs are all in its table)."""

from __future__ import annotations

import json
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from service.api.app import create_app
from service.core.settings import Settings
from tests.service.live_server import serve, wait_until_ready

TEXTS = ["abc de", "o", "mno abc", "a b c d", "fgh ij kl"]


@pytest.fixture(scope="module")
def models_dir(tiny_model_repository: Path, tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from export.shortlist import add_shortlist

    root = tmp_path_factory.mktemp("shortlist-models")
    shutil.copytree(tiny_model_repository, root / "tiny-reverse")
    add_shortlist(root / "tiny-reverse", tiny_data_dir, k=3, frequent=0, rows=8, max_drop=None, threads=1)
    return root


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with OPENER.open(request, timeout=30) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _serve(models_dir: Path, shortlist_rows: int) -> tuple[dict[str, Any], list[str], list[str]]:
    """The model's card, the translations of `TEXTS` one request at a time, and those of 6 x
    `TEXTS` sent 8 at a time (rows join and leave a running batch, its shortlist changing); a
    shortlist of any share of the tiny vocabulary (20 pieces) is used."""
    settings = Settings(models_dir=models_dir, providers=("CPUExecutionProvider",), threads=1, variant="int8",
                        shortlist_rows=shortlist_rows, shortlist_share=1.0, batch_workers=1)
    with serve(create_app(settings)) as url:
        wait_until_ready(url)
        card = _get(f"{url}/v1/models")["models"][0]
        outputs = [_get(f"{url}/v1/translate", {"text": text})["outputs"][0]["text"] for text in TEXTS]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda text: _get(f"{url}/v1/translate", {"text": text})["outputs"][0]["text"],
                                     TEXTS * 6))
    return card, outputs, together


def test_the_shortlist_serves_small_batches_and_gives_the_whole_vocabularys_tokens(models_dir: Path) -> None:
    card, outputs, together = _serve(models_dir, 4)
    assert card["variant"] == "int8" and card["batching"]["continuous"]
    assert card["batching"]["shortlist_rows"] == 4
    assert len(together) == 6 * len(TEXTS)  # every request answered (urllib raises on an error status)
    off_card, off_outputs, _ = _serve(models_dir, 0)
    assert off_card["batching"]["shortlist_rows"] == 0
    assert outputs == off_outputs
    assert outputs[0].strip() == "ed cba"  # the tiny int8 model adds a space at times
