"""Long documents: the splitting rule (`service.api.documents`), and translation, streaming,
limits and summarization's `truncate` over the fake models (a character tokenizer and a model
that reverses its input)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.documents import split
from service.core.errors import InvalidInput
from tests.service.api.test_routes import assert_error
from tests.service.conftest import AppFactory, serving
from tests.service.fakes import CharTokenizer, FakeModel

TOKENIZER = CharTokenizer()


def rows(text: str, limit: int = 63) -> tuple[list[str], list[str]]:
    document = split(text, TOKENIZER, limit, "en", "text")
    assert document.join(document.segments) == text  # the layout is kept exactly
    assert [len(ids) for ids in document.ids] == [len(TOKENIZER.encode(s)) for s in document.segments]
    return document.segments, document.separators


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize("text", ["hello world", "  hello world.  ", "one sentence, no break\n"])
def test_one_sentence_within_the_window_is_one_row_as_sent(text: str) -> None:
    assert rows(text) == ([text], ["", ""])


def test_lines_and_sentences_are_rows_with_the_whitespace_kept_between_them() -> None:
    text = ("  first one. second one!  third\n\n\tnext paragraph.\r\n * item a\n"
            "  - item b \n+ item c;\n\u2022 item d\n")
    assert rows(text) == (
        ["first one.", "second one!", "third", "next paragraph.", "item a", "item b",
         "item c;", "item d"],
        ["  ", " ", "  ", "\n\n\t", "\r\n * ", "\n  - ", " \n+ ", "\n\u2022 ", "\n"],
    )


def test_a_sentence_longer_than_the_window_is_cut_between_words() -> None:
    text = "aaa bbb  ccc ddd eee fff"
    segments, separators = rows(text, limit=8)
    assert segments == ["aaa bbb", "ccc ddd", "eee fff"]
    assert separators == ["", "  ", " ", ""]
    assert all(len(TOKENIZER.encode(s)) <= 8 for s in segments)


def test_a_word_longer_than_the_window_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"text: a word of 9 tokens; at most 8 allowed"):
        split("ok. abcdefghi jk", TOKENIZER, 8, "en", "text")


def test_a_text_without_tokens_is_refused() -> None:
    with pytest.raises(InvalidInput, match="text: the text has no tokens"):
        split(" \n\n ", TOKENIZER, 8, "en", "text")


class NoDots(CharTokenizer):
    """Drops dots: a sentence of dots only has no tokens."""

    def encode(self, text: str) -> list[int]:
        return super().encode(text.replace(".", ""))


def test_a_piece_without_tokens_stays_as_it_is() -> None:
    document = split("abc.\n...\ndef.", NoDots(), 63, "en", "text")
    assert document.segments == ["abc.", "def."]
    assert document.separators == ["", "\n...\n", ""]
    assert document.join(["X", "Y"]) == "X\n...\nY"


@pytest.mark.parametrize("text", [" " * 19_999 + "a", "a" + " \t" * 9_999, "ab\n" * 6_000,
                                  "ab. " * 4_999])
def test_splitting_20000_characters_takes_little_time(text: str) -> None:
    started = time.perf_counter()
    document = split(text, TOKENIZER, 63, "en", "text")
    assert time.perf_counter() - started < 0.5
    assert document.join(document.segments) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab .!?\n\t *-", min_size=1, max_size=80).filter(lambda t: any(c in "ab" for c in t)))
def test_joining_the_segments_gives_the_text_back(text: str) -> None:
    try:
        segments, separators = rows(text, limit=6)
    except InvalidInput as error:
        assert max(len(word) for word in text.split()) > 6, error
        return
    if separators != ["", ""]:  # split: the segments hold no whitespace at their ends
        assert all(s and s == s.strip() for s in segments)
        assert all(not sep.strip(" \n\t*+-\u2022") for sep in separators)


# ---------------------------------------------------------------- translation over HTTP

DOCUMENT = ("this tool converts files. it is fast.\n\n"
            "  it reads text\n"
            "  it writes html\n\n"
            "more help is in the manual.\n")


def reversed_layout(text: str) -> str:
    """What the fake model gives for DOCUMENT: each segment reversed, the layout as it was."""
    document = split(text, TOKENIZER, 63, "en", "text")
    return document.join([s[::-1] for s in document.segments])


@pytest.mark.anyio
async def test_a_document_is_translated_whole_in_one_batch(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    async with serving(make_app(max_wait_ms=50)) as client:
        warmup = len(fake_model.batches)
        response = await client.post("/v1/translate", json={"texts": [DOCUMENT, "hello"]})
    assert response.status_code == 200, response.text
    [doc, single] = response.json()["outputs"]
    assert doc["text"] == (".selif strevnoc loot siht .tsaf si ti\n\n"
                           "  txet sdaer ti\n"
                           "  lmth setirw ti\n\n"
                           ".launam eht ni si pleh erom\n")
    assert doc["text"] == reversed_layout(DOCUMENT)
    assert single == {"text": "olleh", "finish_reason": "eos", "input_tokens": 6,
                      "output_tokens": 5}
    segments = split(DOCUMENT, TOKENIZER, 63, "en", "text").segments
    assert doc["input_tokens"] == sum(len(s) + 1 for s in segments)  # each row ends with EOS
    assert doc["output_tokens"] == sum(len(s) for s in segments)
    assert doc["finish_reason"] == "eos"
    assert response.json()["usage"] == {"input_tokens": doc["input_tokens"] + 6,
                                        "output_tokens": doc["output_tokens"] + 5}
    assert fake_model.batches[warmup:] == [sorted([len(s) + 1 for s in segments] + [6])]
    assert sorted(fake_model.seen[-6:]) == sorted([*segments, "hello"])


@pytest.mark.anyio
async def test_a_row_cut_at_its_token_limit_makes_the_text_length(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate",
                                     json={"text": "ab. abcdef.", "max_new_tokens": 4})
    [out] = response.json()["outputs"]
    assert (out["text"], out["finish_reason"]) == (".ba .fed", "length")
    assert out["output_tokens"] == 7


@pytest.mark.anyio
async def test_a_long_sentence_is_translated_in_chunks(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    text = " ".join(["word"] * 30)  # 149 characters: over the fake model's 63 tokens
    chunks = split(text, TOKENIZER, 63, "en", "text").segments
    assert len(chunks) > 2 and all(len(c) <= 63 for c in chunks) and " ".join(chunks) == text
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", json={"text": text})
    [out] = response.json()["outputs"]
    assert out["text"] == " ".join(c[::-1] for c in chunks)
    assert out["input_tokens"] == sum(len(c) + 1 for c in chunks)
    assert sorted(fake_model.seen[-len(chunks):]) == sorted(chunks)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "settings", "message"),
    [
        ({"text": "abc. " * 40}, {"max_segments": 39},
         r"^text: 40 sentences \(rows for the model\); at most 39 in one request$"),
        ({"texts": ["ab. cd.", "ef. gh. ij."]}, {"max_segments": 4},
         r"^texts: 5 sentences \(rows for the model\); at most 4 in one request$"),
        ({"texts": ["ab. cd. ef.", "gh. ij.", "kl."]}, {"max_segments": 4},
         r"^texts: over 4 sentences \(rows for the model\); at most 4 in one request$"),
        ({"text": "abc. " * 40}, {"max_queue_size": 30, "max_texts": 2},
         r"at most 30 in one request"),
        ({"text": "ab. " * 101}, {"max_document_chars": 400},
         r"^text: 404 characters; at most 400 allowed$"),
        ({"text": "x" * 64}, {}, r"^text: a word of 64 tokens; at most 63 allowed"),
        ({"text": "ab", "truncate": 3}, {}, r"^truncate: translation splits long texts"),
    ],
)
async def test_document_limits_are_422(
    make_app: AppFactory, body: dict[str, Any], settings: dict[str, Any], message: str
) -> None:
    async with serving(make_app(**settings)) as client:
        response = await client.post("/v1/translate", json=body)
    error = assert_error(response, 422, "invalid_input")
    assert re.search(message, error["error"]), error


@pytest.mark.anyio
async def test_a_document_beyond_the_room_left_in_the_queue_is_429(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    async with serving(make_app(max_queue_size=8, max_texts=2, max_batch_size=1)) as client:
        fake_model.gate = threading.Event()
        first = asyncio.ensure_future(client.post("/v1/translate", json={"text": "ab. cd. ef. gh."}))
        await asyncio.sleep(0.2)  # one row running, three queued: room for five
        refused = await client.post("/v1/translate", json={"text": "ab. cd. ef. gh. ij. kl."})
        admitted = asyncio.ensure_future(client.post("/v1/translate", json={"text": "ab. cd."}))
        await asyncio.sleep(0.1)
        fake_model.gate.set()
        assert (await first).json()["outputs"][0]["text"] == ".ba .dc .fe .hg"
        assert (await admitted).status_code == 200
    assert_error(refused, 429, "overloaded")
    assert refused.headers["retry-after"] == "1"


# ---------------------------------------------------------------- streaming


def events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in body.decode().split("\n\n") if line]


@pytest.mark.anyio
async def test_a_streamed_document_sends_its_rows_in_order(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    fake_model.step_delay_s = 0.001
    text = "  abcdefghij klm.\n\nmn. pqrstu\n"  # the first row ends last
    async with serving(make_app()) as client:
        plain = (await client.post("/v1/translate", json={"text": text})).json()
        streamed = await client.post("/v1/translate", json={"text": text, "stream": True})
    assert streamed.status_code == 200
    *tokens, final = events(streamed.content)
    [expected] = plain["outputs"]
    assert expected["text"] == "  .mlk jihgfedcba\n\n.nm utsrqp\n"
    assert final["done"] is True and final["output"] == expected
    assert final["usage"] == plain["usage"]
    assert "".join(e["delta"] for e in [*tokens, final]) == expected["text"]
    assert [e["index"] for e in tokens] == list(range(expected["output_tokens"]))
    assert all(expected["text"].startswith(e["text"]) for e in tokens)
    assert [e["delta"] for e in tokens][:2] == ["  .", "m"]  # the leading whitespace first
    assert final["delta"] == "\n"  # the trailing whitespace last
    assert fake_model.steps[0] == 3  # the three rows decoded together


# ---------------------------------------------------------------- summarization: truncate

LONG = "abcdefgh " * 8  # 71 tokens: over the fake model's 63


@pytest.mark.anyio
async def test_summarize_refuses_a_long_text_with_the_limit_in_tokens(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/summarize", json={"text": LONG})
        infer = await client.post("/v2/models/summarize-en/infer", json={"inputs": [
            {"name": "text", "shape": [1], "datatype": "BYTES", "data": [LONG]}]})
    error = assert_error(response, 422, "invalid_input")
    assert error["error"] == ("text: 71 tokens; at most 63 allowed "
                              "(`truncate` keeps the first ones)")
    assert infer.status_code == 400
    assert infer.json() == {"error": "inputs.text[0]: 71 tokens; at most 63 allowed "
                                     "(`truncate` keeps the first ones)"}


@pytest.mark.anyio
async def test_summarize_truncates_when_asked(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        as_many = await client.post("/v1/summarize",
                                    json={"texts": [LONG, "short"], "truncate": True})
        few = await client.post("/v1/summarize", json={"text": LONG, "truncate": 5})
        off = await client.post("/v1/summarize", json={"text": "short", "truncate": False})
        infer = await client.post("/v2/models/summarize-en/infer", json={
            "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [LONG]}],
            "parameters": {"truncate": 5}})
    [cut, short] = as_many.json()["outputs"]
    assert cut == {"text": LONG.strip()[:63][::-1], "finish_reason": "eos", "input_tokens": 64,
                   "output_tokens": 63, "truncated": True}
    assert short["truncated"] is False and short["text"] == "trohs"
    assert few.json()["outputs"][0] == {"text": "edcba", "finish_reason": "eos",
                                        "input_tokens": 6, "output_tokens": 5, "truncated": True}
    assert "truncated" not in off.json()["outputs"][0]
    assert infer.status_code == 200, infer.text
    assert infer.json()["outputs"][0]["data"] == ["edcba"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("truncate", "message"),
    [(64, "^truncate: at most 63 tokens for model 'summarize-en'$"), (0, "truncate"),
     ("5", "truncate"), (1.5, "truncate")],
)
async def test_bad_truncate_is_422(make_app: AppFactory, truncate: Any, message: str) -> None:
    async with serving(make_app()) as client:
        response = await client.post("/v1/summarize", json={"text": "abc", "truncate": truncate})
    error = assert_error(response, 422, "invalid_input")
    assert re.search(message, error["error"]), error


# ---------------------------------------------------------------- KServe v2


@pytest.mark.anyio
async def test_v2_translates_documents_like_v1(make_app: AppFactory) -> None:
    async with serving(make_app()) as client:
        v1 = await client.post("/v1/translate", json={"texts": [DOCUMENT, "ab"]})
        v2 = await client.post("/v2/models/translate-en-it/infer", json={"inputs": [
            {"name": "text", "shape": [2], "datatype": "BYTES", "data": [DOCUMENT, "ab"]}]})
        truncating = await client.post("/v2/models/translate-en-it/infer", json={
            "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["ab"]}],
            "parameters": {"truncate": 4}})
    assert v2.status_code == 200, v2.text
    assert v2.json()["outputs"][0]["data"] == [o["text"] for o in v1.json()["outputs"]]
    assert truncating.status_code == 400
    assert truncating.json()["error"].startswith("truncate: translation splits long texts")
