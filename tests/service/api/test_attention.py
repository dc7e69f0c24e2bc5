"""`POST /v1/attention`, `return_attention` and `GET /` over the real tiny model (onnxruntime).

The tiny model reverses the pieces of its input ("abc de" -> "ed cba"); it has 2 encoder and 2
decoder layers of 4 heads. Teacher-forced maps must equal what the PyTorch model of the
repository's checkpoint (the trained weights rounded to bfloat16 at export, as the graphs hold
them) returns for the same ids, within 1e-4 per weight (fp32 onnxruntime, 8 decimals asked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from model.decoding import beam_search, pad_batch
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from service.api.app import create_app
from service.core.settings import Settings
from tests.service.conftest import serving, tiny_settings
from tests.service.fakes import FakeLoader, FakeModel, write_models

pytestmark = pytest.mark.anyio

SOURCE, TARGET = "abc de", "ed cba"
ALL_KINDS = ["encoder", "decoder", "cross"]
LAYERS, HEADS = 2, 4
TOLERANCE = 1e-4  # onnxruntime fp32 against PyTorch, per weight














async def post_all(served_tiny_models: Path, requests: list[tuple[str, dict[str, Any]]],
                   **settings: Any) -> list[Any]:
    """POST each (path, body) to one app over the tiny model; the responses, in order."""
    async with serving(create_app(tiny_settings(served_tiny_models, **settings))) as client:
        return [await client.post(path, json=body) for path, body in requests]


def pieces(tokens: list[dict[str, Any]]) -> list[str]:
    return [t["piece"] for t in tokens]


def spelled(text: str, tokens: list[dict[str, Any]]) -> str:
    """The text the tokens' spans cover, in order."""
    return "".join(text[t["start"]:t["end"]] for t in tokens)


def reference_tokens(model: Transformer, tiny_repository_tokenizer: Tokenizer, text: str, beam_size: int,
                     max_new_tokens: int = 16) -> tuple[list[int], str]:
    """The PyTorch model's output ids of `text` (greedy for beam 1) and its finish reason."""
    source = pad_batch([[*tiny_repository_tokenizer.encode(text), tiny_repository_tokenizer.eos_id]], tiny_repository_tokenizer.pad_id)
    [result] = beam_search(model, source, beam_size, max_new_tokens)
    return result.tokens, result.finish_reason


def torch_maps(model: Transformer, source_ids: list[int], decoder_ids: list[int]
               ) -> dict[str, list[np.ndarray]]:
    """The PyTorch model's attention of one teacher-forced pass: per kind, per layer (h, Q, K)."""
    with torch.no_grad():
        encoded = model.encode(torch.tensor([source_ids]))
        out = model.decode(torch.tensor([decoder_ids]), model.start_decoding(encoded))
    return {"encoder": [a[0].numpy() for a in encoded.attentions],
            "decoder": [a[0].numpy() for a in out.self_attentions],
            "cross": [a[0].numpy() for a in out.cross_attentions]}


async def test_maps_have_the_token_counts_rows_sum_to_one_and_decoder_is_causal(
    served_tiny_models: Path, tiny_repository_tokenizer: Tokenizer
) -> None:
    body = {"source": SOURCE, "target": TARGET, "kinds": ALL_KINDS, "decimals": 8}
    [response] = await post_all(served_tiny_models, [("/v1/attention", body)])
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == served_tiny_models.joinpath("tiny-reverse").name
    source, target = data["source_tokens"], data["target_tokens"]
    # Source: the source's pieces then </s>; target: the target's pieces then </s>.
    assert pieces(source) == [*tiny_repository_tokenizer.pieces(tiny_repository_tokenizer.encode(SOURCE)), "</s>"]
    assert pieces(target) == [*tiny_repository_tokenizer.pieces(tiny_repository_tokenizer.encode(TARGET)), "</s>"]
    assert spelled(SOURCE, source) == SOURCE and spelled(TARGET, target) == TARGET
    assert source[-1] == {"piece": "</s>", "start": len(SOURCE), "end": len(SOURCE)}
    assert (data["target_text"], data["generated"]) == (TARGET, False)
    assert data["layers"] == {kind: [0, 1] for kind in ALL_KINDS}
    assert data["heads"] == [0, 1, 2, 3] and data["average_heads"] is False
    assert set(data["attention"]) == set(ALL_KINDS)
    s, t = len(source), len(target)
    expected_shapes = {"encoder": (s, s), "decoder": (t, t), "cross": (t, s)}
    for kind, (rows, cols) in expected_shapes.items():
        maps = np.asarray(data["attention"][kind])
        assert maps.shape == (LAYERS, HEADS, rows, cols), kind
        np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=1e-5)
        assert (maps >= 0).all()
    decoder = np.asarray(data["attention"]["decoder"])
    assert (np.triu(decoder, k=1) == 0).all()  # causal: nothing above the diagonal
    assert (np.diagonal(decoder, axis1=-2, axis2=-1) > 0).all()


