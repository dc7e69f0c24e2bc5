"""Sampling on every protocol, against a real server on the tiny model: `/v1/translate`'s
`temperature`, `top_k`, `top_p` and `seed` (plain and streamed), KServe v2's parameters and
OpenAI's fields (the stock client) give the same draws for the same seed, and other seeds
other draws."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

MODEL = "tiny-reverse"  # reverses its input's pieces
TEXTS = ["abc de", "kol", "a b c", "edcba"]
HOT = {"temperature": 4.0}  # flat enough for the tiny model's draws to leave its argmax


def translate(url: str, texts: list[str], **options: Any) -> list[dict[str, Any]]:
    response = httpx.post(f"{url}/v1/translate", json={"texts": texts, "model": MODEL, **options},
                          timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def texts_of(outputs: list[dict[str, Any]]) -> list[str]:
    return [output["text"] for output in outputs]


def test_a_seed_repeats_the_outputs_and_seeds_differ(tiny_url: str) -> None:
    greedy = texts_of(translate(tiny_url, TEXTS))
    seeded = [texts_of(translate(tiny_url, TEXTS, seed=seed, **HOT)) for seed in (1, 1, 2, 3)]
    assert seeded[0] == seeded[1]
    assert len({tuple(s) for s in seeded[1:]}) > 1 and seeded[0] != greedy
    # the same text twice in one request: two rows, two generators
    twice = texts_of(translate(tiny_url, [TEXTS[0]] * 6, seed=5, **HOT))
    assert len(set(twice)) > 1
    # top_k 1 leaves one token to draw: greedy decoding
    assert texts_of(translate(tiny_url, TEXTS, seed=9, top_k=1, **HOT)) == greedy
    # a tiny nucleus keeps the most likely token only
    assert texts_of(translate(tiny_url, TEXTS, seed=9, top_p=1e-6, **HOT)) == greedy


def test_a_stream_draws_what_the_plain_answer_draws(tiny_url: str) -> None:
    options = {"model": MODEL, "seed": 4, "return_scores": True, **HOT}
    [plain] = translate(tiny_url, [TEXTS[0]], **{k: v for k, v in options.items() if k != "model"})
    with httpx.stream("POST", f"{tiny_url}/v1/translate", json={"text": TEXTS[0], "stream": True, **options},
                      timeout=30, trust_env=False) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    final = events[-1]
    assert final["done"] and final["output"]["text"] == plain["text"]
    assert "".join(e.get("delta", "") for e in events) == plain["text"]
    assert final["output"]["token_scores"] == pytest.approx(plain["token_scores"], abs=1e-5)


def test_kserve_parameters_draw_as_v1_does(tiny_url: str) -> None:
    body = {"inputs": [{"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}],
            "parameters": {"seed": 6, "top_k": 3, **HOT}}
    response = httpx.post(f"{tiny_url}/v2/models/{MODEL}/infer", json=body, timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    [output] = [o for o in response.json()["outputs"] if o["name"] == "output"]
    assert output["data"] == texts_of(translate(tiny_url, TEXTS, seed=6, top_k=3, **HOT))


def test_openais_n_samples_and_seed(tiny_url: str) -> None:
    openai = pytest.importorskip("openai")
    stock = openai.OpenAI(base_url=tiny_url + "/v1", api_key="unused", max_retries=0,
                          http_client=httpx.Client(trust_env=False))
    asked = {"model": MODEL, "prompt": TEXTS[:2], "n": 3, "seed": 8, **HOT}
    answer = stock.completions.create(**asked)
    again = stock.completions.create(**asked)
    texts = [choice.text for choice in answer.choices]
    assert [c.index for c in answer.choices] == list(range(6)) and texts == [c.text for c in again.choices]
    # prompt i's sample j is row 3i + j of /v1/translate's request with the same seed
    assert texts == texts_of(translate(tiny_url, [TEXTS[0]] * 3 + [TEXTS[1]] * 3, seed=8, **HOT))
    assert len(set(texts[:3])) > 1
    plain = stock.completions.create(model=MODEL, prompt=TEXTS[:2])
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens  # each prompt counted once
    rows = httpx.post(f"{tiny_url}/v1/translate", json={"texts": [TEXTS[0]] * 3 + [TEXTS[1]] * 3, "model": MODEL,
                                                         "seed": 8, **HOT}, timeout=30, trust_env=False).json()
    assert answer.usage.completion_tokens == rows["usage"]["output_tokens"]  # every choice's tokens
    chat = stock.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[0]}],
                                         n=2, seed=8, **HOT)
    assert [c.message.content for c in chat.choices] == texts_of(translate(tiny_url, [TEXTS[0]] * 2, seed=8, **HOT))
    # top_p alone samples at OpenAI's default temperature, 1
    nucleus = stock.completions.create(model=MODEL, prompt=TEXTS[0], top_p=0.9, seed=2)
    assert nucleus.choices[0].text == texts_of(translate(tiny_url, [TEXTS[0]], temperature=1.0, top_p=0.9, seed=2))[0]
