"""Word alignments over the API (`return_alignment`, `alignment` of `/v1/attention`) with the
real tiny model, which reverses the pieces of its input ("abc de" -> "ed cba"): its source's
first word is the output's last, reversed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.api.app import create_app
from service.core.settings import Settings
from service.generation import alignment
from tests.service.conftest import serving, tiny_settings
from tests.service.fakes import FakeLoader, FakeModel, write_models

pytestmark = pytest.mark.anyio

TEXTS = ["abc de", "fgh", "ij klm"]


async def post_all(models: Path, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """POST each (path, body) to one app over the tiny model; the responses, in order."""
    async with serving(create_app(tiny_settings(models))) as client:
        return [await client.post(path, json=body) for path, body in requests]


def check_words(text: str, spans: list[dict[str, Any]]) -> None:
    """The spans are the text's whitespace-separated words, in order, each where it stands."""
    assert [s["word"] for s in spans] == text.split()
    assert all(text[s["start"]:s["end"]] == s["word"] for s in spans)


def reversed_links(source: str, target: str) -> str:
    """Pharaoh links of a text and its piece-reversal: word i to word n - 1 - i."""
    n = len(source.split())
    assert len(target.split()) == n
    return alignment.pharaoh([(i, n - 1 - i) for i in range(n)])


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_return_alignment_links_the_reversed_words(served_tiny_models: Path,
                                                         beam_size: int) -> None:
    aligned, plain, both = await post_all(served_tiny_models, [
        ("/v1/translate", {"texts": TEXTS, "beam_size": beam_size, "return_alignment": True}),
        ("/v1/translate", {"texts": TEXTS, "beam_size": beam_size}),
        ("/v1/translate", {"texts": TEXTS, "beam_size": beam_size, "return_alignment": True,
                           "return_attention": True}),
    ])
    assert aligned.status_code == 200, aligned.text
    outputs = aligned.json()["outputs"]
    assert [o["text"] for o in outputs] == [o["text"] for o in plain.json()["outputs"]]
    assert all("alignment" not in o for o in plain.json()["outputs"])
    for text, output in zip(TEXTS, outputs, strict=True):
        assert set(output) == {"text", "finish_reason", "input_tokens", "output_tokens", "alignment"}
        found = output["alignment"]
        check_words(text, found["source_words"])
        check_words(output["text"], found["target_words"])
        assert found["pharaoh"] == reversed_links(text, output["text"])
        assert found["links"] == [[int(x) for x in link.split("-")]
                                  for link in found["pharaoh"].split()]
    both_outputs = both.json()["outputs"]
    assert [o["alignment"] for o in both_outputs] == [o["alignment"] for o in outputs]
    assert all("attention" in o and "target_tokens" in o for o in both_outputs)


async def test_an_output_cut_by_the_token_limit_is_aligned_too(served_tiny_models: Path) -> None:
    [response] = await post_all(served_tiny_models, [
        ("/v1/translate", {"text": "abc de", "max_new_tokens": 3, "return_alignment": True}),
    ])
    [output] = response.json()["outputs"]
    assert output["finish_reason"] == "length"
    found = output["alignment"]
    check_words(output["text"], found["target_words"])
    assert all(0 <= i < 2 and 0 <= j < len(found["target_words"]) for i, j in found["links"])


async def test_the_attention_route_aligns_given_and_generated_targets(
    served_tiny_models: Path,
) -> None:
    generated, given, plain, translated = await post_all(served_tiny_models, [
        ("/v1/attention", {"source": "abc de", "alignment": True}),
        ("/v1/attention", {"source": "abc de", "target": "ed cba", "alignment": True,
                           "kinds": ["encoder"], "layers": [0]}),
        ("/v1/attention", {"source": "abc de"}),
        ("/v1/translate", {"text": "abc de", "return_alignment": True}),
    ])
    for response in (generated, given, plain):
        assert response.status_code == 200, response.text
    assert "alignment" not in plain.json()
    data = generated.json()
    check_words("abc de", data["alignment"]["source_words"])
    check_words(data["target_text"], data["alignment"]["target_words"])
    # The same pass as `return_alignment` for the same (greedy) output.
    assert data["alignment"] == translated.json()["outputs"][0]["alignment"]
    # Alignment uses every layer's cross-attention, whatever kinds and layers were asked.
    assert list(given.json()["attention"]) == ["encoder"]
    assert given.json()["alignment"]["pharaoh"] == "0-1 1-0"


async def test_streaming_sends_the_alignment_in_its_final_event(served_tiny_models: Path) -> None:
    streamed, plain = await post_all(served_tiny_models, [
        ("/v1/translate", {"text": "abc de", "stream": True, "return_alignment": True}),
        ("/v1/translate", {"text": "abc de", "return_alignment": True}),
    ])
    assert streamed.status_code == 200, streamed.text
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    final = events[-1]
    assert final["done"] is True
    assert final["output"]["alignment"] == plain.json()["outputs"][0]["alignment"]
    assert all("alignment" not in e for e in events[:-1])


async def test_bad_alignment_requests(served_tiny_models: Path, tmp_path: Path) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/translate", {"text": "abc", "return_alignment": "yes"}, "return_alignment"),
        ("/v1/translate", {"text": "abc", "return_alignment": 1}, "return_alignment"),
        ("/v1/attention", {"source": "abc", "alignment": "true"}, "alignment"),
    ]
    responses = await post_all(served_tiny_models, [(path, body) for path, body, _ in cases])
    for (_, body, message), response in zip(cases, responses, strict=True):
        assert response.status_code == 422, (body, response.text)
        assert message in response.json()["error"]
        assert response.json()["error_type"] == "invalid_input"

    models = write_models(tmp_path / "models", {"fake-translate": "translate"})
    app = create_app(Settings(models_dir=models), loader=FakeLoader(),
                     generator=lambda runtime: FakeModel().generate)
    async with serving(app) as client:
        plain = await client.post("/v1/translate", json={"text": "abc", "return_alignment": True})
        streamed = await client.post("/v1/translate", json={"text": "abc", "stream": True,
                                                            "return_alignment": True})
    for response in (plain, streamed):
        assert response.status_code == 422
        assert response.json() == {"error": "model 'fake-translate' does not give attention "
                                   "weights", "error_type": "invalid_input"}
