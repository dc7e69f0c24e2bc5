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
    from service.core.settings import Settings

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
    from service.core.settings import Settings

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

    from service.core.settings import Settings

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


METADATA_ROUTES = ["/openapi.json", "/docs", "/redoc", "/v1/models",
                   "/v2/models/translate-en-it", "/v2/models/translate-en-it/versions/1"]


async def test_docs_and_model_listing_need_the_key_when_one_is_set(make_app: AppFactory) -> None:
    bearer = {"authorization": f"Bearer {KEY}"}
    async with serving(make_app(api_key=KEY)) as client:
        refused = [await client.get(path) for path in METADATA_ROUTES]
        allowed = [await client.get(path, headers=bearer) for path in METADATA_ROUTES]
        probes = [await client.get(path) for path in (
            "/health/ready", "/v2/health/ready", "/v2/models/translate-en-it/ready", "/")]
    for response in refused:
        assert response.status_code == 401, (response.url, response.status_code)
        assert KEY not in response.text
    assert [r.status_code for r in allowed] == [200] * len(METADATA_ROUTES)
    assert allowed[0].json()["info"]["title"] == "attnserve"
    assert "swagger-ui" in allowed[1].text and "/openapi.json" in allowed[1].text
    assert [p.status_code for p in probes] == [200] * 4


async def test_public_metadata_leaves_the_docs_open_but_not_inference(
    make_app: AppFactory,
) -> None:
    async with serving(make_app(api_key=KEY, public_metadata=True)) as client:
        opened = [await client.get(path) for path in METADATA_ROUTES]
        inference = await client.post("/v1/translate", json=TEXT)
    assert [r.status_code for r in opened] == [200] * len(METADATA_ROUTES)
    assert_error(inference, 401, "unauthorized")


async def test_without_a_key_the_docs_are_open(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        assert [(await client.get(path)).status_code for path in METADATA_ROUTES] == \
            [200] * len(METADATA_ROUTES)


class PathLeakingLoader(FakeLoader):
    """Fails one model the way file errors read: with the absolute path of the file."""

    def __call__(self, path: Any) -> Any:
        if path.name == "summarize-en":
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{path}/encoder.onnx'"
                                    f" (also tried {path.parent.parent}/cache/encoder.onnx)")
        return super().__call__(path)


async def test_load_errors_are_listed_without_file_system_paths(
    make_app: AppFactory, models_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.service.conftest import wait_until_settled

    async with serving(make_app(loader=PathLeakingLoader()), wait_ready=False) as client:
        cards = await wait_until_settled(client)
        ready = await client.get("/health/ready")
    error = cards["summarize-en"]["error"]
    assert cards["summarize-en"]["state"] == "failed"
    assert error == ("FileNotFoundError: [Errno 2] No such file or directory: "
                     "'summarize-en/encoder.onnx' (also tried .../encoder.onnx)")
    assert str(models_dir.parent) not in ready.text
    # the log keeps the full message for the operator
    assert any(str(models_dir / "summarize-en") in r.getMessage() for r in caplog.records)


async def test_the_page_has_security_headers_and_its_csp_runs_only_its_own_script(
    make_app: AppFactory,
) -> None:
    import base64
    import hashlib
    import re

    async with serving(make_app()) as client:
        page = await client.get("/")
    headers = page.headers
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    policy = dict(part.strip().split(" ", 1)
                  for part in headers["content-security-policy"].split(";"))
    (script,) = re.findall(r"<script>(.*?)</script>", page.text, flags=re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert policy["script-src"] == f"'sha256-{digest}'"  # no 'unsafe-inline' for scripts
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"
    # The page takes a token and sends it; it keeps it in sessionStorage, never localStorage.
    assert 'id="api-token"' in page.text and 'type="password"' in page.text
    assert "Authorization: `Bearer ${token}`" in script
    assert "sessionStorage" in script and "localStorage" not in script
