"""`GET /metrics` after real requests: the app over the tiny exported model (onnxruntime, CPU).

A known set of requests goes through the real app once per module: translations (one of them
carrying a unique marker), a 429 forced with a queue of two rows, two 422s, a 404 for an
unknown model and one for an unknown path. The exposition is scraped before and after, and
the differences must be what those requests imply. `service.observability.metrics.REGISTRY` is global to
the process and other tests observe into it (the same model name included), so every count
is compared as a difference and per-model values are read for this app's model only.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from model.tokenizer import Tokenizer
from service.api.app import UNMATCHED_ROUTE, create_app
from service.core.settings import Settings
from service.observability import metrics
from tests.service.conftest import serving

TRANSLATE = "/v1/translate"
CPU = "CPUExecutionProvider"
# Unique per run, never a label value: letters outside the tiny alphabet (a-o) and hex digits.
MARKER = f"Q{uuid.uuid4().hex[:6]}"
# A batch waits this long to fill (the queue holds 2 rows, a batch 4): the two concurrent
# requests of the overload step meet a full queue, whichever is admitted first.
WAIT_MS = 400.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Run:
    """What the module's requests returned, and the expositions around them."""

    model: str
    before: Samples
    after: Samples
    exposition: str
    content_type: str
    card: dict[str, Any]
    batches_before: int
    rows_before: int
    ok: list[tuple[list[str], httpx.Response]]  # (texts sent, 200 response)
    statuses: list[int]  # of every /v1/translate request, in the order sent
    retry_after: list[str | None]  # of the 429s
    templates: set[str]

    def delta(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)

    def value(self, name: str, **labels: str) -> float:
        return self.after[(name, frozenset(labels.items()))]


def parse(text: str) -> Samples:
    """(sample name, labels) -> value of every sample of an exposition."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def route_templates(app: FastAPI) -> set[str]:
    """The path templates of the app's routes (FastAPI may wrap included routers)."""
    templates = set(app.openapi()["paths"])
    for route in app.routes:
        for inner in getattr(getattr(route, "original_router", None), "routes", [route]):
            if isinstance(getattr(inner, "path", None), str):
                templates.add(inner.path)
    return templates


async def _send(models_dir: Path, model: str) -> Run:
    settings = Settings(
        models_dir=models_dir,
        providers=(CPU,),
        threads=1,
        batch_workers=1,  # one queue of 2 rows: the third row is refused
        max_queue_size=2,
        max_texts=2,
        max_batch_size=4,
        max_wait_ms=WAIT_MS,
        continuous_batching=False,  # the overload step needs a batch that waits to fill
    )
    app = create_app(settings)
    templates = route_templates(app)
    ok: list[tuple[list[str], httpx.Response]] = []
    statuses: list[int] = []

    async def translate(body: dict[str, Any]) -> httpx.Response:
        response = await client.post(TRANSLATE, json=body)
        statuses.append(response.status_code)
        if response.status_code == 200:
            ok.append((body["texts"] if "texts" in body else [body["text"]], response))
        return response

    async with serving(app) as client:
        [card] = (await client.get("/v1/models")).json()["models"]
        batches_before, rows_before = card["batching"]["batches"], card["batching"]["rows"]
        before = parse((await client.get("/metrics")).text)
        # Overload: two requests of 2 rows each on a queue of 2 rows: one of them is refused.
        overload = await asyncio.gather(
            translate({"texts": ["abc de", "fgh"]}), translate({"texts": ["ij klm", "mlk"]})
        )
        # Translations, one at a time; one carries the marker through the whole path.
        await translate({"text": f"abc {MARKER}"})
        await translate({"texts": ["no", "a b c"], "beam_size": 2})
        await translate({"text": "o n m l", "max_new_tokens": 3})
        # Refused before the model: schema (422), unknown model (404, named by the marker).
        await translate({"texts": []})
        await translate({"text": "abc", "model": MARKER})
        # Refused by the configured limits once the model is known (422).
        await translate({"texts": ["ab", "cd", MARKER]})
        unknown = await client.get(f"/v1/{MARKER}/x")
        [card] = (await client.get("/v1/models")).json()["models"]
        scrape = await client.get("/metrics")
    assert unknown.status_code == 404
    assert scrape.status_code == 200
    return Run(
        model=model,
        before=before,
        after=parse(scrape.text),
        exposition=scrape.text,
        content_type=scrape.headers["content-type"],
        card=card,
        batches_before=batches_before,
        rows_before=rows_before,
        ok=ok,
        statuses=statuses,
        retry_after=[r.headers.get("retry-after") for r in overload if r.status_code == 429],
        templates=templates,
    )


