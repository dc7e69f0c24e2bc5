"""The web page `GET /` in headless Chromium, against the real app: type, translate, read the
attention heatmap, the model view (every layer × head), the word alignment and the confidence
shading; the API token dialog; the fallback when the maps exceed the server's cell limit.

The app serves the tiny reversal model (onnxruntime, CPU) twice: as a translation model and,
with its manifest's task changed, as a summarization model, so that both buttons of the page
work. Its vocabulary is the letters a-o, and it reverses the pieces of its input ("abc de" ->
"ed cba"). Skips cleanly without Chromium (`.ci/run` installs it) or without `websockets`.
"""

from __future__ import annotations

import json
import math
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
from service.core.settings import Settings
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


def tiles(browser: Browser) -> list[tuple[int, str]]:
    """The model view's thumbnails, as (layer, head) in page order."""
    return [(int(layer), head) for layer, head in browser.evaluate(
        "[...document.querySelectorAll('#model-grid .mv-tile')].map(t => [t.dataset.layer, t.dataset.head])")]


def translate(browser: Browser, text: str) -> None:
    """Type `text` in the input (replacing what was there) and click Translate; wait until done."""
    browser.evaluate("document.getElementById('source').value = ''")
    browser.type_text("#source", text)
    browser.click("#translate")
    browser.wait_for("document.body.dataset.phase === 'done'")


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
    # The page asks for token scores: each generated token is shaded, with the legend shown.
    scores = post(base_url, "/v1/translate", {"text": SOURCE, "return_scores": True})["outputs"][0]["token_scores"]
    assert browser.evaluate("[document.querySelectorAll('#output .tok').length,"
                            " !!document.getElementById('confidence-legend')]") == [len(scores), True]

    # The page streamed it: one token event at a time (Server-Sent Events), then the output.
    generated = [r for r in browser.requests() if r["url"].endswith("/v1/translate")]
    assert generated and json.loads(generated[-1]["postData"])["stream"] is True
    assert browser.evaluate("+document.body.dataset.tokens") == plain["output_tokens"]
    # The time shown says where it went on the server (the final event's stages).
    stages = browser.evaluate("document.getElementById('elapsed').title")
    assert stages.startswith("On the server: prepare ") and " inference " in stages and " total " in stages

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


def test_the_model_view_shows_every_layer_and_head(browser: Browser, base_url: str) -> None:
    """One thumbnail per layer × head of the kind shown; a click, or the keys, open one above."""
    browser.set_color_scheme("light")
    browser.goto(base_url + "/")
    browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
    translate(browser, SOURCE)
    body = json.loads([r for r in browser.requests() if r["url"].endswith("/v1/attention")][-1]["postData"])
    expected = post(base_url, "/v1/attention", {**body, "kinds": ["cross", "encoder"]})["attention"]
    for kind in ("cross", "encoder"):
        if kind != "cross":
            show_kind(browser, kind)
        layers, heads = len(expected[kind]), len(expected[kind][0])
        assert (layers, heads) == (2, 4)  # the tiny model's
        assert tiles(browser) == [(layer, str(head)) for layer in range(layers) for head in range(heads)]
        assert browser.evaluate("document.getElementById('model-grid').dataset.kind") == kind
        labels = browser.evaluate("[...document.querySelectorAll('#model-grid .mv-tile')]"
                                  ".map(t => t.getAttribute('aria-label'))")
        assert labels[heads + 1].endswith("layer 1, head 1")
        # A click opens the map in the heatmap, its selects, and marks its tile.
        browser.click('#model-grid .mv-tile[data-layer="0"][data-head="1"]')
        assert browser.evaluate("[heatmap.dataset.kind, heatmap.dataset.layer, heatmap.dataset.head,"
                                " document.getElementById('layer').value,"
                                " document.getElementById('head').value]") == [kind, "0", "1", "0", "1"]
        shown = [c["w"] for c in cells(browser)]
        assert shown == pytest.approx([w for row in expected[kind][0][1] for w in row], abs=1e-6)
        selected = browser.evaluate("[...document.querySelectorAll('#model-grid .mv-tile"
                                    "[aria-selected=\"true\"]')].map(t => t.dataset.layer + '/' + t.dataset.head)")
        assert selected == ["0/1"]

    # Keyboard: the grid is one tab stop; arrows move between thumbnails, Enter opens one.
    assert browser.evaluate("document.querySelectorAll('#model-grid .mv-tile[tabindex=\"0\"]').length") == 1
    browser.evaluate("document.querySelector('#model-grid .mv-tile[tabindex=\"0\"]').focus()")
    for key in ("ArrowDown", "ArrowRight", "ArrowRight", "Enter"):
        browser.press(key)
    assert browser.evaluate("[document.activeElement.dataset.layer, document.activeElement.dataset.head,"
                            " heatmap.dataset.layer, heatmap.dataset.head]") == ["1", "3", "1", "3"]
    shown = [c["w"] for c in cells(browser)]
    assert shown == pytest.approx([w for row in expected["encoder"][1][3] for w in row], abs=1e-6)
    assert browser.page_errors() == []


