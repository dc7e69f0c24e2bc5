"""Hostile input: every malformed, oversized or strange request gets a 4xx with the error body.

Raw bodies cover what a schema cannot say (invalid UTF-8, NUL bytes, lone surrogates, deep
nesting, wrong or missing content types, 10 MB bodies declared or chunked); schemathesis then
fuzzes every operation of the OpenAPI document in-process (bounded examples) and checks that
no response is a 5xx or breaks the documented schema.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import AppFactory, serving
from tests.service.fakes import FakeLoader, reverse, write_models

pytestmark = pytest.mark.anyio

JSON = "application/json"
TEN_MB = 10 * 1024 * 1024

HOSTILE_BODIES: dict[str, tuple[bytes, str | None]] = {
    "invalid utf-8": (b'{"text": "ab\xff\xfe\xc0"}', JSON),
    "truncated utf-8": (b'{"text": "ab\xe2\x82"}', JSON),
    "lone surrogate": (b'{"text": "ab\\ud800cd"}', JSON),
    "lone low surrogate": (b'{"texts": ["ok", "\\udfff"]}', JSON),
    "escaped NUL": (b'{"text": "ab\\u0000cd"}', JSON),
    "raw NUL": (b'{"text": "ab\x00cd"}', JSON),
    "escape character": (b'{"text": "ab\\u001b[31mcd"}', JSON),
    "C1 control": (b'{"text": "ab\\u0085cd"}', JSON),
    "NUL in the model name": (b'{"text": "abc", "model": "x\\u0000"}', JSON),
    "deeply nested array": (b"[" * 100_000 + b"]" * 100_000, JSON),
    "deeply nested field": (b'{"text": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001, JSON),
    "huge integer": (b'{"text": "abc", "beam_size": 1' + b"0" * 5000 + b"}", JSON),
    "NaN": (b'{"text": "abc", "max_new_tokens": NaN}', JSON),
    "not an object": (b'"just a string"', JSON),
    "null": (b"null", JSON),
    "empty body": (b"", JSON),
    "truncated JSON": (b'{"text": "abc"', JSON),
    "text/plain": (b'{"text": "abc"}', "text/plain"),
    "form": (b"text=abc", "application/x-www-form-urlencoded"),
    "multipart": (b"--x\r\n\r\nabc\r\n--x--", "multipart/form-data; boundary=x"),
    "no content type": (b'{"text": "abc"}', None),
    "thousands of texts": (json.dumps({"texts": ["abc"] * 5000}).encode(), JSON),
    "one extremely long token": (json.dumps({"text": "a" * 1999}).encode(), JSON),
    "over the character limit": (json.dumps({"text": "ab " * 40_000}).encode(), JSON),
    "unknown field": (b'{"text": "abc", "repetition_penalty": 2}', JSON),
    "temperature not a number": (b'{"text": "abc", "temperature": NaN}', JSON),
    "a seed of 40 digits": (b'{"text": "abc", "temperature": 1, "seed": 1234567890123456789012345678901234567890}', JSON),
    "100 KB unknown field name": (b'{"text": "abc", "' + b"x" * 100_000 + b'": 1}', JSON),
    "wrong types": (b'{"text": 5, "beam_size": "3"}', JSON),
    "negative limits": (b'{"text": "abc", "beam_size": -1, "max_new_tokens": 0}', JSON),
}


def assert_client_error(response: Any) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
    body = response.json()
    assert set(body) == {"error", "error_type"}
    assert "Traceback" not in body["error"] and len(body["error"]) < 1000
    return body


@pytest.mark.parametrize("route", ["/v1/translate", "/v1/attention"])
@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
async def test_hostile_bodies_get_a_4xx_with_the_error_body(
    make_app: AppFactory, name: str, route: str
) -> None:
    content, content_type = HOSTILE_BODIES[name]
    headers = {"content-type": content_type} if content_type else {}
    async with serving(make_app(), wait_ready=True) as client:
        response = await client.post(route, content=content, headers=headers)
        after = await client.post("/v1/translate", json={"text": "abc"})
    assert_client_error(response)
    assert after.status_code == 200


@pytest.mark.parametrize(("name", "status"), [
    ("lone surrogate", 422), ("escaped NUL", 422), ("text/plain", 415),
    ("no content type", 415), ("invalid utf-8", 400), ("deeply nested array", 400),
])
async def test_hostile_bodies_get_the_right_status(
    make_app: AppFactory, name: str, status: int
) -> None:
    content, content_type = HOSTILE_BODIES[name]
    headers = {"content-type": content_type} if content_type else {}
    async with serving(make_app()) as client:
        response = await client.post("/v1/translate", content=content, headers=headers)
    assert response.status_code == status


async def test_ten_megabyte_bodies_get_413_declared_or_chunked(make_app: AppFactory) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        piece = b" " * 65536
        for _ in range(TEN_MB // len(piece)):
            yield piece

    async with serving(make_app()) as client:
        declared = await client.post("/v1/translate", content=b"{" + b" " * TEN_MB + b"}",
                                     headers={"content-type": JSON})
        chunked = await client.post("/v1/translate", content=chunks(),
                                    headers={"content-type": JSON})
    for response in (declared, chunked):
        assert response.status_code == 413
        assert assert_client_error(response)["error_type"] == "payload_too_large"


V2_INFER = "/v2/models/translate-en-it/infer"
HUGE_DIM = int("9" * 4000)  # parses (under Python's 4,300-digit limit); 8 of them: 32,000 digits


def v2_body(data: Any = None, *, raw_data: str | None = None, **fields: Any) -> bytes:
    """An infer body of one `text` input (json.dumps writes lone surrogates and control
    characters as JSON escapes); `raw_data` is spliced in as the data's JSON."""
    tensor: dict[str, Any] = {"name": "text", "shape": [1], "datatype": "BYTES",
                              "data": data if data is not None else ["abc"]}
    tensor.update(fields.pop("tensor", {}))
    document = json.dumps({"inputs": [tensor], **fields})
    if raw_data is not None:
        document = document.replace('"data": ["abc"]', f'"data": {raw_data}')
    return document.encode()


