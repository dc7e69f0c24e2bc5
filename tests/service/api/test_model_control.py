"""Model control (`--model-control`): KServe v2's model repository routes with the stock
`tritonclient[http]` client against real servers (the tiny model on onnxruntime): a new folder
loaded, a model reloaded under load without a failed request, a reload that fails leaving the
served version serving, an unload; rows in flight finish on the version they started on (fake
models, slowed); refusals while the setting is off, without the key, for names that are no folder."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.api.app import create_app
from service.core.settings import Settings
from service.observability import metrics
from tests.service.conftest import AppFactory, serving, tiny_settings
from tests.service.fakes import FakeLoader, FakeModel
from tests.service.live_server import serve, wait_until_ready

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException

MODEL = "tiny-reverse"
TEXTS = ["abc de", "kol", "a b c"]


@pytest.fixture
def models_folder(tiny_model_repository: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repository"
    shutil.copytree(tiny_model_repository, root / MODEL)
    return root


@pytest.fixture
def control_url(models_folder: Path) -> Iterator[str]:
    with serve(create_app(tiny_settings(models_folder, max_wait_ms=5, model_control=True))) as url:
        wait_until_ready(url)
        yield url


def triton(url: str) -> Any:
    return httpclient.InferenceServerClient(url=url.removeprefix("http://"))


def infer(client: Any, model: str) -> list[str]:
    tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
    output = client.infer(model, [tensor]).as_numpy("output")
    return [t.decode() if isinstance(t, bytes) else t for t in output.tolist()]


def translate(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/translate", json={"texts": TEXTS, "model": model}, timeout=30, trust_env=False)


def model_info(url: str) -> list[str]:
    """The `attnserve_model_info` samples of the server's metrics."""
    exposition = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return [line for line in exposition.splitlines() if line.startswith("attnserve_model_info{")]