def test_the_word_alignment_is_drawn_as_links(browser: Browser, base_url: str) -> None:
    """The page asks for the alignment with the maps and draws one link per Pharaoh link;
    hovering a word highlights its links and the words at their other ends."""
    browser.goto(base_url + "/")
    browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
    translate(browser, SOURCE)
    sent = [json.loads(r["postData"]) for r in browser.requests() if r["url"].endswith("/v1/attention")]
    assert sent[-1]["alignment"] is True
    alignment = post(base_url, "/v1/attention", sent[-1])["alignment"]
    assert alignment["links"]
    assert not browser.evaluate("document.getElementById('alignment-card').hidden")
    drawn = browser.evaluate("[...document.querySelectorAll('#alignment .link')]"
                             ".map(p => [+p.dataset.source, +p.dataset.target, p.getAttribute('d')])")
    assert len(drawn) == len(alignment["links"])
    assert sorted([i, j] for i, j, _ in drawn) == sorted(alignment["links"])
    assert all(re.fullmatch(r"M[\d.]+ 0 C[\d. ]+", d) for _, _, d in drawn)
    words = browser.evaluate("['source', 'target'].map(side => [...document.querySelectorAll("
                             "`#alignment .word[data-side=\"${side}\"]`)].map(w => w.textContent))")
    assert words == [[w["word"] for w in alignment["source_words"]],
                     [w["word"] for w in alignment["target_words"]]]
    assert browser.evaluate("document.getElementById('alignment-pharaoh').textContent") == alignment["pharaoh"]

    source_word, target_word = alignment["links"][0]
    browser.hover(f'#alignment .word[data-side="source"][data-index="{source_word}"]')
    lit = browser.evaluate("[...document.querySelectorAll('#alignment .link.on')]"
                           ".map(p => [+p.dataset.source, +p.dataset.target])")
    assert sorted(lit) == sorted(link for link in alignment["links"] if link[0] == source_word)
    assert browser.evaluate(f"document.querySelector('#alignment .word[data-side=\"target\"]"
                            f"[data-index=\"{target_word}\"]').classList.contains('on')")
    # Keyboard: one tab stop; the arrows move along a row, and down to an aligned word.
    browser.evaluate("document.querySelector('#alignment .word[tabindex=\"0\"]').focus()")
    browser.press("ArrowDown")
    focused = browser.evaluate("[document.activeElement.dataset.side, +document.activeElement.dataset.index]")
    first_link = next(link for link in alignment["links"] if link[0] == 0)
    assert focused == ["target", first_link[1]]
    assert browser.page_errors() == []


def test_example_chips_fill_the_input(browser: Browser, base_url: str) -> None:
    """The chips are in-domain examples (Debian package descriptions): a click fills the input
    and runs its task; the page says which domain the default models know."""
    browser.goto(base_url + "/")
    browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
    chips = browser.evaluate("[...document.querySelectorAll('#examples .chip')]"
                             ".map(c => [c.dataset.task, c.title])")
    assert {task for task, _ in chips} == {"translate", "summarize"} and len(chips) >= 3
    assert "Debian package descriptions" in browser.evaluate("document.getElementById('domain-note').textContent")
    for index, (task, title) in enumerate(chips):
        browser.click(f"#examples .chip:nth-of-type({index + 1})")
        browser.wait_for("['done', 'error'].includes(document.body.dataset.phase)")
        text = browser.evaluate("document.getElementById('source').value")
        assert title.endswith(text) and len(text) > 20
        sent = [json.loads(r["postData"]) for r in browser.requests() if r["url"].endswith(f"/v1/{task}")]
        assert sent[-1]["text"] == text  # the tiny model knows only the letters a-o: any outcome