@pytest.mark.parametrize("given_target", [True, False], ids=["teacher-forced", "generated"])
async def test_maps_equal_pytorch(
    served_tiny_models: Path, tiny_repository_tokenizer: Tokenizer, tiny_repository_model: Transformer, given_target: bool
) -> None:
    body: dict[str, Any] = {"source": SOURCE, "kinds": ALL_KINDS, "decimals": 8}
    if given_target:
        body["target"] = TARGET
    [response] = await post_all(served_tiny_models, [("/v1/attention", body)])
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["generated"] is not given_target
    assert data["target_text"].strip() == TARGET  # the model reverses: generated or given
    if given_target:
        target_ids = tiny_repository_tokenizer.encode(TARGET)
    else:  # the greedy output, as generated (decoding and encoding again may differ)
        target_ids, _ = reference_tokens(tiny_repository_model, tiny_repository_tokenizer, SOURCE, 1)
        assert data["target_text"] == tiny_repository_tokenizer.decode(target_ids)
    assert pieces(data["target_tokens"]) == [*tiny_repository_tokenizer.pieces(target_ids), "</s>"]
    source_ids = [*tiny_repository_tokenizer.encode(SOURCE), tiny_repository_tokenizer.eos_id]
    decoder_ids = [tiny_repository_tokenizer.bos_id, *target_ids]
    expected = torch_maps(tiny_repository_model, source_ids, decoder_ids)
    for kind in ALL_KINDS:
        actual = np.asarray(data["attention"][kind])
        assert len(expected[kind]) == LAYERS
        for layer in range(LAYERS):
            for head in range(HEADS):
                np.testing.assert_allclose(actual[layer, head], expected[kind][layer][head],
                                           atol=TOLERANCE, err_msg=f"{kind} {layer} {head}")


async def test_filters_return_exactly_what_was_asked(served_tiny_models: Path) -> None:
    base = {"source": SOURCE, "target": TARGET, "decimals": 8}
    full, picked, averaged, one_kind, default, coarse = await post_all(served_tiny_models, [
        ("/v1/attention", {**base, "kinds": ALL_KINDS}),
        ("/v1/attention", {**base, "kinds": ["cross", "encoder"], "layers": [1], "heads": [2, 0]}),
        ("/v1/attention", {**base, "kinds": ["decoder"], "heads": [3, 1], "average_heads": True}),
        ("/v1/attention", {**base, "kinds": ["decoder"]}),
        ("/v1/attention", {"source": SOURCE, "target": TARGET}),
        ("/v1/attention", {**base, "decimals": 2}),
    ])
    for response in (full, picked, averaged, one_kind, default, coarse):
        assert response.status_code == 200, response.text
    everything = {k: np.asarray(v) for k, v in full.json()["attention"].items()}

    data = picked.json()
    assert set(data["attention"]) == {"cross", "encoder"}
    assert data["layers"] == {"cross": [1], "encoder": [1]} and data["heads"] == [2, 0]
    for kind in ("cross", "encoder"):
        maps = np.asarray(data["attention"][kind])
        assert maps.shape[:2] == (1, 2)
        np.testing.assert_array_equal(maps[0], everything[kind][1][[2, 0]])

    data = averaged.json()
    assert list(data["attention"]) == ["decoder"] and data["average_heads"] is True
    assert data["heads"] == [3, 1]
    maps = np.asarray(data["attention"]["decoder"])
    assert maps.shape[:2] == (LAYERS, 1)
    np.testing.assert_allclose(maps[:, 0], everything["decoder"][:, [3, 1]].mean(axis=1),
                               atol=1e-7)

    assert list(one_kind.json()["attention"]) == ["decoder"]
    assert list(default.json()["attention"]) == ["cross"]  # the default kind
    default_cross = np.asarray(default.json()["attention"]["cross"])
    np.testing.assert_allclose(default_cross, everything["cross"], atol=5e-5)  # 4 decimals
    assert all(round(w, 2) == w for w in np.asarray(coarse.json()["attention"]["cross"]).flat)


