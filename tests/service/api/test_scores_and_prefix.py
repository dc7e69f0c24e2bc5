"""`return_scores`, `num_hypotheses` and `target_prefix` over `/v1/translate` (plain and
streamed) with the real tiny model, which reverses the pieces of its input ("abc de" -> "ed cba"),
and their 422s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.api.app import create_app
from tests.service.conftest import AppFactory, serving, tiny_settings

pytestmark = pytest.mark.anyio

TEXTS = ["abc de", "fgh", "ij klm", "no"]
PLAIN_KEYS = {"text", "finish_reason", "input_tokens", "output_tokens"}


async def post_all(models: Path, requests: list[dict[str, Any]], **settings: Any) -> list[Any]:
    """POST each body to `/v1/translate` of one app over the tiny model; the responses, in order."""
    async with serving(create_app(tiny_settings(models, **settings))) as client:
        return [await client.post("/v1/translate", json=body) for body in requests]


def outputs(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def events(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ")]


def check_score(output: dict[str, Any]) -> None:
    """`score` is the tokens' summed log-probability, plus `</s>`'s (negative) when it ended with
    one; `token_texts` has a text per token, and they join to the output's text."""
    assert len(output["token_scores"]) == output["output_tokens"] == len(output["token_texts"])
    assert "".join(output["token_texts"]) == output["text"]
    assert all(s <= 0 for s in output["token_scores"])
    summed = sum(output["token_scores"])
    if output["finish_reason"] == "eos":
        assert output["score"] < summed + 1e-5
    else:
        assert output["score"] == pytest.approx(summed, abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_return_scores_adds_scores_and_changes_nothing_else(served_tiny_models: Path,
                                                                  beam_size: int) -> None:
    scored, plain = await post_all(served_tiny_models, [
        {"texts": TEXTS, "beam_size": beam_size, "return_scores": True},
        {"texts": TEXTS, "beam_size": beam_size},
    ])
    for with_scores, without in zip(outputs(scored), outputs(plain), strict=True):
        assert set(without) == PLAIN_KEYS
        assert set(with_scores) == PLAIN_KEYS | {"score", "token_scores", "token_texts"}
        assert {k: with_scores[k] for k in PLAIN_KEYS} == without
        check_score(with_scores)


async def test_greedy_scores_are_the_model_log_probabilities(served_tiny_models: Path,
                                                             tiny_runtime: Any) -> None:
    """Against one teacher-forced pass of the merged decoder over the output's tokens."""
    from service.generation.search import generate

    [response] = await post_all(served_tiny_models, [{"text": "abc de", "return_scores": True}])
    [output] = outputs(response)
    tokenizer = tiny_runtime.tokenizer
    source = [*tokenizer.encode("abc de"), tokenizer.eos_id]
    [generated] = generate(tiny_runtime, [source], 1, 16)
    target = generated.tokens
    assert tokenizer.decode(target) == output["text"]
    state = tiny_runtime.encode(np.asarray([source]))
    logits = np.asarray(tiny_runtime.decode(np.asarray([[tiny_runtime.bos_id, *target]]), state).logits[0],
                        dtype=np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    expected = [log_probs[i, t] for i, t in enumerate(target)]
    assert output["token_scores"] == pytest.approx(expected, abs=1e-4)
    assert output["score"] == pytest.approx(sum(expected) + log_probs[len(target), tokenizer.eos_id], abs=1e-4)


async def test_num_hypotheses_gives_the_n_best_in_the_beam_order(served_tiny_models: Path) -> None:
    nbest, scored, greedy = await post_all(served_tiny_models, [
        {"texts": TEXTS, "beam_size": 4, "num_hypotheses": 3},
        {"texts": TEXTS, "beam_size": 4, "num_hypotheses": 2, "return_scores": True},
        {"texts": TEXTS, "num_hypotheses": 1},
    ])
    for output in outputs(nbest):
        assert set(output) == PLAIN_KEYS | {"hypotheses"}
        found = output["hypotheses"]
        assert 1 <= len(found) <= 3
        assert all(set(h) == {"text", "score", "finish_reason", "output_tokens"} for h in found)
        first = found[0]
        assert (first["text"], first["finish_reason"], first["output_tokens"]) == \
            (output["text"], output["finish_reason"], output["output_tokens"])
        # the beam's rank: the score over the tokens, `</s>` counted (length penalty 1)
        ranks = [h["score"] / (h["output_tokens"] + (h["finish_reason"] == "eos")) for h in found]
        assert ranks == sorted(ranks, reverse=True)
    assert any(len(o["hypotheses"]) == 3 for o in outputs(nbest))
    for output in outputs(scored):
        assert len(output["hypotheses"]) <= 2 and output["hypotheses"][0]["score"] == output["score"]
        assert output["hypotheses"][0]["token_scores"] == output["token_scores"]
        for hypothesis in output["hypotheses"]:
            check_score(hypothesis)
    for output in outputs(greedy):  # greedy: its one output, scored
        [only] = output["hypotheses"]
        assert only["text"] == output["text"] and only["score"] < 0


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_target_prefix_starts_the_output(served_tiny_models: Path, beam_size: int) -> None:
    plain, own, forced, each = await post_all(served_tiny_models, [
        {"texts": TEXTS, "beam_size": beam_size},
        {"text": "abc de", "beam_size": beam_size, "target_prefix": "ed", "return_scores": True},
        {"texts": TEXTS, "beam_size": beam_size, "target_prefix": "a", "return_scores": True,
         "num_hypotheses": beam_size},
        {"texts": TEXTS, "beam_size": beam_size, "target_prefix": ["", "hg", "", "o"]},
    ])
    expected = outputs(plain)
    assert expected[0]["text"].strip() == "ed cba"
    [kept] = outputs(own)  # tokenized as a text is ("▁e d"), so the tiny model's "e d ▁" differs
    assert kept["text"].startswith("ed") and kept["finish_reason"] == "eos"
    check_score(kept)
    for output in outputs(forced):
        assert output["text"].startswith("a")
        assert all(h["text"].startswith("a") for h in output["hypotheses"])
        check_score(output)
    mixed = outputs(each)
    assert mixed[0] == expected[0] and mixed[2] == expected[2]  # no prefix: as without, batched with others
    assert mixed[1]["text"].startswith("hg") and mixed[3]["text"].startswith("o")


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_streaming_with_a_prefix_and_scores(served_tiny_models: Path, beam_size: int,
                                                  tiny_repository_tokenizer: Any) -> None:
    body = {"text": "abc de", "beam_size": beam_size, "target_prefix": "a b", "return_scores": True,
            "num_hypotheses": beam_size}
    streamed, plain = await post_all(served_tiny_models, [{**body, "stream": True}, body])
    *tokens, final = events(streamed)
    [expected] = outputs(plain)
    assert final["done"] is True and final["output"] == expected
    assert "".join(e["delta"] for e in tokens + [final]) == expected["text"]
    prefix = tiny_repository_tokenizer.encode("a b")
    assert [e["token"]["id"] for e in tokens[:len(prefix)]] == prefix  # the prefix first
    assert tokens[len(prefix) - 1]["text"] == "a b" and tokens[-1]["text"] == expected["text"]
    assert all("score" not in e for e in tokens)
    check_score(final["output"])


async def test_prefix_rows_batch_with_other_rows(served_tiny_models: Path) -> None:
    """Concurrent requests, with and without prefixes and scores, share the running batch and
    each gets what it gets alone."""
    bodies = [{"text": t, **extra} for t in TEXTS
              for extra in ({}, {"target_prefix": "k"}, {"return_scores": True})]
    async with serving(create_app(tiny_settings(served_tiny_models, max_join_wait_ms=50))) as client:
        alone = [outputs(await client.post("/v1/translate", json=b)) for b in bodies]
        together = await asyncio.gather(*(client.post("/v1/translate", json=b) for b in bodies))
        cards = (await client.get("/v1/models")).json()["models"]
    for response, expected in zip(together, alone, strict=True):
        [got], [want] = outputs(response), expected
        assert {k: got[k] for k in PLAIN_KEYS} == {k: want[k] for k in PLAIN_KEYS}
        assert got.get("token_scores") == pytest.approx(want.get("token_scores"), abs=1e-5)
    assert cards[0]["batching"]["max_batch_rows"] > 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": "abc", "beam_size": 2, "num_hypotheses": 3}, "`num_hypotheses` (3) may be at most `beam_size` (2)"),
        ({"text": "abc", "num_hypotheses": 2}, "`num_hypotheses` (2) may be at most `beam_size` (1)"),
        ({"text": "abc", "num_hypotheses": 0}, "num_hypotheses"),
        ({"text": "abc", "num_hypotheses": 9, "beam_size": 8}, "num_hypotheses"),
        ({"text": "abc", "return_scores": "yes"}, "return_scores"),
        ({"text": "abc", "target_prefix": ["a"]}, "a list `target_prefix` needs `texts`, one prefix per text"),
        ({"texts": ["abc", "de"], "target_prefix": ["a"]}, "one prefix per text"),
        ({"text": "abc", "target_prefix": 5}, "target_prefix"),
        ({"text": "abc", "target_prefix": "a\u0000"}, "control character"),
        ({"text": "abc", "target_prefix": "abcdefgh", "max_new_tokens": 8},
         "target_prefix: 8 tokens; at most 7 allowed, to leave one of max_new_tokens (8) to generate"),
        ({"texts": ["abc", "de"], "target_prefix": ["", "abc"], "max_new_tokens": 3},
         "target_prefix.1: 3 tokens; at most 2 allowed"),
    ],
)
async def test_bad_option_requests_get_422(make_app: AppFactory, body: dict[str, Any], message: str) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", json=body)
        streamed = await client.post("/v1/translate", json={**body, "stream": True}) \
            if "texts" not in body else None
    assert response.status_code == 422, response.text
    assert set(response.json()) == {"error", "error_type"} and message in response.json()["error"]
    if streamed is not None:
        assert streamed.status_code == 422 and message in streamed.json()["error"]


async def test_a_prefix_beyond_the_model_target_length_is_refused(served_tiny_models: Path) -> None:
    [response] = await post_all(served_tiny_models, [{"text": "abc", "target_prefix": "abcdefghijklmno abc"}])
    assert response.status_code == 422
    assert "target_prefix: 20 tokens; at most 15 allowed" in response.json()["error"]
