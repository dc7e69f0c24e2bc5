"""The web page `GET /` in headless Chromium, against the real app: type, translate, read the
attention heatmap.

The app serves the tiny reversal model (onnxruntime, CPU) twice: as a translation model and,
with its manifest's task changed, as a summarization model, so that both buttons of the page
work. Its vocabulary is the letters a-o, and it reverses the pieces of its input ("abc de" ->
"ed cba"). Skips cleanly without Chromium (`.ci/run` installs it) or without `websockets`.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("websockets.sync.client")

from model.tokenizer import Tokenizer
from service.api.app import create_app
from service.settings import Settings
from tests.service.browser import Browser, find_chromium
from tests.service.live_server import serve, wait_until_ready

SOURCE = "abc de"  # 7 pieces of the tiny vocabulary: "▁", "a", "b", "c", "▁", "d", "e"
TOO_LONG = "abcdefghijklmno abc"  # 20 pieces: over the tiny model's 15
LOOK_AT_ME = Path("/tmp/attnserve-page.png")  # a copy of the screenshot, for people
TRANSLATE_MODEL, SUMMARIZE_MODEL = "tiny-reverse", "tiny-summarize"

# ---------------------------------------------------------------- the real app


def real_models(tiny_model_repository: Path, root: Path) -> Path:
    """A models folder: the tiny repository as is, and a copy whose manifest says summarize."""
    shutil.copytree(tiny_model_repository, root / TRANSLATE_MODEL)
    shutil.copytree(tiny_model_repository, root / SUMMARIZE_MODEL)
    manifest_path = root / SUMMARIZE_MODEL / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest.update(task="summarize", name=SUMMARIZE_MODEL)  # the manifest is not hashed
    manifest_path.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def base_url(tiny_model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Where the real app serves the page and the API (CPU, one thread, fp32)."""
    models_dir = real_models(tiny_model_repository, tmp_path_factory.mktemp("page-models"))
    settings = Settings(models_dir=models_dir, providers=("CPUExecutionProvider",), threads=1,
                        variant="fp32")
    with serve(create_app(settings)) as url:
        wait_until_ready(url)
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_model_repository: Path) -> Tokenizer:
    return Tokenizer.from_file(tiny_model_repository / "tokenizer.model")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable = find_chromium()
    if executable is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run does)")
    with Browser(executable, tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b


# ---------------------------------------------------------------- helpers

def post(base_url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        return json.load(response)


def cells(browser: Browser) -> list[dict[str, Any]]:
    return browser.evaluate(
        "[...document.querySelectorAll('#heatmap .cell')].map(c => ({q: +c.dataset.query,"
        " k: +c.dataset.key, w: +c.dataset.weight}))")


def choose(browser: Browser, select: str, value: str) -> None:
    """Pick an option of a `<select>` the way the browser reports a user's choice."""
    browser.evaluate(f"(() => {{ const s = document.querySelector({json.dumps(select)});"
                     f" s.focus(); s.value = {json.dumps(value)};"
                     " s.dispatchEvent(new Event('change', {bubbles: true})); })()")


def show_kind(browser: Browser, kind: str) -> None:
    """Pick an attention kind and wait for its map (the page fetches a kind when first picked)."""
    choose(browser, "#kind", kind)
    browser.wait_for(f"heatmap.dataset.kind === {json.dumps(kind)}"
                     " && document.body.dataset.phase === 'done'")


def shape(browser: Browser) -> tuple[int, int]:
    rows, cols = browser.evaluate("[+heatmap.dataset.rows, +heatmap.dataset.cols]")
    return rows, cols


def assert_grid(browser: Browser, rows: int, cols: int) -> None:
    """The heatmap has rows × cols cells, one per (query, key), and labels on both axes."""
    found = cells(browser)
    assert len(found) == rows * cols
    assert {(c["q"], c["k"]) for c in found} == {(q, k) for q in range(rows) for k in range(cols)}
    assert shape(browser) == (rows, cols)
    labels = browser.evaluate("[document.querySelectorAll('#heatmap .lbl.row').length,"
                              " document.querySelectorAll('#heatmap .lbl.col').length]")
    assert labels == [rows, cols]
    for q in range(rows):  # every map shown is a softmax over keys (or the mean of some)
        assert sum(c["w"] for c in found if c["q"] == q) == pytest.approx(1.0, abs=2e-3)


# ---------------------------------------------------------------- tests

def test_translate_then_explore_the_heatmap(
    browser: Browser, base_url: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    browser.set_color_scheme("light")
    browser.goto(base_url + "/")
    browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")

    # A user types a sentence and clicks Translate.
    browser.type_text("#source", SOURCE)
    browser.click("#translate")
    browser.wait_for("document.body.dataset.phase === 'done'")
    plain = post(base_url, "/v1/translate", {"text": SOURCE})["outputs"][0]
    translation = plain["text"]
    assert browser.evaluate("document.getElementById('output').textContent") == translation

    # The page streamed it: one token event at a time (Server-Sent Events), then the output.
    generated = [r for r in browser.requests() if r["url"].endswith("/v1/translate")]
    assert generated and json.loads(generated[-1]["postData"])["stream"] is True
    assert browser.evaluate("+document.body.dataset.tokens") == plain["output_tokens"]

    # The page asked for the attention of exactly the output it shows (teacher forcing).
    sent = [r for r in browser.requests() if r["url"].endswith("/v1/attention")]
    assert sent and json.loads(sent[-1]["postData"])["target"] == translation
    assert json.loads(sent[-1]["postData"])["source"] == SOURCE
    expected = post(base_url, "/v1/attention", json.loads(sent[-1]["postData"]))
    n_source, n_target = len(expected["source_tokens"]), len(expected["target_tokens"])
    assert expected["model"] == TRANSLATE_MODEL
    assert [t["piece"] for t in expected["source_tokens"]] == [
        *tokenizer.pieces(tokenizer.encode(SOURCE)), "</s>"]
    assert [t["piece"] for t in expected["target_tokens"]] == [
        *tokenizer.pieces(tokenizer.encode(translation)), "</s>"]
    assert n_source == 8 and translation.strip() == "ed cba"  # the tiny model reverses

    # Cross attention (the default kind) first: target rows × source columns.
    assert browser.evaluate("heatmap.dataset.kind") == "cross"
    assert_grid(browser, n_target, n_source)
    first_column = browser.evaluate("document.querySelector('#heatmap .lbl.col').textContent")
    assert first_column == expected["source_tokens"][0]["piece"].lstrip("\u2581")

    # Hover shows the weight in a tooltip and in the readout.
    browser.hover('#heatmap .cell[data-query="1"][data-key="2"]')
    weight = browser.evaluate(
        "+document.querySelector('#heatmap .cell[data-query=\"1\"][data-key=\"2\"]').dataset.weight")
    assert browser.wait_for("document.getElementById('tooltip').classList.contains('shown')")
    tip = browser.evaluate("document.querySelector('#tooltip .tw').textContent")
    assert float(tip) == pytest.approx(weight, abs=1e-4)
    assert float(browser.evaluate("document.getElementById('readout-weight').textContent")) == \
        pytest.approx(weight, abs=1e-4)

    # Keyboard: the grid has one tab stop; arrow keys move the focused cell and its readout.
    browser.evaluate("document.querySelector('#heatmap .cell[tabindex=\"0\"]').focus()")
    for key in ("ArrowRight", "ArrowRight", "ArrowDown", "ArrowLeft"):
        browser.press(key)
    focused = browser.evaluate(
        "[+document.activeElement.dataset.query, +document.activeElement.dataset.key,"
        " +document.activeElement.dataset.weight, document.querySelectorAll("
        "'#heatmap .cell[tabindex=\"0\"]').length]")
    assert focused[:2] == [1, 1] and focused[3] == 1
    readout = browser.evaluate("document.getElementById('readout-weight').textContent")
    assert re.fullmatch(r"\d\.\d{4}", readout) and float(readout) == pytest.approx(focused[2], abs=1e-4)
    browser.press("]")  # next head, keeping the focused cell
    assert browser.evaluate("[document.getElementById('head').value, +document.activeElement"
                            ".dataset.query, +document.activeElement.dataset.key]") == ["0", 1, 1]
    browser.press("[")
    assert browser.evaluate("document.getElementById('head').value") == "avg"
    browser.screenshot(tmp_path / "page-light.png")
    shutil.copyfile(tmp_path / "page-light.png", LOOK_AT_ME)

    # Encoder self-attention: source × source; decoder: target × target, causal.
    show_kind(browser, "encoder")
    assert_grid(browser, n_source, n_source)
    show_kind(browser, "decoder")
    assert_grid(browser, n_target, n_target)
    assert all(c["w"] == 0 for c in cells(browser) if c["k"] > c["q"])

    # The head overview: one tile per head of the layer plus the average; a click selects one.
    show_kind(browser, "cross")
    kinds = [json.loads(r["postData"])["kinds"] for r in browser.requests()
             if r["url"].endswith("/v1/attention")]
    assert kinds == [["cross"], ["encoder"], ["decoder"]]  # one kind a call, each fetched once
    layers = len(expected["attention"]["cross"])
    heads = len(expected["attention"]["cross"][0])
    assert browser.evaluate("document.querySelectorAll('#layer option').length") == layers
    assert browser.evaluate("document.querySelectorAll('#head-grid .head-tile').length") == heads + 1
    browser.click('#head-grid .head-tile[data-head="2"]')
    assert browser.evaluate("[document.getElementById('head').value, heatmap.dataset.head]") == ["2", "2"]
    assert_grid(browser, n_target, n_source)
    last = layers - 1
    shown = [c["w"] for c in cells(browser)]  # row-major, as rendered
    assert shown == pytest.approx(
        [w for row in expected["attention"]["cross"][last][2] for w in row], abs=1e-6)

    # Dark mode renders too (and keeps the same grid); the page made no request elsewhere.
    browser.set_color_scheme("dark")
    browser.wait_for("getComputedStyle(document.body).backgroundColor !== 'rgb(244, 245, 248)'")
    browser.hover('#heatmap .cell[data-query="2"][data-key="1"]')
    browser.screenshot(tmp_path / "page-dark.png")
    shutil.copyfile(tmp_path / "page-dark.png", LOOK_AT_ME.with_name("attnserve-page-dark.png"))
    assert_grid(browser, n_target, n_source)
    assert all(r["url"].startswith((base_url, "data:")) for r in browser.requests())
    assert browser.page_errors() == []


def test_query_parameters_run_a_summary(browser: Browser, base_url: str) -> None:
    browser.set_color_scheme("light")
    text = "ab cd ef"
    browser.goto(f"{base_url}/?task=summarize&autorun=1&text={urllib.parse.quote(text)}")
    browser.wait_for("document.body.dataset.phase === 'done'")
    summary = post(base_url, "/v1/summarize", {"text": text})["outputs"][0]["text"]
    assert browser.evaluate("document.getElementById('output').textContent") == summary
    expected = post(base_url, "/v1/attention",
                    {"source": text, "target": summary, "task": "summarize", "kinds": ["cross"]})
    assert expected["model"] == SUMMARIZE_MODEL
    sent = [json.loads(r["postData"]) for r in browser.requests()
            if r["url"].endswith("/v1/attention")]
    assert sent[-1]["model"] == SUMMARIZE_MODEL
    assert_grid(browser, len(expected["target_tokens"]), len(expected["source_tokens"]))
    assert browser.page_errors() == []


def test_server_errors_are_shown(browser: Browser, base_url: str) -> None:
    """The `{"error", "error_type"}` body (here a 422: too many tokens) reaches the user."""
    browser.goto(f"{base_url}/?task=translate&autorun=1&text={urllib.parse.quote(TOO_LONG)}")
    browser.wait_for("document.body.dataset.phase === 'error'")
    alert = browser.evaluate("document.getElementById('error').innerText")
    assert "invalid_input" in alert and "422" in alert and "at most 15 allowed" in alert
    assert browser.evaluate("getComputedStyle(document.getElementById('error')).display") != "none"
    assert browser.evaluate("document.getElementById('heatmap').hidden")


def test_a_server_with_an_api_key_is_used_with_the_token_typed_in(
    browser: Browser, tiny_model_repository: Path, tmp_path: Path
) -> None:
    """With an API key the page says it needs the token; the token typed in is kept in the
    tab's sessionStorage only and sent as a bearer token; the page's CSP lets its script run."""
    token = "page-test-token"
    settings = Settings(models_dir=real_models(tiny_model_repository, tmp_path / "models"),
                        providers=("CPUExecutionProvider",), threads=1, variant="fp32",
                        api_key=token)
    with serve(create_app(settings)) as url:
        wait_until_ready(url)
        browser.goto(url + "/")
        browser.wait_for("document.getElementById('server-state-text').textContent"
                         " === 'API token needed'")
        browser.type_text("#api-token", token)
        browser.evaluate("document.getElementById('api-token')"
                         ".dispatchEvent(new Event('change', {bubbles: true}))")
        browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
        browser.type_text("#source", SOURCE)
        browser.click("#translate")
        browser.wait_for("document.body.dataset.phase === 'done'")
        stored = browser.evaluate("[sessionStorage.getItem('attnserve-api-token'),"
                                  " localStorage.length]")
        sent = [r for r in browser.requests() if r["url"].endswith("/v1/translate")]
        errors = browser.page_errors()
        browser.evaluate("sessionStorage.clear()")  # the module's other tests run without a key
    assert stored == [token, 0]
    assert sent and sent[-1]["headers"].get("Authorization") == f"Bearer {token}"
    assert browser.evaluate("document.getElementById('output').textContent").strip() == "ed cba"
    assert not [e for e in errors if "Content Security Policy" in e], errors