async def test_limits_and_bad_requests(served_tiny_models: Path) -> None:
    base = {"source": SOURCE, "target": TARGET}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"source": "abc de f", "target": TARGET}, 422, "source: 9 tokens; at most 7"),
        ({"source": SOURCE, "target": "ed cba gh"}, 422, "target: 10 tokens; at most 8"),
        ({**base, "kinds": ALL_KINDS}, 422, "hold 1536 weights; at most 600"),
        ({**base, "layers": [0, 2]}, 422, "layers: [2] out of range"),
        ({**base, "heads": [4]}, 422, "heads: [4] out of range"),
        ({**base, "heads": [1, 1]}, 422, "twice"),
        ({**base, "kinds": ["self"]}, 422, "kinds"),
        ({**base, "kinds": []}, 422, "kinds"),
        ({**base, "layers": [-1]}, 422, "layers"),
        ({**base, "decimals": 9}, 422, "decimals"),
        ({**base, "unknown": 1}, 422, "unknown"),
        ({"source": "", "target": TARGET}, 422, "source"),
        ({"source": "  ", "target": TARGET}, 422, "no tokens"),
        ({"target": TARGET}, 422, "source"),
        ({**base, "model": "nope"}, 404, "no model 'nope'"),
        ({**base, "task": "summarize"}, 404, "no summarize model"),
        ({**base, "model": "tiny-reverse", "task": "summarize"}, 404, "does not serve"),
    ]
    responses = await post_all(
        served_tiny_models, [("/v1/attention", body) for body, _, _ in cases],
        attention_max_source_tokens=7, attention_max_target_tokens=8, attention_max_cells=600,
    )
    for (body, status, message), response in zip(cases, responses, strict=True):
        assert response.status_code == status, (body, response.text)
        error = response.json()
        assert message in error["error"], (body, error)
        assert error["error_type"] == ("invalid_input" if status == 422 else "model_not_found")