V2_HOSTILE_BODIES: dict[str, tuple[bytes, str]] = {
    "100,000-deep JSON": (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    "data nested 980 deep": (v2_body(raw_data="[" * 980 + '"abc"' + "]" * 980), "nested"),
    "data nested 9 deep": (v2_body(raw_data="[" * 9 + '"abc"' + "]" * 9), "nested deeper"),
    "shape of 32,000-digit product": (v2_body(tensor={"shape": [HUGE_DIM] * 8}), "shape"),
    "lone surrogate in BYTES": (v2_body(["ab\ud800cd"]), "lone surrogate"),
    "lone surrogate in the id": (v2_body(id="r\udc00"), "id: "),
    "NUL in BYTES": (v2_body(["ab\u0000cd"]), "control character"),
    "ESC in BYTES": (v2_body(["ab\u001b[31mcd"]), "control character"),
    "100 KB parameter name": (v2_body(parameters={"p" * 100_000: 1}), "ppp..."),
    "100 KB output name": (v2_body(outputs=[{"name": "o" * 100_000}]), "unknown output"),
    "100 KB input name": (v2_body(tensor={"name": "i" * 100_000}), "expected one input"),
    "100 KB datatype": (v2_body(tensor={"datatype": "D" * 100_000}), "datatype"),
    "100 KB id": (v2_body(id="i" * 100_000), "id"),
}


@pytest.mark.parametrize("name", list(V2_HOSTILE_BODIES))
async def test_hostile_v2_bodies_get_a_400_with_the_protocol_error(
    make_app: AppFactory, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    content, message = V2_HOSTILE_BODIES[name]
    async with serving(make_app()) as client:
        response = await client.post(V2_INFER, content=content,
                                     headers={"content-type": JSON})
        after = await client.post(V2_INFER, content=v2_body())
    assert response.status_code == 400, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"} and message in body["error"], body
    assert len(body["error"]) < 1000
    assert after.status_code == 200 and after.json()["outputs"][0]["data"] == ["cba"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_v2_binary_texts_are_checked_like_json_ones(make_app: AppFactory) -> None:
    from service.api import open_inference

    def binary(texts: list[bytes]) -> tuple[bytes, dict[str, str]]:
        chunk = b"".join(len(t).to_bytes(4, "little") + t for t in texts)
        header = json.dumps({"inputs": [{"name": "text", "shape": [len(texts)],
                                         "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(chunk)}}]})
        return header.encode() + chunk, {open_inference.HEADER_LENGTH: str(len(header))}

    async with serving(make_app()) as client:
        responses = [await client.post(V2_INFER, content=content, headers=headers)
                     for content, headers in (binary([b"ab\x00c"]), binary([b"ab\x1bc"]),
                                              binary([b"ab\xed\xa0\x80"]))]
        fine = await client.post(V2_INFER, content=binary([b"abc"])[0],
                                 headers=binary([b"abc"])[1])
    assert [r.status_code for r in responses] == [400, 400, 400]
    assert "control character" in responses[0].json()["error"]
    assert "UTF-8" in responses[2].json()["error"]
    assert fine.status_code == 200


def test_tabs_newlines_and_other_scripts_are_still_welcome() -> None:
    from service.api.schemas import GenerateRequest

    text = "ab\tc\r\nd é 漢字 👍 \u200b"
    assert GenerateRequest(text=text).inputs == [text]


# ---- property-based fuzzing of the OpenAPI document ------------------------------------------

schemathesis = pytest.importorskip("schemathesis")
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = 25  # per operation: the fuzzing's time is bounded by examples x deadline
FUZZ_DEADLINE = timedelta(seconds=10)  # each fuzzed request is answered within this


@pytest.fixture(scope="module")
def fuzzed_app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from schemathesis.python import asgi

    from service.api.app import create_app
    from service.core.settings import Settings

    models = write_models(tmp_path_factory.mktemp("fuzz") / "models",
                          {"translate-en-it": "translate", "summarize-en": "summarize"})
    def generate(sources: list[list[int]], beam_size: int, max_new_tokens: int,
                 hooks: Any = None) -> list[Any]:
        # The fake model without its fault injection (it fails on unknown characters).
        return [reverse(source, max_new_tokens) for source in sources]

    app = create_app(Settings(models_dir=Path(models)), loader=FakeLoader(),
                     generator=lambda runtime: generate)
    with asgi.get_client(app) as client:  # starts the lifespan, kept for the module
        for _ in range(600):
            if client.get("/health/ready").status_code == 200:
                break
            import time

            time.sleep(0.05)
    return app


def no_server_error_but_deadlines(ctx: Any, response: Any, case: Any) -> None:
    """No 5xx, except the 504 a fuzzed `timeout_ms` of a millisecond earns by design."""
    if response.status_code < 500:
        return
    body = response.json()
    assert response.status_code == 504 and "deadline" in body["error"], (
        f"{response.status_code}: {body}"
    )


def test_fuzzed_requests_never_get_a_5xx_or_break_the_schema(fuzzed_app: Any) -> None:
    from hypothesis import given
    from schemathesis.specs.openapi.checks import (
        response_schema_conformance,
        status_code_conformance,
    )

    api = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 7  # translate, summarize, attention, models, health x2, metrics
    fuzzed = {f"{operation.method.upper()} {operation.path}" for operation in operations}
    assert {"POST /v2/models/{name}/infer", "POST /v2/models/{name}/versions/{version}/infer",
            "GET /v2/models/{name}"} <= fuzzed  # KServe v2 too, its infer body included
    assert {"POST /translate", "GET /languages"} <= fuzzed  # and LibreTranslate's, JSON and form bodies
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= fuzzed  # and OpenAI's
    checks = [no_server_error_but_deadlines, response_schema_conformance,
              status_code_conformance]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=FUZZ_EXAMPLES, deadline=FUZZ_DEADLINE, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            case.call_and_validate(checks=checks)

        call()


# Any JSON value, strings with any code point (lone surrogates and controls included).
ANY_TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=20,
)
HUGE_INTEGERS = st.integers(min_value=-2, max_value=10**700)  # past 4,300 digits in products
PARAMETERS = st.fixed_dictionaries({}, optional={
    "beam_size": st.integers(-1, 10) | JSON_VALUES,
    "max_new_tokens": st.integers(-1, 5000) | JSON_VALUES,
    "binary_data_output": st.booleans() | JSON_VALUES}) | st.dictionaries(ANY_TEXT, JSON_VALUES)


@st.composite
def infer_documents(draw: Any) -> Any:
    """A well-formed infer body of any texts (flat, as a column, with more dimensions of
    size 1), often with one part replaced by something else: any JSON, huge dimensions."""
    texts = draw(st.lists(ANY_TEXT, min_size=1, max_size=3))
    shape: list[Any] = [len(texts)]
    data: Any = texts
    if draw(st.booleans()):  # a column
        shape, data = [len(texts), 1], [[text] for text in texts]
    for _ in range(draw(st.integers(0, 10))):  # more dimensions of size 1
        shape, data = [1, *shape], [data]
    tensor: dict[str, Any] = {"name": "text", "shape": shape, "datatype": "BYTES", "data": data}
    document: dict[str, Any] = {"inputs": [tensor]}
    if draw(st.booleans()):
        document["id"] = draw(ANY_TEXT)
    if draw(st.booleans()):
        document["parameters"] = draw(PARAMETERS)
    if draw(st.booleans()):
        document["outputs"] = draw(st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["output", "finish_reason"]) | ANY_TEXT},
            optional={"parameters": JSON_VALUES}), max_size=3))
    part = draw(st.sampled_from(["none", "name", "shape", "datatype", "data", "dimension",
                                 "id", "outputs", "inputs", "document"]))
    if part == "dimension":
        tensor["shape"] = draw(st.lists(HUGE_INTEGERS, min_size=1, max_size=9))
    elif part in ("name", "shape", "datatype", "data"):
        tensor[part] = draw(JSON_VALUES)
    elif part in ("id", "outputs", "inputs"):
        document[part] = draw(JSON_VALUES)
    elif part == "document":
        return draw(JSON_VALUES)
    return document


@given(document=infer_documents(), binary=st.binary(max_size=40),
       header_length=st.none() | st.integers(-5, 2000).map(str) | ANY_TEXT)
@settings(max_examples=400, deadline=FUZZ_DEADLINE, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_v2_bodies_parse_or_raise_invalid_input(
    document: Any, binary: bytes, header_length: str | None
) -> None:
    """KServe v2 parsing of any JSON (and any binary part): an `Inference` whose texts are
    clean and fill their shape, or `InvalidInput` with a short message -- never another error;
    the response to a parsed request serialises."""
    from service.api import open_inference
    from service.api.schemas import clean_text
    from service.core.errors import InvalidInput

    header = json.dumps(document).encode()
    body = header + binary if header_length is not None else header
    try:
        parsed = open_inference.parse_request(body, header_length)
    except InvalidInput as error:
        assert len(error.message) < 1000
        return
    assert all(clean_text(text) == text and text.strip() for text in parsed.texts)
    assert len(parsed.texts) == math.prod(parsed.shape)
    open_inference.response_body("m", parsed, {"output": parsed.texts,
                                       "finish_reason": ["eos"] * len(parsed.texts)})