@pytest.fixture(scope="module")
def run(tiny_model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The requests above, sent once to an app over a copy of the tiny repository."""
    root = tmp_path_factory.mktemp("metrics-models")
    shutil.copytree(tiny_model_repository, root / tiny_model_repository.name)
    return asyncio.run(_send(root, tiny_model_repository.name))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_repository: Path) -> Tokenizer:
    return Tokenizer.from_file(tiny_model_repository / "tokenizer.model")


def test_the_requests_got_the_expected_statuses(run: Run) -> None:
    assert sorted(run.statuses[:2]) == [200, 429]
    assert run.statuses[2:] == [200, 200, 200, 422, 404, 422]
    assert run.retry_after == ["1"]
    assert run.content_type == metrics.CONTENT_TYPE


def test_requests_total_by_route_model_and_status_class(run: Run) -> None:
    name, model = "attnserve_requests_total", run.model
    assert run.delta(name, route=TRANSLATE, model=model, status="2xx") == 4
    # The 429 and the limit's 422 come after the model is resolved, so they carry its name;
    # the schema's 422 and the unknown model's 404 carry none (never the name asked for).
    assert run.delta(name, route=TRANSLATE, model=model, status="4xx") == 2
    assert run.delta(name, route=TRANSLATE, model="", status="4xx") == 2
    assert run.delta(name, route=TRANSLATE, model=model, status="5xx") == 0
    assert run.delta(name, route=UNMATCHED_ROUTE, model="", status="4xx") == 1
    assert run.delta(name, route="/metrics", model="", status="2xx") == 1  # the first scrape


def test_request_duration_counts_every_request_of_a_route(run: Run) -> None:
    counted: Counter[tuple[str, str]] = Counter()
    for name, labels in run.after:
        if name == "attnserve_requests_total":
            label = dict(labels)
            counted[label["route"], label["model"]] += int(run.delta(name, **label))
    for route, model in [(TRANSLATE, run.model), (TRANSLATE, ""), (UNMATCHED_ROUTE, "")]:
        duration = "attnserve_request_duration_seconds"
        assert counted[route, model] > 0
        assert run.delta(f"{duration}_count", route=route, model=model) == counted[route, model]
        assert run.delta(f"{duration}_sum", route=route, model=model) > 0


def test_batch_size_matches_the_batcher_counters(run: Run) -> None:
    batches = run.card["batching"]["batches"] - run.batches_before
    rows = run.card["batching"]["rows"] - run.rows_before
    assert rows == sum(len(texts) for texts, _ in run.ok) == 6
    assert batches == 4  # each request's rows batch alone: the overload's, then one at a time
    assert run.delta("attnserve_batch_size_count", model=run.model) == batches
    assert run.delta("attnserve_batch_size_sum", model=run.model) == rows


def test_queue_and_inference_are_timed_per_row(run: Run) -> None:
    rows = sum(len(texts) for texts, _ in run.ok)
    for stage in ("queue", "inference"):
        name = f"attnserve_{stage}_duration_seconds"
        assert run.delta(f"{name}_count", model=run.model) == rows
        assert run.delta(f"{name}_sum", model=run.model) > 0
    # Every batch waited WAIT_MS to fill (none reached 4 rows).
    assert run.delta("attnserve_queue_duration_seconds_sum", model=run.model) >= (
        rows * WAIT_MS / 1000 * 0.9
    )


def test_token_counters_equal_the_responses_usage(run: Run, tokenizer: Tokenizer) -> None:
    outputs = [o for _, r in run.ok for o in r.json()["outputs"]]
    texts = [text for texts, _ in run.ok for text in texts]
    # The service counts a source's tokens with its EOS, as the response's `input_tokens`.
    assert [o["input_tokens"] for o in outputs] == [len(tokenizer.encode(t)) + 1 for t in texts]
    input_tokens = sum(r.json()["usage"]["input_tokens"] for _, r in run.ok)
    output_tokens = sum(r.json()["usage"]["output_tokens"] for _, r in run.ok)
    assert output_tokens > 0
    assert run.delta("attnserve_input_tokens_total", model=run.model) == input_tokens
    assert run.delta("attnserve_generated_tokens_total", model=run.model) == output_tokens
    generating = sum(1 for o in outputs if o["output_tokens"] > 0)
    per_token = "attnserve_time_per_output_token_seconds"
    assert run.delta(f"{per_token}_count", model=run.model) == generating > 0
    assert run.delta(f"{per_token}_sum", model=run.model) > 0


def test_queue_depth_is_back_to_zero(run: Run) -> None:
    assert run.value("attnserve_queue_depth", model=run.model) == 0


def test_rejections_by_reason(run: Run) -> None:
    name = "attnserve_rejected_total"
    assert run.delta(name, model=run.model, reason="queue_full") == 1
    for reason in ("deadline", "draining", "disconnected"):
        assert run.delta(name, model=run.model, reason=reason) == 0


def test_model_info_names_the_provider_and_variant_in_use(run: Run) -> None:
    card = run.card
    assert card["provider"] == CPU
    assert card["variant"] in {"int8", "fp32"}
    info = {"model": run.model, "task": "translate", "provider": CPU, "variant": card["variant"]}
    assert run.value("attnserve_model_info", **info) == 1
    assert run.value("attnserve_model_load_seconds", model=run.model) > 0


def test_label_values_are_bounded(run: Run) -> None:
    assert MARKER not in run.exposition
    routes = {dict(labels)["route"] for _, labels in run.after if dict(labels).get("route")}
    # the app's route templates, and the gRPC methods' paths (tests of the gRPC server count them)
    grpc_paths = set(pytest.importorskip("service.api.grpc_messages").PATHS)
    assert routes <= run.templates | {UNMATCHED_ROUTE} | grpc_paths
    statuses = {dict(labels)["status"] for _, labels in run.after if "status" in dict(labels)}
    assert statuses <= {"1xx", "2xx", "3xx", "4xx", "5xx"}


def test_promtool_accepts_the_real_exposition(run: Run) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian/Ubuntu package `prometheus`)")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=run.exposition.encode(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
