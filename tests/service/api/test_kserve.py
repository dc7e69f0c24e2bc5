"""The KServe v2 / Open Inference Protocol routes, driven by the stock `tritonclient[http]`
client against a real server (the tiny model on onnxruntime), and their error bodies."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from service.api import open_inference
from service.core.errors import InvalidInput
from tests.service.conftest import AppFactory, serving
from tests.service.fakes import FakeLoader, FakeModel

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException

MODEL = "tiny-reverse"
TEXTS = ["abc de", "kol", "a b c", "mn o"]


@pytest.fixture
def triton(tiny_url: str) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(url=tiny_url.removeprefix("http://"))
    yield client
    client.close()


def v1_outputs(url: str, **options: Any) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        response = client.post("/v1/translate", json={"texts": TEXTS, **options})
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def as_texts(array: np.ndarray) -> list[str]:
    """BYTES elements as str (the client gives bytes for binary outputs, str for JSON ones)."""
    return [t.decode() if isinstance(t, bytes) else t for t in array.tolist()]


def texts_input(binary: bool) -> Any:
    tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_),
                               binary_data=binary)
    return tensor


def test_health_and_metadata(triton: Any) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready(MODEL)
    assert not triton.is_model_ready("no-such-model")
    server = triton.get_server_metadata()
    assert server["name"] == "attnserve" and "binary_tensor_data" in server["extensions"]
    metadata = triton.get_model_metadata(MODEL)
    assert metadata["name"] == MODEL and metadata["platform"] == "attnserve"
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert [(o["name"], o["datatype"]) for o in metadata["outputs"]] == \
        [("output", "BYTES"), ("finish_reason", "BYTES"), ("score", "FP32")]
    with pytest.raises(InferenceServerException, match="no model 'nope'"):
        triton.get_model_metadata("nope")


@pytest.mark.parametrize(("binary_in", "binary_out"), [(False, False), (True, True), (True, False)])
def test_infer_equals_v1_translate(triton: Any, tiny_url: str, binary_in: bool,
                                   binary_out: bool) -> None:
    outputs = [httpclient.InferRequestedOutput("output", binary_data=binary_out),
               httpclient.InferRequestedOutput("finish_reason", binary_data=binary_out)]
    result = triton.infer(MODEL, [texts_input(binary_in)], outputs=outputs, request_id="r1")
    expected = v1_outputs(tiny_url)
    assert as_texts(result.as_numpy("output")) == [o["text"] for o in expected]
    assert as_texts(result.as_numpy("finish_reason")) == \
        [o["finish_reason"] for o in expected]
    assert result.get_response()["model_name"] == MODEL
    assert result.get_response()["id"] == "r1"
    sent_binary = "binary_data_size" in result.get_output("output").get("parameters", {})
    assert sent_binary == binary_out
    assert as_texts(result.as_numpy("output"))[0].strip() == "ed cba"  # the model reverses


def test_infer_with_parameters_and_default_outputs(triton: Any, tiny_url: str) -> None:
    result = triton.infer(MODEL, [texts_input(True)],
                          parameters={"beam_size": 3, "max_new_tokens": 2})
    expected = v1_outputs(tiny_url, beam_size=3, max_new_tokens=2)
    assert as_texts(result.as_numpy("output")) == [o["text"] for o in expected]
    assert set(as_texts(result.as_numpy("finish_reason"))) == {"length"}


@pytest.mark.parametrize("binary_out", [False, True])
def test_infer_returns_scores_and_forces_a_target_prefix(triton: Any, tiny_url: str,
                                                          binary_out: bool) -> None:
    parameters = {"beam_size": 2, "return_scores": True, "target_prefix": "a"}
    result = triton.infer(MODEL, [texts_input(True)], parameters=parameters)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["output", "finish_reason", "score"]
    expected = v1_outputs(tiny_url, beam_size=2, return_scores=True, target_prefix="a")
    assert as_texts(result.as_numpy("output")) == [o["text"] for o in expected]
    assert all(o["text"].startswith("a") for o in expected)
    scores = result.as_numpy("score")
    assert scores.dtype == np.float32 and scores.shape == (len(TEXTS),)
    assert scores.tolist() == pytest.approx([o["score"] for o in expected], abs=1e-5)
    # asking for the output by name scores too; without either, no score is computed or sent
    named = triton.infer(MODEL, [texts_input(False)],
                         outputs=[httpclient.InferRequestedOutput("score", binary_data=binary_out)])
    assert [o["name"] for o in named.get_response()["outputs"]] == ["score"]
    assert ("binary_data_size" in named.get_output("score").get("parameters", {})) == binary_out
    assert named.as_numpy("score").tolist() == \
        pytest.approx([o["score"] for o in v1_outputs(tiny_url, return_scores=True)], abs=1e-5)
    plain = triton.infer(MODEL, [texts_input(False)])
    assert [o["name"] for o in plain.get_response()["outputs"]] == ["output", "finish_reason"]


def test_infer_errors_through_the_client(triton: Any) -> None:
    too_long = httpclient.InferInput("text", [1], "BYTES")
    too_long.set_data_from_numpy(np.array([b"abcdefghijklmno abc"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="at most 15 allowed") as caught:
        triton.infer(MODEL, [too_long])
    assert caught.value.status() == "400"
    with pytest.raises(InferenceServerException, match="beam_size") as caught:
        triton.infer(MODEL, [texts_input(False)], parameters={"beam_size": 99})
    assert caught.value.status() == "400"
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("nope", [texts_input(False)])
    assert caught.value.status() == "404"


def infer_body(data: Any, **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "shape": [len(data)], "datatype": "BYTES",
                        "data": data}], **extra}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"inputs": []}, 400, "inputs"),
        (infer_body(["abc"], parameters={"temperature": 1.0, "beam_size": 2}), 400, "temperature"),
        (infer_body(["abc"], parameters={"top_p": 0.5}), 400, "parameters.top_p: applies to sampling only"),
        (infer_body(["abc"], parameters={"temperature": -0.5}), 400, "temperature"),
        (infer_body(["abc"], parameters={"beam_size": "2"}), 400, "beam_size"),
        (infer_body(["abc"], outputs=[{"name": "logits"}]), 400, "unknown output"),
        (infer_body(["abc"], parameters={"return_scores": "yes"}), 400, "return_scores"),
        (infer_body(["abc"], parameters={"target_prefix": ["a"]}), 400, "target_prefix"),
        (infer_body(["abc"], parameters={"target_prefix": "a" * 64}), 400,
         "parameters.target_prefix: 64 tokens; at most 63 allowed"),
        (infer_body(["abc"], parameters={"num_hypotheses": 2}), 400, "num_hypotheses"),
        (infer_body([""]), 400, "empty"),
        (infer_body([5]), 400, "strings"),
        (infer_body(["a"] * 17), 400, "at most 16"),
        ({"inputs": [{"name": "txt", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}, 400,
         "expected one input 'text'"),
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400,
         "BYTES"),
        ({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a"]}]}, 400,
         "holds 2 elements"),
    ],
)
async def test_bad_infer_requests_get_the_protocol_error(
    make_app: AppFactory, body: Any, status: int, message: str
) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v2/models/translate-en-it/infer", json=body)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and message in response.json()["error"]


@pytest.mark.anyio
async def test_protocol_errors_and_statuses(make_app: AppFactory) -> None:
    loader = FakeLoader()
    loader.release.clear()  # models stay loading
    async with serving(make_app(loader=loader), wait_ready=False) as client:
        loading_ready = await client.get("/v2/health/ready")
        loading_model = await client.get("/v2/models/translate-en-it/ready")
        loading_infer = await client.post("/v2/models/translate-en-it/infer",
                                          json=infer_body(["abc"]))
        metadata = await client.get("/v2/models/translate-en-it")
        loader.release.set()
        while (await client.get("/v2/health/ready")).status_code != 200:
            await asyncio.sleep(0.01)  # in-process requests may never yield to the loop
        unknown = await client.get("/v2/models/nope/ready")
        bad_version = await client.get("/v2/models/translate-en-it/versions/7")
        not_json = await client.post("/v2/models/translate-en-it/infer", content=b"{nope")
        live = await client.get("/v2/health/live")
        matrix = {"id": "x", "inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES",
                                         "data": [["abc"], ["hello"]]}]}
        ok = await client.post("/v2/models/summarize-en/versions/1/infer", json=matrix)
    for response in (loading_ready, loading_model, loading_infer):
        assert response.status_code == 503 and set(response.json()) == {"error"}
    assert metadata.status_code == 200 and metadata.json()["name"] == "translate-en-it"
    assert unknown.status_code == 404 and bad_version.status_code == 404
    assert set(unknown.json()) == {"error"}
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]
    assert live.status_code == 200 and live.content == b""
    assert ok.status_code == 200, ok.text
    timing = [metric.split(";")[0].strip() for metric in ok.headers["server-timing"].split(",")]
    assert timing[0] == "prepare" and "inference" in timing and timing[-1] == "total"
    assert ok.json() == {
        "model_name": "summarize-en", "model_version": "1", "id": "x",
        "outputs": [
            {"name": "output", "shape": [2, 1], "datatype": "BYTES", "data": ["cba", "olleh"]},
            {"name": "finish_reason", "shape": [2, 1], "datatype": "BYTES",
             "data": ["eos", "eos"]},
        ],
    }


@pytest.mark.anyio
async def test_a_full_queue_is_a_429_with_retry_after(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    fake_model.delay_s = 0.3
    async with serving(make_app(max_queue_size=2, max_texts=2, max_batch_size=1)) as client:
        first = asyncio.ensure_future(client.post("/v2/models/translate-en-it/infer",
                                                  json=infer_body(["ab", "cd"])))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(client.post("/v2/models/translate-en-it/infer",
                                                   json=infer_body(["ab", "cd"])))
        await asyncio.sleep(0.05)
        refused = await client.post("/v2/models/translate-en-it/infer",
                                    json=infer_body(["ab", "cd"]))
        await asyncio.gather(first, second)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert "server-timing" not in refused.headers  # a refused request went through no stage
    assert "server-timing" in (await first).headers
    assert set(refused.json()) == {"error"} and "full" in refused.json()["error"]


def test_binary_tensor_data_round_trip() -> None:
    texts = ["ciao", "", "è più"]
    packed = open_inference.serialize_bytes(texts)
    assert packed[:8] == struct.pack("<I", 4) + b"ciao"
    assert [b.decode() for b in open_inference.deserialize_bytes(packed)] == texts
    with pytest.raises(InvalidInput, match="truncated"):
        open_inference.deserialize_bytes(packed[:-1])
    header = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    body = header + open_inference.serialize_bytes(["ciao"])
    parsed = open_inference.parse_request(body, str(len(header)))
    assert parsed.texts == ["ciao"] and parsed.outputs == {"output": False,
                                                           "finish_reason": False}
    with pytest.raises(InvalidInput, match="binary_data_size"):
        open_inference.parse_request(body + b"x", str(len(header)))
    with pytest.raises(InvalidInput, match="does not fit"):
        open_inference.parse_request(body, str(len(body) + 1))