def test_token_scores_shade_the_output(browser: Browser, base_url: str, tokenizer: Tokenizer) -> None:
    """With `token_scores` in the output (here a stream given by a stand-in for `fetch`), each
    generated token is shaded by 1 - exp(its log-probability), with a legend."""
    ids = tokenizer.encode("ed cba")
    deltas = [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    text = "".join(deltas)
    scores = [-0.01, -2.3, -0.5, -0.05, -1.2, -0.0, -0.7][: len(ids)]
    events = [{"index": i, "token": {"id": t, "piece": p}, "delta": d, "text": "".join(deltas[: i + 1])}
              for i, (t, p, d) in enumerate(zip(ids, tokenizer.pieces(ids), deltas, strict=True))]
    events.append({"done": True, "model": TRANSLATE_MODEL, "usage": {"input_tokens": 7, "output_tokens": len(ids)},
                   "output": {"text": text, "finish_reason": "eos", "input_tokens": 7,
                              "output_tokens": len(ids), "score": sum(scores), "token_scores": scores}})
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    browser.goto(base_url + "/")
    browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
    browser.evaluate(
        "(() => { const real = window.fetch; window.sentToTranslate = [];"
        " window.fetch = (url, init) => { if (String(url).endsWith('/v1/translate')) {"
        " window.sentToTranslate.push(JSON.parse(init.body));"
        f" return Promise.resolve(new Response({json.dumps(stream)}, {{status: 200,"
        " headers: {'Content-Type': 'text/event-stream'}})); } return real(url, init); }; })()")
    translate(browser, SOURCE)
    assert browser.evaluate("window.sentToTranslate[0].return_scores") is True
    assert browser.evaluate("document.getElementById('output').textContent") == text
    shaded = browser.evaluate("[...document.querySelectorAll('#output .tok')].map(t => [t.textContent,"
                              " t.classList.contains('scored') ? +t.dataset.p : null,"
                              " +getComputedStyle(t).getPropertyValue('--u')])")
    assert [t for t, _, _ in shaded] == [d.lstrip() for d in deltas]  # spaces stay unshaded
    for (_, p, u), score in zip(shaded, scores, strict=True):
        assert p == pytest.approx(math.exp(score), abs=1e-4)
        assert u == pytest.approx((1 - math.exp(score)) * 0.8, abs=1e-3)
    assert browser.evaluate("!!document.getElementById('confidence-legend')")
    # The unsure tokens get a visibly stronger background than the sure ones.
    alphas = browser.evaluate("[...document.querySelectorAll('#output .tok')].map(t =>"
                              " getComputedStyle(t).backgroundColor)")
    assert alphas[1] != alphas[0]
    # The explorer reads the shown output as usual (the real server, teacher-forced).
    sent = [json.loads(r["postData"]) for r in browser.requests() if r["url"].endswith("/v1/attention")]
    assert sent[-1]["target"] == text
    assert browser.page_errors() == []


def test_sampled_decoding_sends_a_temperature_and_explores_the_draw(browser: Browser, base_url: str) -> None:
    browser.goto(base_url + "/")
    browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
    browser.evaluate("document.getElementById('beam').value = 'sample'")
    translate(browser, SOURCE)
    sent = [json.loads(r["postData"]) for r in browser.requests() if r["url"].endswith("/v1/translate")]
    assert sent[-1]["temperature"] == 0.8 and sent[-1]["top_p"] == 0.95 and "beam_size" not in sent[-1]
    shown = browser.evaluate("document.getElementById('output').textContent")
    assert shown  # a draw, whatever it is; the explorer reads that draw
    explored = [json.loads(r["postData"]) for r in browser.requests() if r["url"].endswith("/v1/attention")]
    assert explored[-1]["target"] == shown
    assert browser.page_errors() == []


def test_a_server_with_an_api_key_asks_for_the_token_once(
    browser: Browser, tiny_model_repository: Path, tmp_path: Path
) -> None:
    """On a 401 the page asks for the token (one dialog), keeps it in the tab's sessionStorage
    only, retries, and sends it as a bearer token on every later call; a reload reuses it; a
    refused token is asked for again; the page's CSP lets its script run."""
    token = "page-test-token"
    settings = Settings(models_dir=real_models(tiny_model_repository, tmp_path / "models"),
                        providers=("CPUExecutionProvider",), threads=1, variant="fp32",
                        api_key=token)
    asked = "+(document.getElementById('token-dialog').dataset.asked || 0)"
    with serve(create_app(settings)) as url:
        wait_until_ready(url)
        seen = len(browser.requests())
        browser.goto(url + "/")
        browser.wait_for("document.getElementById('token-dialog').open")
        assert browser.evaluate("document.getElementById('server-state-text').textContent") == "API token needed"
        browser.type_text("#token-dialog-input", token)
        browser.click("#token-dialog-ok")
        browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
        translate(browser, SOURCE)
        translation = browser.evaluate("document.getElementById('output').textContent")
        browser.click("#summarize")
        browser.wait_for("document.body.dataset.phase === 'done'"
                         " && document.getElementById('output-task').textContent.includes('summary')")
        first = [browser.evaluate(asked), browser.evaluate("document.getElementById('token-dialog').open"),
                 browser.evaluate("[sessionStorage.getItem('attnserve-api-token'), localStorage.length]")]
        calls = [r for r in browser.requests()[seen:] if "/v1/" in r["url"]]

        # A reload finds the token in the tab's session: no dialog.
        seen = len(browser.requests())
        browser.goto(url + "/")
        browser.wait_for("document.querySelectorAll('#model optgroup option').length >= 1")
        reloaded = [browser.evaluate(asked),
                    [r["headers"].get("Authorization") for r in browser.requests()[seen:] if "/v1/" in r["url"]]]

        # A refused token is asked for again; cancelled, the next action asks once more.
        browser.evaluate("sessionStorage.setItem('attnserve-api-token', 'wrong')")
        browser.goto(url + "/")
        browser.wait_for("document.getElementById('token-dialog').open")
        refused = browser.evaluate("document.getElementById('token-dialog-text').textContent")
        browser.click("#token-dialog-cancel")
        browser.wait_for("!document.getElementById('token-dialog').open")
        browser.evaluate("document.getElementById('source').value = ''")
        browser.type_text("#source", SOURCE)
        browser.click("#translate")
        browser.wait_for("document.getElementById('token-dialog').open")
        browser.type_text("#token-dialog-input", token)
        browser.press("Enter")
        browser.wait_for("document.body.dataset.phase === 'done'")
        again = [browser.evaluate(asked), browser.evaluate("document.getElementById('output').textContent"),
                 browser.evaluate("sessionStorage.getItem('attnserve-api-token')")]
        errors = browser.page_errors()
        browser.evaluate("sessionStorage.clear()")  # the module's other tests run without a key
    assert first == [1, False, [token, 0]]
    assert translation.strip() == "ed cba"
    # Every call after the first 401 carried the token: models, translate, attention, summarize.
    assert calls[0]["url"].endswith("/v1/models") and "Authorization" not in calls[0]["headers"]
    assert {r["url"].rsplit("/", 1)[1] for r in calls[1:]} >= {"models", "translate", "attention", "summarize"}
    assert all(r["headers"].get("Authorization") == f"Bearer {token}" for r in calls[1:])
    assert reloaded[0] == 0 and reloaded[1] and all(h == f"Bearer {token}" for h in reloaded[1])
    assert "refused" in refused
    assert again == [2, translation, token]
    assert not [e for e in errors if "Content Security Policy" in e], errors


def test_maps_over_the_cell_limit_fall_back_to_head_averages(
    browser: Browser, tiny_model_repository: Path, tmp_path: Path
) -> None:
    """A 422 for too many weights (ATTNSERVE_ATTENTION_MAX_CELLS) brings each layer's average of
    heads, said on the page; when even that is too many, the page says so."""
    # "abc de" -> "ed cba": cross maps of 8 × 8; 2 decoder layers × 4 heads = 512 weights,
    # their averages 128; the encoder maps of "abcdefg" (9 × 9), averaged: 162.
    settings = Settings(models_dir=real_models(tiny_model_repository, tmp_path / "models"),
                        providers=("CPUExecutionProvider",), threads=1, variant="fp32",
                        attention_max_cells=128)
    with serve(create_app(settings)) as url:
        wait_until_ready(url)
        browser.goto(f"{url}/?task=translate&autorun=1&text={urllib.parse.quote(SOURCE)}")
        browser.wait_for("document.body.dataset.phase === 'done'")
        sent = [json.loads(r["postData"]) for r in browser.requests() if r["url"].startswith(url)
                and r["url"].endswith("/v1/attention")]
        assert [body.get("average_heads", False) for body in sent] == [False, True]
        averaged = post(url, "/v1/attention", sent[-1])["attention"]["cross"]
        assert tiles(browser) == [(0, "avg"), (1, "avg")]
        notice = browser.evaluate("document.getElementById('model-view-notice').textContent")
        assert "ATTNSERVE_ATTENTION_MAX_CELLS" in notice
        assert browser.evaluate("[...document.querySelectorAll('#head option')].map(o => o.value)") == ["avg"]
        assert_grid(browser, 8, 8)
        shown = [c["w"] for c in cells(browser)]
        assert shown == pytest.approx([w for row in averaged[1][0] for w in row], abs=1e-6)
        browser.click('#model-grid .mv-tile[data-layer="0"]')
        assert [c["w"] for c in cells(browser)] == pytest.approx(
            [w for row in averaged[0][0] for w in row], abs=1e-6)

        browser.goto(f"{url}/?task=translate&autorun=1&kind=encoder&text=abcdefg")
        browser.wait_for("document.body.dataset.phase === 'error'")
        alert = browser.evaluate("document.getElementById('attn-error').innerText")
        errors = browser.page_errors()
    assert "422" in alert and "ATTNSERVE_ATTENTION_MAX_CELLS" in alert and "shorter text" in alert
    assert not errors, errors
