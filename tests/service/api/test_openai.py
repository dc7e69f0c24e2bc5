"""OpenAI's API (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`' `data`):
the stock `openai` client against a real server (the tiny model on onnxruntime) giving
`/v1/translate`'s outputs, plain, n-best and streamed, and every refusal a 4xx with OpenAI's
error body (fake models)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.app import create_app
from service.observability import metrics
from tests.service.api.test_hostile_input import HOSTILE_BODIES
from tests.service.conftest import AppFactory, serving, tiny_settings
from tests.service.fakes import FakeLoader, FakeModel, write_models
from tests.service.live_server import serve, wait_until_ready

openai = pytest.importorskip("openai")

MODEL = "tiny-reverse"  # reverses its input's pieces
TEXTS = ["abc de", "kol", "a b c"]


def client(url: str, **options: Any) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=options.pop("api_key", "unused"), max_retries=0,
                         http_client=httpx.Client(trust_env=False), **options)


def v1(url: str, texts: list[str], **options: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/translate", json={"texts": texts, "model": MODEL, **options},
                          timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_are_v1s_outputs(tiny_url: str) -> None:
    answer = client(tiny_url).completions.create(model=MODEL, prompt=TEXTS)
    expected = v1(tiny_url, TEXTS)
    assert answer.object == "text_completion" and answer.model == MODEL and answer.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == \
        [(i, o["text"], "stop") for i, o in enumerate(expected["outputs"])]
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == \
        (expected["usage"]["input_tokens"], expected["usage"]["output_tokens"])
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    single = client(tiny_url).completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=1)
    [choice] = single.choices
    assert choice.finish_reason == "length" and single.usage.completion_tokens == 1
    assert choice.text == v1(tiny_url, [TEXTS[1]], max_new_tokens=1)["outputs"][0]["text"]
    with pytest.raises(openai.BadRequestError) as too_many:
        client(tiny_url).completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=4000)
    assert too_many.value.body["message"].startswith("max_tokens: at most")


def test_n_best_choices_are_the_beams_hypotheses(tiny_url: str) -> None:
    answer = client(tiny_url).completions.create(model=MODEL, prompt=TEXTS[:2], n=2, best_of=3)
    beams = v1(tiny_url, TEXTS[:2], beam_size=3, num_hypotheses=2)["outputs"]
    assert [(c.index, c.text) for c in answer.choices] == \
        [(2 * i + j, h["text"]) for i, o in enumerate(beams) for j, h in enumerate(o["hypotheses"])]
    assert answer.usage.completion_tokens == sum(h["output_tokens"] for o in beams for h in o["hypotheses"])
    chat = client(tiny_url).chat.completions.create(model=MODEL, n=3, messages=[{"role": "user", "content": TEXTS[0]}])
    [beam] = v1(tiny_url, [TEXTS[0]], beam_size=3, num_hypotheses=3)["outputs"]
    assert [c.message.content for c in chat.choices] == [h["text"] for h in beam["hypotheses"]]
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_chat_answers_the_last_user_message(tiny_url: str) -> None:
    [expected] = v1(tiny_url, [TEXTS[0]])["outputs"]
    answer = client(tiny_url).chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "something else"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": [{"type": "text", "text": "abc "}, {"type": "text", "text": "de"}]},
    ])
    [choice] = answer.choices
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert choice.finish_reason == "stop" and answer.usage.completion_tokens == expected["output_tokens"]


def test_streams_are_openais_chunks(tiny_url: str) -> None:
    [expected] = v1(tiny_url, [TEXTS[0]])["outputs"]
    chunks = list(client(tiny_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": TEXTS[0]}], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected["output_tokens"]
    pieces = list(client(tiny_url).completions.create(model=MODEL, prompt=TEXTS[0], stream=True))
    assert "".join(c.choices[0].text for c in pieces) == expected["text"]
    assert pieces[-1].choices[0].finish_reason == "stop" and len(pieces) > 2  # a chunk per token
    raw = httpx.post(f"{tiny_url}/v1/completions", json={"model": MODEL, "prompt": TEXTS[0], "stream": True},
                     timeout=30, trust_env=False)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n") and raw.text.count("[DONE]") == 1


def test_the_models_list_in_openais_shape(tiny_url: str) -> None:
    listed = client(tiny_url).models.list()
    assert [m.id for m in listed.data] == [MODEL] and listed.data[0].owned_by == "attnserve"
    assert listed.data[0].created > 0


def test_logprobs_are_v1s_token_scores_in_openais_shapes(tiny_url: str) -> None:
    stock = client(tiny_url)
    [expected] = v1(tiny_url, [TEXTS[0]], return_scores=True)["outputs"]
    chat = stock.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[0]}], logprobs=True)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == expected["token_texts"] and "".join(t.token for t in content) == expected["text"]
    assert [t.logprob for t in content] == pytest.approx(expected["token_scores"], abs=1e-6)
    assert all(t.bytes == list(t.token.encode()) and t.top_logprobs == [] for t in content)
    completion = stock.completions.create(model=MODEL, prompt=TEXTS[0], logprobs=0)
    found = completion.choices[0].logprobs
    assert found.tokens == expected["token_texts"] and found.token_logprobs == pytest.approx(expected["token_scores"])
    assert found.text_offset == [sum(map(len, found.tokens[:i])) for i in range(len(found.tokens))]
    assert stock.completions.create(model=MODEL, prompt=TEXTS[0]).choices[0].logprobs is None
    # the n best of a beam: each choice's own tokens
    beams = stock.completions.create(model=MODEL, prompt=TEXTS[0], n=2, logprobs=0)
    [output] = v1(tiny_url, [TEXTS[0]], beam_size=2, num_hypotheses=2, return_scores=True)["outputs"]
    for choice, hypothesis in zip(beams.choices, output["hypotheses"], strict=True):
        assert choice.logprobs.tokens == hypothesis["token_texts"] and "".join(choice.logprobs.tokens) == choice.text
        assert choice.logprobs.token_logprobs == pytest.approx(hypothesis["token_scores"], abs=1e-6)


def test_refusals_raise_the_clients_errors(tiny_url: str) -> None:
    stock = client(tiny_url)
    messages = [{"role": "user", "content": TEXTS[0]}]
    with pytest.raises(openai.BadRequestError) as refused:
        stock.chat.completions.create(model=MODEL, messages=messages, stop=["x"])
    with pytest.raises(openai.NotFoundError) as unknown:
        stock.chat.completions.create(model="nope", messages=messages)
    assert "stop" in refused.value.body["message"] and refused.value.body["type"] == "invalid_input"
    assert unknown.value.body == {"message": "no model 'nope' on this server", "type": "model_not_found",
                                  "param": None, "code": 404}
    # temperature 0 is greedy decoding: accepted
    assert stock.chat.completions.create(model=MODEL, messages=messages, temperature=0).choices


@pytest.fixture
def fake_app(tmp_path: Path, make_app: AppFactory) -> Any:
    """Fake models: a translator (reverses its input) and a summarizer."""
    root = write_models(tmp_path / "oa-models", {"en-it": "translate", "summarize-en": "summarize"})
    return lambda **settings: make_app(models_dir=root, **settings)


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "abc"}]


@pytest.mark.anyio
async def test_any_task_answers(fake_app: Any) -> None:
    async with serving(fake_app()) as client_:
        translated = await client_.post(CHAT, json={"model": "en-it", "messages": USER})
        summarized = await client_.post("/v1/completions", json={"model": "summarize-en", "prompt": "abc"})
    assert translated.json()["choices"][0]["message"]["content"] == "cba"
    assert summarized.status_code == 200 and summarized.json()["model"] == "summarize-en"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (CHAT, {"messages": USER}, 400, "model: Field required"),
        (CHAT, {"model": "en-it", "messages": []}, 400, "messages"),
        (CHAT, {"model": "en-it", "messages": USER, "top_p": 0}, 400, "top_p"),
        (CHAT, {"model": "en-it", "messages": USER, "temperature": -1}, 400, "temperature"),
        (CHAT, {"model": "en-it", "messages": USER, "temperature": 1, "n": 2, "stream": True}, 400, "n = 1"),
        (CHAT, {"model": "en-it", "messages": USER, "stop": ["\n"]}, 400, "stop sequences"),
        (CHAT, {"model": "en-it", "messages": USER, "frequency_penalty": 1}, 400, "penalties"),
        (CHAT, {"model": "en-it", "messages": USER, "logit_bias": {"5": 1}}, 400, "logit_bias"),
        (CHAT, {"model": "en-it", "messages": USER, "logprobs": True, "top_logprobs": 2}, 400, "alternatives"),
        (CHAT, {"model": "en-it", "messages": USER, "logprobs": True, "stream": True}, 400, "logprobs: not with stream"),
        ("/v1/completions", {"model": "en-it", "prompt": "abc", "logprobs": 1}, 400, "send 0"),
        (CHAT, {"model": "en-it", "messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
        (CHAT, {"model": "en-it", "messages": USER, "response_format": {"type": "json_object"}}, 400, "text only"),
        (CHAT, {"model": "en-it", "messages": USER, "n": 2, "stream": True}, 400, "n = 1"),
        (CHAT, {"model": "en-it", "messages": USER, "n": 99}, 400, "n"),
        (CHAT, {"model": "en-it", "messages": [*USER, {"role": "assistant", "content": "x"}]}, 400,
         "the last message must be the user's"),
        (CHAT, {"model": "en-it", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "only text parts"),
        (CHAT, {"model": "en-it", "messages": [{"role": "user", "content": ""}]}, 400,
         "messages.0.content: String should have at least 1 character"),
        ("/v1/completions", {"model": "en-it", "prompt": ["abc", ""]}, 400, "prompt.1: String should have"),
        (CHAT, {"model": "en-it", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        (CHAT, {"model": "en-it", "messages": [USER[0], {"role": "user", "content": "a\u0000b"}]}, 400,
         "messages.1.content: Value error, the text holds a control character (U+0000)"),
        (CHAT, {"model": "en-it", "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
        (CHAT, {"model": "nope", "messages": USER}, 404, "no model 'nope'"),
        ("/v1/completions", {"model": "en-it", "prompt": "abc", "echo": True}, 400, "echo"),
        ("/v1/completions", {"model": "en-it", "prompt": "abc", "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"model": "en-it", "prompt": "abc", "n": 3, "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"model": "en-it", "prompt": ["a", "b"], "stream": True}, 400, "one prompt"),
        ("/v1/completions", {"model": "en-it", "prompt": [[1, 2, 3]]}, 400, "prompt"),
        ("/v1/completions", {"model": "en-it", "prompt": "abc", "temperature": 1, "n": 2, "best_of": 3}, 400,
         "best_of: with sampling"),
        ("/v1/completions", ["abc"], 400, "object"),
    ],
)
async def test_bad_requests_get_openais_error_body(fake_app: Any, path: str, body: Any, status: int,
                                                   message: str) -> None:
    async with serving(fake_app()) as client_:
        response = await client_.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert message in error["message"], error


@pytest.mark.anyio
async def test_bodies_that_are_not_json_and_the_api_key(fake_app: Any) -> None:
    async with serving(fake_app(api_key="s3cret")) as client_:
        keyed = {"Authorization": "Bearer s3cret"}
        missing = await client_.post(CHAT, json={"model": "en-it", "messages": USER})
        plain = await client_.post(CHAT, content=b"{}", headers={**keyed, "content-type": "text/plain"})
        broken = await client_.post(CHAT, content=b'{"model": ', headers={**keyed, "content-type": "application/json"})
        answered = await client_.post(CHAT, json={"model": "en-it", "messages": USER}, headers=keyed)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "unauthorized"
    assert plain.status_code == 415 and plain.json()["error"]["code"] == 415
    assert broken.status_code == 400 and set(broken.json()["error"]) == {"message", "type", "param", "code"}
    assert answered.status_code == 200 and json.loads(answered.text)["choices"][0]["message"]["content"] == "cba"


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
async def test_hostile_bodies_get_a_4xx_with_openais_error_body(make_app: AppFactory, name: str) -> None:
    content, content_type = HOSTILE_BODIES[name]
    headers = {"content-type": content_type} if content_type else {}
    async with serving(make_app(), wait_ready=True) as client_:
        response = await client_.post(CHAT, content=content, headers=headers)
        after = await client_.post(CHAT, json={"model": "translate-en-it", "messages": USER})
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    assert "Traceback" not in error["message"] and len(error["message"]) < 1000
    assert after.status_code == 200, after.text


def test_a_client_closing_its_stream_frees_the_row(models_dir: Path) -> None:
    """The stock client's stream closed after three chunks: the row leaves the running batch at
    the next step, counted as cancelled while decoding."""
    def cancelled() -> float:
        return metrics.REGISTRY.get_sample_value(
            "attnserve_cancelled_rows_total", {"model": "translate-en-it", "stage": "decoding"}) or 0.0

    fake = FakeModel(step_delay_s=0.03)
    app = create_app(tiny_settings(models_dir), loader=FakeLoader(), generator=lambda runtime: fake.generate)
    before = cancelled()
    with serve(app) as url:
        wait_until_ready(url)
        stream = client(url).chat.completions.create(
            model="translate-en-it", messages=[{"role": "user", "content": "abcdefghijklmnopqrstuvwxyz" * 2}],
            stream=True)
        chunks = [next(iter(stream)) for _ in range(3)]
        stream.close()
        deadline = time.monotonic() + 10
        while cancelled() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        batcher = app.state.registry.resolve("translate", None).batcher
        assert cancelled() == before + 1 and batcher.running == 0
    assert [c.choices[0].delta.content for c in chunks] == ["", "z", "y"]  # the role, then the reversal
    assert len(fake.steps) < 40  # not the 53 steps of the whole output