def test_a_new_folder_is_loaded_and_unloaded(control_url: str, models_folder: Path) -> None:
    client = triton(control_url)
    assert client.get_model_repository_index() == [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
    shutil.copytree(models_folder / MODEL, models_folder / "tiny-copy")
    assert {m["name"]: (m["state"], m["reason"]) for m in client.get_model_repository_index()} == \
        {MODEL: ("READY", ""), "tiny-copy": ("UNAVAILABLE", "not loaded")}
    assert not client.is_model_ready("tiny-copy")
    client.load_model("tiny-copy")
    assert client.is_model_ready("tiny-copy") and client.is_server_ready()
    assert infer(client, "tiny-copy") == infer(client, MODEL)
    assert any('model="tiny-copy"' in line for line in model_info(control_url))
    listed = httpx.get(f"{control_url}/v1/models", timeout=10, trust_env=False).json()
    assert [card["name"] for card in listed["models"]] == ["tiny-copy", MODEL]  # by name
    assert client.get_model_repository_index() == [
        {"name": "tiny-copy", "version": "1", "state": "READY", "reason": ""},
        {"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
    client.unload_model("tiny-copy")
    assert not client.is_model_ready("tiny-copy")
    assert translate(control_url, "tiny-copy").status_code == 404
    with pytest.raises(InferenceServerException) as unknown:
        client.unload_model("tiny-copy")
    assert unknown.value.status() == "404"
    assert {m["name"]: m["state"] for m in client.get_model_repository_index()} == \
        {MODEL: "READY", "tiny-copy": "UNAVAILABLE"}
    ready = httpx.post(f"{control_url}/v2/repository/index", json={"ready": True}, timeout=10, trust_env=False)
    assert [m["name"] for m in ready.json()] == [MODEL]
    assert client.is_server_ready()  # the models served are all ready
    assert not any('model="tiny-copy"' in line for line in model_info(control_url))
    assert any(f'model="{MODEL}"' in line for line in model_info(control_url))


def test_a_reload_under_load_fails_no_request(control_url: str) -> None:
    client = triton(control_url)
    before = translate(control_url, MODEL).json()["outputs"]
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            statuses.append(translate(control_url, MODEL).status_code)

    senders = [threading.Thread(target=load) for _ in range(3)]
    for sender in senders:
        sender.start()
    try:
        time.sleep(0.3)
        for _ in range(2):
            client.load_model(MODEL)  # from its folder again, while the requests keep coming
        time.sleep(0.3)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=30)
    assert len(statuses) > 10 and set(statuses) == {200}
    assert translate(control_url, MODEL).json()["outputs"] == before
    assert client.is_model_ready(MODEL)


def test_a_reload_that_fails_keeps_the_version_served(control_url: str, models_folder: Path) -> None:
    client = triton(control_url)
    before = infer(client, MODEL)
    encoder = models_folder / MODEL / "encoder.onnx"
    data = bytearray(encoder.read_bytes())
    data[len(data) // 2] ^= 0xFF  # no longer the manifest's hash
    encoder.write_bytes(bytes(data))
    with pytest.raises(InferenceServerException) as failed:
        client.load_model(MODEL)
    assert failed.value.status() == "400"
    assert f"model '{MODEL}' failed to load" in failed.value.message() and "encoder.onnx" in failed.value.message()
    assert str(models_folder) not in failed.value.message()  # no server paths
    assert client.is_model_ready(MODEL) and infer(client, MODEL) == before


@pytest.mark.parametrize("name", ["nope", "..", ".hidden", "a%2Fb", "%2E%2E"])
def test_names_that_are_no_model_folder_are_404(control_url: str, models_folder: Path, name: str) -> None:
    (models_folder / ".hidden").mkdir()
    (models_folder / ".hidden" / "manifest.json").write_text("{}")
    response = httpx.post(f"{control_url}/v2/repository/models/{name}/load", timeout=10, trust_env=False)
    assert response.status_code == 404 and "error" in response.json(), response.text  # ".." reaches no route


@pytest.mark.anyio
async def test_control_is_off_by_default_and_needs_the_key(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        refused = await client.post("/v2/repository/models/translate-en-it/unload")
        index = await client.post("/v2/repository/index")
    assert refused.status_code == 403 and "--model-control" in refused.json()["error"]
    assert index.status_code == 200 and [m["state"] for m in index.json()] == ["READY", "READY"]
    async with serving(make_app(model_control=True, api_key="s3cret")) as client:
        keyless = await client.post("/v2/repository/models/translate-en-it/unload")
        index = await client.post("/v2/repository/index")
        bad = await client.post("/v2/repository/models/translate-en-it/load",
                                json={"parameters": {"config": "{}"}}, headers={"Authorization": "Bearer s3cret"})
        keyed = await client.post("/v2/repository/models/translate-en-it/unload",
                                  headers={"Authorization": "Bearer s3cret"})
        gone = await client.post("/v1/translate", json={"text": "abc", "model": "translate-en-it"},
                                 headers={"Authorization": "Bearer s3cret"})
    assert keyless.status_code == index.status_code == 401
    assert bad.status_code == 400 and "parameters" in bad.json()["error"]
    assert keyed.status_code == 200 and gone.status_code == 404


def test_the_same_over_grpc(models_folder: Path) -> None:
    """tritonclient[grpc]'s index, load and unload: the REST routes' work and refusals."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("grpc")
    app = create_app(tiny_settings(models_folder, max_wait_ms=5, model_control=True, grpc_port=0,
                                   api_key="s3cret"))
    with serve(app) as url:
        wait_until_ready(url)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{app.state.grpc_port}")
        keyed = {"authorization": "Bearer s3cret"}
        shutil.copytree(models_folder / MODEL, models_folder / "tiny-copy")
        index = client.get_model_repository_index(headers=keyed, as_json=True)["models"]
        assert [(m["name"], m["state"], m.get("reason", "")) for m in index] == \
            [("tiny-copy", "UNAVAILABLE", "not loaded"), (MODEL, "READY", "")]
        client.load_model("tiny-copy", headers=keyed)
        assert client.is_model_ready("tiny-copy")
        with pytest.raises(InferenceServerException) as keyless:
            client.unload_model("tiny-copy")
        with pytest.raises(InferenceServerException) as overridden:
            client.load_model(MODEL, headers=keyed, config='{"backend": "onnxruntime"}')
        with pytest.raises(InferenceServerException) as unknown:
            client.load_model("nope", headers=keyed)
        client.unload_model("tiny-copy", headers=keyed)
        assert not client.is_model_ready("tiny-copy") and client.is_model_ready(MODEL)
        client.close()
    assert keyless.value.status() == "StatusCode.UNAUTHENTICATED"
    assert overridden.value.status() == "StatusCode.INVALID_ARGUMENT" and "parameters" in overridden.value.message()
    assert unknown.value.status() == "StatusCode.NOT_FOUND"


def test_model_control_needs_one_worker() -> None:
    with pytest.raises(ValueError, match="model_control needs workers=1"):
        Settings(model_control=True, workers=2)


def test_rows_in_flight_finish_on_the_version_they_started_on(models_dir: Path) -> None:
    """A stream decoding when its model is reloaded, and another when it is unloaded, each go
    on to their last token; the requests after the reload reach the new version."""
    fakes: list[FakeModel] = []

    def generator(runtime: Any) -> Any:
        fakes.append(FakeModel(step_delay_s=0.02))
        return fakes[-1].generate

    app = create_app(tiny_settings(models_dir, model_control=True), loader=FakeLoader(), generator=generator)
    long = "abcdefghijklmnopqrstuvwxyz" * 2
    with serve(app) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        wait_until_ready(url)
        before = len(fakes)
        labels = {"model": "translate-en-it", "task": "translate", "provider": "CPUExecutionProvider",
                  "variant": "fp32"}
        info = []
        for action in ("load", "unload"):
            with client.stream("POST", "/v1/translate", json={"text": long, "model": "translate-en-it",
                                                              "stream": True}) as streamed:
                lines = streamed.iter_lines()
                assert next(lines).startswith("data: ")  # decoding has begun
                answer = client.post(f"/v2/repository/models/translate-en-it/{action}")
                assert answer.status_code == 200, answer.text
                if action == "load":
                    assert len(fakes) == before + 1  # the new version's generator
                    assert client.post("/v1/translate", json={"text": "abc", "model": "translate-en-it"}).json()[
                        "outputs"][0]["text"] == "cba"
                    assert fakes[-1].batches  # the request after the reload ran on the new version
                rest = [line for line in lines if line.startswith("data: ")]
            assert '"done": true' in rest[-1] and long[::-1] in rest[-1]
            info.append(metrics.REGISTRY.get_sample_value("attnserve_model_info", labels))
    assert info == [1.0, None]  # kept by the reload (the same labels), gone with the unload