async def test_cell_limit_counts_what_is_asked(served_tiny_models: Path) -> None:
    """8 source and 8 target tokens (with </s>): cross 2 x 4 x 8 x 8 = 512 weights."""
    base = {"source": SOURCE, "target": TARGET}
    fits, too_many, averaged = await post_all(served_tiny_models, [
        ("/v1/attention", {**base, "kinds": ["cross"]}),
        ("/v1/attention", {**base, "kinds": ["cross", "decoder"]}),
        ("/v1/attention", {**base, "kinds": ALL_KINDS, "average_heads": True}),
    ], attention_max_cells=512)
    assert fits.status_code == 200, fits.text
    assert too_many.status_code == 422 and "hold 1024 weights" in too_many.json()["error"]
    assert averaged.status_code == 200  # 3 kinds x 2 layers x 1 x 64 = 384


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_return_attention_of_translations(
    served_tiny_models: Path, tiny_repository_tokenizer: Tokenizer, tiny_repository_model: Transformer, beam_size: int
) -> None:
    """Cross-attention of the last layer, mean of the heads, replaying the output: as PyTorch's."""
    texts = [SOURCE, "fgh", "ij klm"]
    body = {"texts": texts, "beam_size": beam_size, "return_attention": True}
    with_maps, plain, cut = await post_all(served_tiny_models, [
        ("/v1/translate", body),
        ("/v1/translate", {"texts": texts, "beam_size": beam_size}),
        ("/v1/translate", {**body, "max_new_tokens": 2}),
    ])
    assert with_maps.status_code == 200, with_maps.text
    outputs = with_maps.json()["outputs"]
    assert [o["text"] for o in outputs] == [o["text"] for o in plain.json()["outputs"]]
    assert all(set(o) == {"text", "finish_reason", "input_tokens", "output_tokens"}
               for o in plain.json()["outputs"])
    for text, output in zip(texts, outputs, strict=True):
        assert output["finish_reason"] == "eos"
        source, target = output["source_tokens"], output["target_tokens"]
        assert pieces(source) == [*tiny_repository_tokenizer.pieces(tiny_repository_tokenizer.encode(text)), "</s>"]
        assert len(source) == output["input_tokens"]
        assert len(target) == output["output_tokens"] + 1 and target[-1]["piece"] == "</s>"
        assert spelled(output["text"], target) == output["text"]
        maps = np.asarray(output["attention"])
        assert maps.shape == (len(target), len(source))
        np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=len(source) * 5e-5)
        tokens, _ = reference_tokens(tiny_repository_model, tiny_repository_tokenizer, text, beam_size)
        assert pieces(target) == [*tiny_repository_tokenizer.pieces(tokens), "</s>"]
        source_ids = [*tiny_repository_tokenizer.encode(text), tiny_repository_tokenizer.eos_id]
        expected = torch_maps(tiny_repository_model, source_ids, [tiny_repository_tokenizer.bos_id, *tokens])
        np.testing.assert_allclose(maps, expected["cross"][-1].mean(axis=0),
                                   atol=TOLERANCE + 5e-5)  # 4 decimals

    # Stopped by the token limit: one row per generated token, no </s> row.
    assert cut.status_code == 200, cut.text
    for text, output in zip(texts, cut.json()["outputs"], strict=True):
        assert output["finish_reason"] == "length" and output["output_tokens"] == 2
        tokens, _ = reference_tokens(tiny_repository_model, tiny_repository_tokenizer, text, beam_size, max_new_tokens=2)
        assert pieces(output["target_tokens"]) == tiny_repository_tokenizer.pieces(tokens)
        assert np.asarray(output["attention"]).shape == (2, len(output["source_tokens"]))


async def test_the_page_is_served(served_tiny_models: Path) -> None:
    async with serving(create_app(tiny_settings(served_tiny_models))) as client:
        response = await client.get("/")
        schema = (await client.get("/openapi.json")).json()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["cache-control"] == "no-cache"
    page = Path(__file__).resolve().parents[3] / "service" / "api" / "static" / "index.html"
    assert response.text == page.read_text(encoding="utf-8")
    assert "/v1/attention" in schema["paths"] and "/" not in schema["paths"]


async def test_a_model_without_attention_outputs_gives_422(tmp_path: Path) -> None:
    models = write_models(tmp_path / "models", {"fake-translate": "translate"})
    app = create_app(Settings(models_dir=models), loader=FakeLoader(),
                     generator=lambda runtime: FakeModel().generate)
    async with serving(app) as client:
        maps = await client.post("/v1/attention", json={"source": "abc"})
        aligned = await client.post("/v1/translate", json={"text": "abc", "return_attention": True})
        plain = await client.post("/v1/translate", json={"text": "abc"})
    for response in (maps, aligned):
        assert response.status_code == 422
        assert response.json() == {"error": "model 'fake-translate' does not give attention "
                                   "weights", "error_type": "invalid_input"}
    assert plain.status_code == 200 and "attention" not in plain.json()["outputs"][0]
