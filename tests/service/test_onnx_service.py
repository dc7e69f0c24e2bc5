"""The service over a real exported model (the tiny reversal model, onnxruntime on CPU).

The service's outputs must equal the PyTorch reference decoding of the same checkpoint, alone
or batched with other requests; the committed default models are checked when present (slow).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from model.checkpoint import load_model
from model.decoding import beam_search, pad_batch
from model.tokenizer import Tokenizer
from service.api.app import create_app
from tests.service.conftest import serving, tiny_settings, wait_until_settled

pytestmark = pytest.mark.anyio

# Over the tiny tokenizer's alphabet (a-o): 1 to 15 text tokens (16 with EOS is the limit).
TEXTS = ["abc de", "a", "fgh", "ij klm", "no", "a b c", "mlk", "hello", "ab cd ef", "o n m l",
         "abcdefghijklmn", "gf ed"]
ROOT = Path(__file__).resolve().parents[2]








@pytest.fixture(scope="module")
def reference(tiny_repository_model: Any, tiny_repository_tokenizer: Tokenizer) -> Any:
    """`reference(text, beam_size, max_new_tokens)`: PyTorch decoding of one text, alone."""
    model, tokenizer = tiny_repository_model, tiny_repository_tokenizer

    def decode(text: str, beam_size: int, max_new_tokens: int) -> dict[str, Any]:
        source = pad_batch([[*tokenizer.encode(text), tokenizer.eos_id]], tokenizer.pad_id)
        with one_torch_thread():
            [result] = beam_search(model, source, beam_size, max_new_tokens)
        return {"text": tokenizer.decode(result.tokens), "finish_reason": result.finish_reason,
                "output_tokens": len(result.tokens)}

    return decode


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a busy machine: one thread is ~100x faster than contended OpenMP."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def without_input_tokens(output: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in output.items() if k != "input_tokens"}


@pytest.mark.parametrize("beam_size", [1, 3, 8])
@pytest.mark.parametrize("max_new_tokens", [None, 4])
async def test_outputs_equal_the_pytorch_reference(
    served_tiny_models: Path, reference: Any, beam_size: int, max_new_tokens: int | None
) -> None:
    body: dict[str, Any] = {"texts": TEXTS, "beam_size": beam_size}
    if max_new_tokens is not None:
        body["max_new_tokens"] = max_new_tokens
    async with serving(create_app(tiny_settings(served_tiny_models))) as client:
        response = await client.post("/v1/translate", json=body)
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    limit = max_new_tokens or 16
    expected = [reference(text, beam_size, limit) for text in TEXTS]
    assert [without_input_tokens(o) for o in outputs] == expected
    if max_new_tokens is None and beam_size == 1:  # the tiny model learnt to reverse
        assert outputs[0]["text"].strip() == "ed cba"


@pytest.mark.parametrize("batch_workers", [1, 2])
async def test_concurrent_requests_are_batched_and_equal_alone(served_tiny_models: Path, batch_workers: int) -> None:
    """Also with two batch workers: two running batches step the shared sessions at once."""
    app = create_app(tiny_settings(served_tiny_models, max_wait_ms=20, batch_workers=batch_workers))
    bodies = [{"text": TEXTS[i % len(TEXTS)], "beam_size": 1 + (i % 2)} for i in range(64)]
    async with serving(app) as client:
        alone = [(await client.post("/v1/translate", json=b)).json() for b in bodies[:4]]
        responses = await asyncio.gather(*(client.post("/v1/translate", json=b) for b in bodies))
        [card] = (await client.get("/v1/models")).json()["models"]
    assert all(r.status_code == 200 for r in responses)
    assert [r.json() for r in responses[:4]] == alone
    for i, response in enumerate(responses):
        assert response.json() == responses[i % len(TEXTS)].json()
    batching = card["batching"]
    assert batching["rows"] >= 68 and batching["max_batch_rows"] > 1
    assert batching["batches"] < batching["rows"]
    # the running batches keep their slot buffers between requests (within `keep_bytes`)
    assert batching["continuous"] and batching["max_cache_bytes"] >= batching["cache_bytes"] > 0
    pool = app.state.registry.resolve("translate", None).batcher
    assert len(pool.batchers) == batching["workers"] == batch_workers
    assert all(b.counters.rows > 0 for b in pool.batchers)  # every worker took requests


async def test_models_reports_the_provider_and_variant(
    served_tiny_models: Path, tiny_model_repository: Path
) -> None:
    async with serving(create_app(tiny_settings(served_tiny_models, variant=None))) as client:
        [card] = (await client.get("/v1/models")).json()["models"]
        exposition = (await client.get("/metrics")).text
    assert card["name"] == tiny_model_repository.name
    assert card["task"] == "translate" and card["ready"]
    assert card["provider"] == "CPUExecutionProvider"
    assert card["variant"] in {"int8", "fp32"}  # int8 on CPU when its quality is within bound
    assert (card["max_source_len"], card["max_target_len"]) == (16, 16)
    assert card["step_graph"] is True and card["gpu_memory_limit_mb"] is None  # the CPU serves its step graph
    assert card["lone_step"] is False  # and no lone slot: its slots live in host memory
    async with serving(create_app(tiny_settings(served_tiny_models, step_graph=False))) as client:
        [merged] = (await client.get("/v1/models")).json()["models"]
    assert merged["step_graph"] is False
    assert f'attnserve_model_info{{model="{card["name"]}",provider="CPUExecutionProvider"' \
           in exposition


async def test_token_limits_of_the_model(served_tiny_models: Path) -> None:
    async with serving(create_app(tiny_settings(served_tiny_models))) as client:
        long = await client.post("/v1/translate", json={"text": "abcdefghijklmno a"})
        too_many = await client.post("/v1/translate", json={"text": "ab", "max_new_tokens": 17})
        wrong_task = await client.post("/v1/summarize", json={"text": "ab"})
    assert long.status_code == 422 and "tokens; at most 15" in long.json()["error"]
    assert too_many.status_code == 422 and "max_new_tokens" in too_many.json()["error"]
    assert wrong_task.status_code == 404 and wrong_task.json()["error_type"] == "model_not_found"


async def test_a_repository_failing_its_hash_check_is_live_not_ready(
    tiny_model_repository: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "models" / "broken"
    shutil.copytree(tiny_model_repository, broken)
    decoder = broken / "decoder.onnx"
    data = bytearray(decoder.read_bytes())
    data[-1] ^= 0xFF
    decoder.write_bytes(bytes(data))
    async with serving(create_app(tiny_settings(tmp_path / "models")), wait_ready=False) as client:
        [card] = (await wait_until_settled(client)).values()
        ready = await client.get("/health/ready")
        live = await client.get("/health/live")
    assert card["state"] == "failed" and "sha256" in card["error"]
    assert ready.status_code == 503 and live.status_code == 200


COMMITTED = sorted(p.parent for p in (ROOT / "models").glob("*/manifest.json"))


@pytest.mark.slow
@pytest.mark.skipif(not COMMITTED, reason="no committed models in models/")
async def test_committed_default_models_serve_like_pytorch() -> None:
    app = create_app(tiny_settings(ROOT / "models"))
    async with serving(app) as client:
        cards = (await client.get("/v1/models")).json()["models"]
        for card in cards:
            path = ROOT / "models" / card["name"]
            model = load_model(path)
            tokenizer = Tokenizer.from_file(path / "tokenizer.model")
            text = "Package manager for the Debian system."
            response = await client.post(f"/v1/{card['task']}",
                                         json={"text": text, "model": card["name"]})
            assert response.status_code == 200, response.text
            source = pad_batch([[*tokenizer.encode(text), tokenizer.eos_id]], tokenizer.pad_id)
            with one_torch_thread():
                [expected] = beam_search(model, source, 1, card["max_target_len"])
            assert response.json()["outputs"][0]["text"] == tokenizer.decode(expected.tokens)
