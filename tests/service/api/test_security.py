"""Bearer-token auth of the inference routes, CORS closed by default, the metrics port, and
refusing to start when a model fails (`fail_on_model_error`)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from service.api import auth
from service.api.app import ModelLoadFailed
from tests.service.api.test_routes import assert_error
from tests.service.conftest import AppFactory, serving
from tests.service.fakes import FakeLoader

pytestmark = pytest.mark.anyio

KEY = "s3cret-token-for-tests"
TEXT = {"text": "abc"}


async def test_without_a_key_the_routes_are_open(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        assert (await client.post("/v1/translate", json=TEXT)).status_code == 200


@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
    f"{KEY}", "Bearer \u00e9\u00e9",
])
async def test_inference_routes_need_the_bearer_token(
    make_app: AppFactory, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"authorization": authorization.encode()}
    async with serving(make_app(api_key=KEY)) as client:
        responses = [
            await client.post("/v1/translate", json=TEXT, headers=headers),
            await client.post("/v1/summarize", json=TEXT, headers=headers),
            await client.post("/v1/attention", json={"source": "abc"}, headers=headers),
        ]
    for response in responses:
        body = assert_error(response, 401, "unauthorized")
        assert KEY not in body["error"]
        assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
async def test_the_right_token_passes_and_probes_stay_open(
    make_app: AppFactory, scheme: str
) -> None:
    async with serving(make_app(api_key=KEY)) as client:
        allowed = await client.post("/v1/translate", json=TEXT,
                                    headers={"authorization": f"{scheme} {KEY}"})
        probes = [await client.get(path) for path in ("/health/live", "/health/ready",
                                                       "/metrics")]
    assert allowed.status_code == 200
    assert [p.status_code for p in probes] == [200, 200, 200]


def test_the_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.settings import Settings

    compared: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    settings = Settings(api_key=KEY)
    auth.check_api_key(f"Bearer {KEY}", settings)
    with pytest.raises(auth.Unauthorized):
        auth.check_api_key("Basic nope", settings)
    assert compared == [(KEY.encode(), KEY.encode()), (b"nope", KEY.encode())]


def test_an_empty_key_leaves_the_routes_open(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.settings import Settings

    monkeypatch.setenv("ATTNSERVE_API_KEY", "")
    assert Settings().api_key is None
    monkeypatch.setenv("ATTNSERVE_API_KEY", KEY)
    assert Settings().api_key is not None and KEY not in repr(Settings())


async def test_cors_is_closed_unless_configured(make_app: AppFactory) -> None:
    origin = {"origin": "https://evil.example"}
    preflight = {**origin, "access-control-request-method": "POST"}
    async with serving(make_app()) as client:
        closed = await client.post("/v1/translate", json=TEXT, headers=origin)
        closed_preflight = await client.options("/v1/translate", headers=preflight)
    assert closed.status_code == 200
    assert "access-control-allow-origin" not in closed.headers
    assert "access-control-allow-origin" not in closed_preflight.headers

    app = make_app(cors_origins="https://app.example, https://other.example")
    async with serving(app) as client:
        allowed = await client.post("/v1/translate", json=TEXT,
                                    headers={"origin": "https://app.example"})
        refused = await client.options("/v1/translate", headers=preflight)
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in refused.headers


async def test_metrics_on_their_own_port(make_app: AppFactory) -> None:
    from service.observability.metrics_server import start_metrics_server

    server = start_metrics_server(0)
    try:
        port = server.server_address[1]
        async with serving(make_app(metrics_port=port)) as client:
            assert (await client.post("/v1/translate", json=TEXT)).status_code == 200
            on_main = await client.get("/metrics")
            async with httpx.AsyncClient() as scraper:
                scraped = await scraper.get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert_error(on_main, 404, "not_found")
    assert scraped.status_code == 200
    assert 'attnserve_requests_total{model="translate-en-it"' in scraped.text


def test_metrics_port_needs_one_worker() -> None:
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError, match="metrics_port"):
        Settings(metrics_port=9100, workers=2)


async def test_fail_on_model_error_refuses_to_start(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(loader=FakeLoader(failing=["summarize-en"]), fail_on_model_error=True)
    with pytest.raises(ModelLoadFailed, match="summarize-en"):
        async with app.router.lifespan_context(app):
            pass
    assert any("refusing to start" in r.message and "sha256 mismatch" in r.message
               for r in caplog.records)


async def test_fail_on_model_error_starts_when_every_model_loads(make_app: AppFactory) -> None:
    app = make_app(fail_on_model_error=True)
    async with serving(app) as client:
        assert (await client.get("/health/ready")).status_code == 200


async def test_fail_on_model_error_refuses_an_empty_repository(
    make_app: AppFactory, tmp_path: Any
) -> None:
    app = make_app(models_dir=tmp_path / "none", fail_on_model_error=True)
    with pytest.raises(ModelLoadFailed, match="no models"):
        async with app.router.lifespan_context(app):
            pass


def test_serve_with_fail_on_model_error_exits_non_zero(tmp_path: Any) -> None:
    import subprocess

    from tests.service.test_serve import free_port, serve_command

    (tmp_path / "models").mkdir()
    finished = subprocess.run(
        [*serve_command(), "serve", "--port", str(free_port()), "--models",
         str(tmp_path / "models"), "--fail-on-model-error"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert finished.returncode != 0
    assert "refusing to start (fail_on_model_error): no models found" in finished.stderr
