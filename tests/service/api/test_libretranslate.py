"""LibreTranslate's API (`POST /translate`, `GET /languages`): the stock `libretranslatepy` client
and JSON bodies against a real server (the tiny model on onnxruntime) giving `/v1/translate`'s
outputs, and every refusal a 4xx with the error body (fake models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.observability import metrics
from tests.service.conftest import AppFactory, serving
from tests.service.fakes import write_models
from tests.service.live_server import serve, wait_until_ready

MODEL = "tiny-reverse"  # translates "en" into "en": it reverses its input's pieces
TEXTS = ["abc de", "kol", "a b c"]


def post(url: str, path: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        return client.post(path, **kwargs)


def v1(url: str, **options: Any) -> list[dict[str, Any]]:
    response = post(url, "/v1/translate", json={"texts": TEXTS, "model": MODEL, **options})
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def test_the_stock_client_translates_and_lists_the_languages(tiny_url: str) -> None:
    libretranslatepy = pytest.importorskip("libretranslatepy")
    client = libretranslatepy.LibreTranslateAPI(tiny_url + "/")
    assert client.languages() == [{"code": "en", "name": "English", "targets": ["en"]}]
    translated = client.translate(TEXTS[0], source="en", target="en")  # a URL-encoded form
    assert translated == v1(tiny_url)[0]["text"] and translated.strip() == "ed cba"


def test_json_texts_and_alternatives_are_v1s(tiny_url: str) -> None:
    one = post(tiny_url, "/translate", json={"q": TEXTS[1], "source": "en", "target": "en"})
    many = post(tiny_url, "/translate", json={"q": TEXTS, "source": "en", "target": "en",
                                              "format": "text", "unknown": 1})
    alternatives = post(tiny_url, "/translate", json={"q": TEXTS, "source": "en", "target": "en",
                                                      "alternatives": 2})
    single = post(tiny_url, "/translate", data={"q": TEXTS[2], "source": "en", "target": "en",
                                                "alternatives": "1"})
    assert one.status_code == many.status_code == alternatives.status_code == single.status_code == 200
    greedy = [o["text"] for o in v1(tiny_url)]
    assert one.json() == {"translatedText": greedy[1]}
    assert many.json() == {"translatedText": greedy}
    assert "server-timing" in many.headers
    beams = v1(tiny_url, beam_size=3, num_hypotheses=3)
    assert alternatives.json() == {"translatedText": [o["text"] for o in beams],
                                   "alternatives": [[h["text"] for h in o["hypotheses"][1:]] for o in beams]}
    assert all(len(texts) == 2 for texts in alternatives.json()["alternatives"])
    two = v1(tiny_url, beam_size=2, num_hypotheses=2)[2]
    assert single.json() == {"translatedText": two["text"], "alternatives": [two["hypotheses"][1]["text"]]}


@pytest.fixture
def languages_app(tmp_path: Path, make_app: AppFactory) -> Any:
    """Fake models: en -> it twice (by name, `a-en-it` answers), it -> en, and a summarizer."""
    root = write_models(tmp_path / "lt-models", {"b-en-it": "translate", "a-en-it": "translate",
                                                  "it-en": "translate", "summarize-en": "summarize"})
    for name, (source, target) in {"b-en-it": ("en", "it"), "a-en-it": ("en", "it"),
                                   "it-en": ("it", "en"), "summarize-en": ("en", "en")}.items():
        manifest = root / name / "manifest.json"
        fields = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**fields, "source_language": source, "target_language": target}))
    return lambda **settings: make_app(models_dir=root, **settings)


@pytest.mark.anyio
async def test_the_pair_chooses_the_model_and_languages_come_from_the_manifests(languages_app: Any) -> None:
    def answered(model: str) -> float:
        return metrics.REQUESTS_TOTAL.labels("/translate", model, "2xx")._value.get()

    before = {model: answered(model) for model in ("a-en-it", "b-en-it", "it-en")}
    async with serving(languages_app()) as client:
        listed = await client.get("/languages")
        english = await client.post("/translate", json={"q": "abc", "source": "en", "target": "it"})
        italian = await client.post("/translate", json={"q": "abc", "source": "it", "target": "en"})
    assert listed.json() == [{"code": "en", "name": "English", "targets": ["it"]},
                             {"code": "it", "name": "Italian", "targets": ["en"]}]
    assert english.json() == italian.json() == {"translatedText": "cba"}  # the fake model reverses
    # the first model of the pair by name answered, under the route's own label
    assert {model: answered(model) - before[model] for model in before} == \
        {"a-en-it": 1, "b-en-it": 0, "it-en": 1}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"source": "en", "target": "it"}, 400, "q: Field required"),
        ({"q": [], "source": "en", "target": "it"}, 400, "q"),
        ({"q": "abc", "target": "it"}, 400, "source: Field required"),
        ({"q": "abc", "source": "auto", "target": "it"}, 400, "detects no language"),
        ({"q": "abc", "source": "en", "target": "zz"}, 400, "no model translates 'en' into 'zz'"),
        ({"q": "abc", "source": "en", "target": "en"}, 400, "no model translates"),  # a summarizer's pair
        ({"q": "<p>abc</p>", "source": "en", "target": "it", "format": "html"}, 400, "html"),
        ({"q": "abc", "source": "en", "target": "it", "format": "xml"}, 400, "format"),
        ({"q": "abc", "source": "en", "target": "it", "alternatives": "abc"}, 400, "alternatives"),
        ({"q": "abc", "source": "en", "target": "it", "alternatives": 99}, 400, "alternatives"),
        ({"q": "a\u0000b", "source": "en", "target": "it"}, 400, "U+0000"),
        (["abc"], 400, "a JSON object"),
    ],
)
async def test_bad_requests_get_a_400_with_the_error_body(languages_app: Any, body: Any, status: int,
                                                          message: str) -> None:
    async with serving(languages_app()) as client:
        response = await client.post("/translate", json=body)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error", "error_type"} and message in response.json()["error"]


@pytest.mark.anyio
async def test_bodies_that_are_neither_json_nor_a_form(languages_app: Any) -> None:
    async with serving(languages_app()) as client:
        plain = await client.post("/translate", content=b"q=abc", headers={"content-type": "text/plain"})
        broken = await client.post("/translate", content=b'{"q": ', headers={"content-type": "application/json"})
        not_utf8 = await client.post("/translate", content=b"q=%FF%FE&source=en&target=it",
                                     headers={"content-type": "application/x-www-form-urlencoded"})
    assert plain.status_code == 415 and "form" in plain.json()["error"]
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
    assert not_utf8.status_code == 400 and set(not_utf8.json()) == {"error", "error_type"}


@pytest.mark.anyio
async def test_the_api_key_in_the_body_or_the_header(languages_app: Any) -> None:
    body = {"q": "abc", "source": "en", "target": "it"}
    async with serving(languages_app(api_key="s3cret")) as client:
        missing = await client.post("/translate", json=body)
        wrong = await client.post("/translate", json={**body, "api_key": "nope"})
        in_body = await client.post("/translate", json={**body, "api_key": "s3cret"})
        in_form = await client.post("/translate", data={**body, "api_key": "s3cret"})
        in_header = await client.post("/translate", json=body, headers={"Authorization": "Bearer s3cret"})
        listed = await client.get("/languages")
    assert missing.status_code == wrong.status_code == listed.status_code == 401
    assert in_body.status_code == in_form.status_code == in_header.status_code == 200
    assert in_body.json() == {"translatedText": "cba"}


def test_the_stock_client_sends_its_key_for_the_languages_too(languages_app: Any) -> None:
    """libretranslatepy sends `api_key` as a form body, also on `GET /languages`."""
    libretranslatepy = pytest.importorskip("libretranslatepy")
    import urllib.error

    with serve(languages_app(api_key="s3cret")) as url:
        wait_until_ready(url)
        keyed = libretranslatepy.LibreTranslateAPI(url + "/", api_key="s3cret")
        assert [language["code"] for language in keyed.languages()] == ["en", "it"]
        assert keyed.translate("abc", source="en", target="it") == "cba"
        with pytest.raises(urllib.error.HTTPError) as caught:
            libretranslatepy.LibreTranslateAPI(url + "/", api_key="nope").languages()
        assert caught.value.code == 401
        queried = httpx.get(f"{url}/languages", params={"api_key": "s3cret"}, timeout=10, trust_env=False)
        assert queried.status_code == 200
