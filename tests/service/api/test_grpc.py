"""KServe v2 over gRPC (`grpc_port`): the messages against the stock client's, the stock
`tritonclient[grpc]` client against a real server (the tiny model on onnxruntime) giving the REST
route's outputs; the errors, metadata, auth, overload, deadlines and cancellation of a call
(fake models, a raw gRPC channel); and fuzzed messages, which parse or are refused as bad input."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as stock
from tritonclient.utils import InferenceServerException

from service.api import grpc_inference, open_inference
from service.api import grpc_messages as pb
from service.api.app import create_app
from service.core.errors import InvalidInput
from service.observability import metrics
from tests.service.conftest import AppFactory, serving, tiny_settings
from tests.service.fakes import FakeModel
from tests.service.live_server import serve, wait_until_ready

MODEL = "tiny-reverse"
TEXTS = ["abc de", "kol", "a b c", "mn o"]
INFER = f"/{pb.SERVICE}/ModelInfer"


def _fields(message: Any) -> list[tuple[Any, ...]]:
    return sorted((f.name, f.number, f.type, f.is_repeated,
                   f.message_type.full_name if f.message_type else "",
                   f.containing_oneof.name if f.containing_oneof else "") for f in message.fields)


def test_the_messages_are_the_stock_clients() -> None:
    """Every message and method here has the names, numbers and types of tritonclient's
    generated `inference` package: the two sides read each other's bytes."""

    def same(ours: Any, theirs: Any) -> None:
        assert _fields(ours) == _fields(theirs), ours.full_name
        assert {n.name for n in ours.nested_types} <= {n.name for n in theirs.nested_types}
        for nested in ours.nested_types:
            same(nested, theirs.nested_types_by_name[nested.name])

    for message in pb.FILE.message_types_by_name.values():
        same(message, stock.DESCRIPTOR.message_types_by_name[message.name])
    theirs = stock.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in pb.FILE.services_by_name["GRPCInferenceService"].methods:
        stock_method = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == \
            (stock_method.input_type.full_name, stock_method.output_type.full_name)
    request = pb.ModelInferRequest(model_name="m", id="i", raw_input_contents=[b"\x01"])
    request.parameters["beam_size"].int64_param = 3
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    assert stock.ModelInferRequest.FromString(request.SerializeToString()).parameters[
        "beam_size"].int64_param == 3


# ------------------------------------------------------------ the tiny model, tritonclient[grpc]


@pytest.fixture(scope="module")
def tiny_server(served_tiny_models: Path) -> Iterator[tuple[str, int]]:
    """The tiny model served over HTTP and gRPC: (HTTP URL, gRPC port)."""
    app = create_app(tiny_settings(served_tiny_models, max_wait_ms=20, grpc_port=0))
    with serve(app) as url:
        wait_until_ready(url)
        yield url, app.state.grpc_port


@pytest.fixture
def triton(tiny_server: tuple[str, int]) -> Iterator[Any]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{tiny_server[1]}")
    yield client
    client.close()


def texts_input(texts: list[str] = TEXTS) -> Any:
    tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def v1_outputs(url: str, **options: Any) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        response = client.post("/v1/translate", json={"texts": TEXTS, **options})
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def as_texts(array: np.ndarray) -> list[str]:
    return [t.decode() for t in array.tolist()]


def test_health_and_metadata(triton: Any) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready(MODEL) and triton.is_model_ready(MODEL, "1")
    assert not triton.is_model_ready("no-such-model") and not triton.is_model_ready(MODEL, "7")
    assert triton.get_server_metadata().name == "attnserve"
    metadata = triton.get_model_metadata(MODEL, as_json=True)
    assert metadata["name"] == MODEL and metadata["platform"] == "attnserve"
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    assert [(o["name"], o["datatype"]) for o in metadata["outputs"]] == \
        [("output", "BYTES"), ("finish_reason", "BYTES"), ("score", "FP32")]
    with pytest.raises(InferenceServerException, match="no model 'nope'") as caught:
        triton.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_infer_equals_the_rest_route(triton: Any, tiny_server: tuple[str, int]) -> None:
    result = triton.infer(MODEL, [texts_input()], request_id="r1")
    expected = v1_outputs(tiny_server[0])
    assert as_texts(result.as_numpy("output")) == [o["text"] for o in expected]
    assert as_texts(result.as_numpy("output"))[0].strip() == "ed cba"  # the model reverses
    assert as_texts(result.as_numpy("finish_reason")) == [o["finish_reason"] for o in expected]
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (MODEL, "1", "r1")
    assert [o.name for o in response.outputs] == ["output", "finish_reason"]
    assert [list(o.shape) for o in response.outputs] == [[4], [4]]


def test_infer_parameters_scores_prefix_and_named_outputs(triton: Any,
                                                         tiny_server: tuple[str, int]) -> None:
    short = triton.infer(MODEL, [texts_input()], parameters={"beam_size": 3, "max_new_tokens": 2})
    expected = v1_outputs(tiny_server[0], beam_size=3, max_new_tokens=2)
    assert as_texts(short.as_numpy("output")) == [o["text"] for o in expected]
    assert set(as_texts(short.as_numpy("finish_reason"))) == {"length"}
    scored = triton.infer(MODEL, [texts_input()],
                          parameters={"beam_size": 2, "return_scores": True, "target_prefix": "a"})
    expected = v1_outputs(tiny_server[0], beam_size=2, return_scores=True, target_prefix="a")
    assert as_texts(scored.as_numpy("output")) == [o["text"] for o in expected]
    scores = scored.as_numpy("score")
    assert scores.dtype == np.float32 and scores.shape == (len(TEXTS),)
    assert scores.tolist() == pytest.approx([o["score"] for o in expected], abs=1e-5)
    named = triton.infer(MODEL, [texts_input()], outputs=[grpcclient.InferRequestedOutput("score")])
    assert [o.name for o in named.get_response().outputs] == ["score"]


def test_infer_samples_with_the_rest_routes_draws(triton: Any, tiny_server: tuple[str, int]) -> None:
    sampled = {"temperature": 4.0, "top_p": 0.95, "seed": 12}  # double, double and int64 parameters
    result = triton.infer(MODEL, [texts_input()], parameters=sampled)
    assert as_texts(result.as_numpy("output")) == [o["text"] for o in v1_outputs(tiny_server[0], **sampled)]


def test_infer_errors_through_the_client(triton: Any) -> None:
    def code(**call: Any) -> tuple[str, str]:
        with pytest.raises(InferenceServerException) as caught:
            triton.infer(**{"model_name": MODEL, "inputs": [texts_input()], **call})
        return caught.value.status(), caught.value.message()

    status, message = code(inputs=[texts_input(["abcdefghijklmno abc"])])
    assert status == "StatusCode.INVALID_ARGUMENT" and "at most 15 allowed" in message
    status, message = code(parameters={"beam_size": 99})
    assert status == "StatusCode.INVALID_ARGUMENT" and "beam_size" in message
    status, message = code(parameters={"temperature": 1.0, "beam_size": 2})
    assert status == "StatusCode.INVALID_ARGUMENT" and "temperature" in message
    status, message = code(outputs=[grpcclient.InferRequestedOutput("logits")])
    assert status == "StatusCode.INVALID_ARGUMENT" and "unknown output" in message
    fp32 = grpcclient.InferInput("text", [1], "FP32")
    fp32.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    status, message = code(inputs=[fp32])
    assert status == "StatusCode.INVALID_ARGUMENT" and "BYTES" in message
    status, message = code(model_name="nope")
    assert status == "StatusCode.NOT_FOUND" and "no model 'nope'" in message
    status, message = code(model_version="7")
    assert status == "StatusCode.NOT_FOUND"


# ------------------------------------------------------------ fake models, a raw channel


@asynccontextmanager
async def channel(app: Any) -> AsyncIterator[Any]:
    """The app running (its lifespan serves gRPC on a free port) and a channel to it, connected
    (the tests that time their calls need the connection made first)."""
    async with serving(app), grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as chan:
        await method(chan, "ServerLive")(pb.ServerLiveRequest())
        yield chan


def method(chan: Any, name: str) -> Any:
    request, response = pb.METHODS[name]
    return chan.unary_unary(f"/{pb.SERVICE}/{name}",
                            request_serializer=pb.message_class(request).SerializeToString,
                            response_deserializer=pb.message_class(response).FromString)


def infer_request(texts: list[str], model: str = "translate-en-it", raw: bool = True,
                  **parameters: Any) -> Any:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    if raw:
        request.raw_input_contents.append(open_inference.serialize_bytes(texts))
    else:
        tensor.contents.bytes_contents.extend(t.encode() for t in texts)
    for name, value in parameters.items():
        kind = {bool: "bool_param", int: "int64_param", str: "string_param"}[type(value)]
        setattr(request.parameters[name], kind, value)
    return request


def requests_counted(model: str, status: str) -> float:
    return metrics.REQUESTS_TOTAL.labels(INFER, model, status)._value.get()


@pytest.mark.anyio
async def test_a_raw_call_ids_times_counts_and_logs(make_app: AppFactory,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    before = requests_counted("translate-en-it", "2xx")
    caplog.set_level(logging.INFO, logger="attnserve.access")
    async with channel(make_app(grpc_port=0)) as chan:
        infer = method(chan, "ModelInfer")
        call = infer(infer_request(["abc", "de"], raw=False, max_new_tokens=8),
                     metadata=(("x-request-id", "my-call-7"),))
        response = await call
        initial, trailing = await call.initial_metadata(), await call.trailing_metadata()
        fresh = infer(infer_request(["abc"]))
        await fresh
        fresh_id = dict(await fresh.initial_metadata())["x-request-id"]
    assert [o.name for o in response.outputs] == ["output", "finish_reason"]
    texts = [e.decode() for e in open_inference.deserialize_bytes(response.raw_output_contents[0])]
    assert texts == ["cba", "ed"]
    assert dict(initial)["x-request-id"] == "my-call-7"
    assert len(fresh_id) == 32 and fresh_id != "my-call-7"
    stages = [part.split(";")[0].strip() for part in dict(trailing)["server-timing"].split(",")]
    assert stages[0] == "prepare" and "inference" in stages and stages[-1] == "total"
    assert requests_counted("translate-en-it", "2xx") == before + 2
    lines = [r for r in caplog.records if r.name == "attnserve.access" and r.path == INFER]
    assert [(r.request_id, r.status, r.model) for r in lines][:1] == \
        [("my-call-7", 200, "translate-en-it")]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (infer_request(["abc"], model="nope"), "NOT_FOUND", "no model 'nope'"),
        (infer_request([""]), "INVALID_ARGUMENT", "empty"),
        (infer_request(["a"] * 17), "INVALID_ARGUMENT", "at most 16"),
        (infer_request(["abc"], beam_size="2"), "INVALID_ARGUMENT", "beam_size"),
        (pb.ModelInferRequest(model_name="translate-en-it"), "INVALID_ARGUMENT", "inputs"),
    ],
)
async def test_bad_calls_get_their_code_and_message(make_app: AppFactory, request_: Any,
                                                    code: str, message: str) -> None:
    async with channel(make_app(grpc_port=0)) as chan:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await method(chan, "ModelInfer")(request_)
    assert caught.value.code().name == code and message in caught.value.details()


@pytest.mark.anyio
async def test_malformed_tensors_are_refused(make_app: AppFactory) -> None:
    not_utf8 = infer_request(["abc"], raw=False)
    not_utf8.inputs[0].contents.bytes_contents[0] = b"\xff\xfe"
    both = infer_request(["abc"])
    both.inputs[0].contents.bytes_contents.append(b"abc")
    two_raw = infer_request(["abc"])
    two_raw.raw_input_contents.append(b"")
    truncated = infer_request(["abc"])
    truncated.raw_input_contents[0] = truncated.raw_input_contents[0][:-1]
    async with channel(make_app(grpc_port=0)) as chan:
        infer = method(chan, "ModelInfer")
        details = []
        for request in (not_utf8, both, two_raw, truncated):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await infer(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details.append(caught.value.details())
    assert "not UTF-8" in details[0] and "not both" in details[1]
    assert "one per input" in details[2] and "truncated" in details[3]


@pytest.mark.anyio
async def test_a_message_over_the_body_limit_is_refused(make_app: AppFactory) -> None:
    async with channel(make_app(grpc_port=0, max_body_bytes=4096)) as chan:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await method(chan, "ModelInfer")(infer_request(["ab " * 2000]))
        ok = await method(chan, "ModelInfer")(infer_request(["abc"]))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ok.model_name == "translate-en-it"


@pytest.mark.anyio
async def test_the_api_key_is_needed_for_infer_and_metadata(make_app: AppFactory) -> None:
    async with channel(make_app(grpc_port=0, api_key="s3cret")) as chan:
        infer, metadata = method(chan, "ModelInfer"), method(chan, "ModelMetadata")
        refused = []
        for call in (infer(infer_request(["abc"])),
                     infer(infer_request(["abc"]), metadata=(("authorization", "Bearer nope"),)),
                     metadata(pb.ModelMetadataRequest(name="translate-en-it"))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            refused.append(caught.value.code())
        key = (("authorization", "Bearer s3cret"),)
        answered = await infer(infer_request(["abc"]), metadata=key)
        described = await metadata(pb.ModelMetadataRequest(name="translate-en-it"), metadata=key)
        live = await method(chan, "ServerLive")(pb.ServerLiveRequest())  # probes stay open
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert answered.outputs and described.name == "translate-en-it" and live.live


@pytest.mark.anyio
async def test_not_ready_then_ready(make_app: AppFactory) -> None:
    from tests.service.fakes import FakeLoader

    loader = FakeLoader()
    loader.release.clear()  # models stay loading
    app = make_app(loader=loader, grpc_port=0)
    async with serving(app, wait_ready=False), \
            grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as chan:
        ready = await method(chan, "ServerReady")(pb.ServerReadyRequest())
        model = await method(chan, "ModelReady")(pb.ModelReadyRequest(name="translate-en-it"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await method(chan, "ModelInfer")(infer_request(["abc"]))
        loader.release.set()
        while not (await method(chan, "ServerReady")(pb.ServerReadyRequest())).ready:
            await asyncio.sleep(0.01)
        after = await method(chan, "ModelReady")(pb.ModelReadyRequest(name="translate-en-it"))
    assert not ready.ready and not model.ready and after.ready
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.anyio
async def test_grpc_health_checks_follow_readiness(make_app: AppFactory) -> None:
    """gRPC's health checking protocol, spoken here in its wire format (the request's field 1:
    the service's name; the response's field 1: its status, 1 SERVING, 2 NOT_SERVING), as
    Kubernetes' gRPC probes send it: NOT_SERVING while loading and draining."""
    from tests.service.fakes import FakeLoader

    def service(name: bytes) -> bytes:
        return b"\x0a" + bytes([len(name)]) + name

    loader = FakeLoader()
    loader.release.clear()  # models stay loading
    app = make_app(loader=loader, grpc_port=0)
    async with serving(app, wait_ready=False), \
            grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as chan:
        check = chan.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda raw: raw,
                                 response_deserializer=lambda raw: raw)
        loading = await check(b"")  # the server as a whole: the empty name
        loader.release.set()
        while await check(b"") != b"\x08\x01":
            await asyncio.sleep(0.01)
        named = await check(service(b"inference.GRPCInferenceService"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(service(b"other.Service"))
        app.state.registry.begin_draining()
        draining = await check(b"")
    assert loading == b"\x08\x02" and named == b"\x08\x01" and draining == b"\x08\x02"
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.anyio
async def test_a_health_watch_follows_readiness_and_ends_with_the_drain(make_app: AppFactory) -> None:
    """`Watch`: NOT_SERVING while loading, SERVING once ready, NOT_SERVING when draining, then
    the call ends; an unknown service gets SERVICE_UNKNOWN (3), its call left open."""
    from tests.service.fakes import FakeLoader

    loader = FakeLoader()
    loader.release.clear()  # models stay loading
    app = make_app(loader=loader, grpc_port=0)
    async with serving(app, wait_ready=False), \
            grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as chan:
        watch = chan.unary_stream("/grpc.health.v1.Health/Watch",
                                  request_serializer=pb.HealthCheckRequest.SerializeToString,
                                  response_deserializer=pb.HealthCheckResponse.FromString)
        server = watch(pb.HealthCheckRequest())
        unknown = watch(pb.HealthCheckRequest(service="other.Service"))
        statuses = [(await server.read()).status]
        loader.release.set()
        statuses.append((await server.read()).status)
        app.state.registry.begin_draining()
        statuses.append((await server.read()).status)
        ended = await server.read()
        first_unknown = (await unknown.read()).status
        unknown.cancel()
    assert [pb.SERVING_STATUSES[s] for s in statuses] == ["NOT_SERVING", "SERVING", "NOT_SERVING"]
    assert ended is grpc.aio.EOF and await server.code() == grpc.StatusCode.OK
    assert pb.SERVING_STATUSES[first_unknown] == "SERVICE_UNKNOWN"


@pytest.mark.anyio
async def test_a_full_queue_is_resource_exhausted_with_retry_after(
    make_app: AppFactory, fake_model: FakeModel
) -> None:
    fake_model.delay_s = 0.3
    async with channel(make_app(grpc_port=0, max_queue_size=2, max_texts=2, max_batch_size=1)) as chan:
        infer = method(chan, "ModelInfer")
        first = asyncio.ensure_future(infer(infer_request(["ab"])))  # decoding
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(infer(infer_request(["cd"])))  # one row waiting
        await asyncio.sleep(0.05)
        refused = infer(infer_request(["ef", "gh"]))  # two more: over the two allowed
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await refused
        await asyncio.gather(first, second)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "full" in caught.value.details()
    assert dict(caught.value.trailing_metadata())["retry-after"] == "1"


def rejected(model: str, reason: str) -> float:
    return metrics.REJECTED_TOTAL.labels(model, reason)._value.get()


@pytest.mark.anyio
async def test_the_clients_deadline_is_the_requests(make_app: AppFactory,
                                                    fake_model: FakeModel) -> None:
    fake_model.delay_s = 0.5  # the batch in front
    before = rejected("translate-en-it", "deadline")
    async with channel(make_app(grpc_port=0, max_batch_size=1)) as chan:
        infer = method(chan, "ModelInfer")
        first = asyncio.ensure_future(infer(infer_request(["ab"])))
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(infer_request(["cd"]), timeout=0.2)
        await first
        await asyncio.sleep(0.6)  # the next batch would have been the late call's
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cd" not in fake_model.seen  # its row never ran
    assert rejected("translate-en-it", "deadline") >= before + 1


@pytest.mark.anyio
async def test_a_cancelled_call_leaves_the_queue(make_app: AppFactory,
                                                 fake_model: FakeModel) -> None:
    fake_model.delay_s = 0.4
    before = rejected("translate-en-it", "disconnected")
    async with channel(make_app(grpc_port=0, max_batch_size=1)) as chan:
        infer = method(chan, "ModelInfer")
        first = asyncio.ensure_future(infer(infer_request(["ab"])))
        await asyncio.sleep(0.05)
        second = infer(infer_request(["cd"]))
        await asyncio.sleep(0.1)
        second.cancel()
        await first
        await asyncio.sleep(0.5)
    assert "ab" in fake_model.seen and "cd" not in fake_model.seen  # "cd" left the queue first
    assert rejected("translate-en-it", "disconnected") == before + 1


def stream_answers(client: Any, sends: list[dict[str, Any]], finals: int) -> list[tuple[Any, Any]]:
    """tritonclient's stream: each of `sends` (`async_stream_infer`'s arguments) sent, then the
    (result, error) of every answer until `finals` requests had their last."""
    import queue

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for send in sends:
        client.async_stream_infer(**send)
    got: list[tuple[Any, Any]] = []
    while finals:
        result, error = answers.get(timeout=30)
        got.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            finals -= 1
    client.stop_stream()
    return got


def test_a_stream_answers_token_by_token_or_whole(triton: Any, tiny_server: tuple[str, int]) -> None:
    expected = v1_outputs(tiny_server[0])
    got = stream_answers(triton, [
        {"model_name": MODEL, "inputs": [texts_input([TEXTS[0]])], "request_id": "tokens",
         "parameters": {"stream": True}},
        {"model_name": MODEL, "inputs": [texts_input()], "request_id": "whole", "enable_empty_final_response": True},
        {"model_name": "nope", "inputs": [texts_input()], "request_id": "unknown"},
        {"model_name": MODEL, "inputs": [texts_input(TEXTS[:2])], "request_id": "two", "parameters": {"stream": True}},
    ], finals=4)
    errors = sorted(str(error.message()) for _, error in got if error is not None)
    assert errors == ["no model 'nope' on this server", "parameters.stream: one text per streamed request"]
    answered = [result.get_response() for result, error in got if error is None]
    tokens = [r for r in answered if r.id == "tokens"]
    assert len(tokens) > 2 and [r.parameters["triton_final_response"].bool_param for r in tokens] == \
        [False] * (len(tokens) - 1) + [True]
    deltas = [as_texts_of(r, "output")[0] for r in tokens]
    assert "".join(deltas) == expected[0]["text"] and all(deltas[:-1])
    assert as_texts_of(tokens[-1], "finish_reason") == [expected[0]["finish_reason"]]
    [whole] = [r for r in answered if r.id == "whole"]
    assert as_texts_of(whole, "output") == [o["text"] for o in expected]
    assert as_texts_of(whole, "finish_reason") == [o["finish_reason"] for o in expected]


def as_texts_of(response: Any, name: str) -> list[str]:
    """The BYTES output `name` of a `ModelInferResponse` (raw contents)."""
    index = [tensor.name for tensor in response.outputs].index(name)
    raw, texts = response.raw_output_contents[index], []
    while raw:
        length = int.from_bytes(raw[:4], "little")
        texts.append(raw[4:4 + length].decode())
        raw = raw[4 + length:]
    return texts


async def requests_of(requests: list[Any], keep_open: bool = False) -> Any:
    """A stream's requests, then (`keep_open`) no end: the client ends the call itself."""
    for request in requests:
        yield request
    if keep_open:
        await asyncio.Event().wait()


@pytest.mark.anyio
async def test_a_stream_the_client_ends_frees_its_rows(make_app: AppFactory, fake_model: FakeModel) -> None:
    """A queued request and a streamed one leave the queue when the client cancels the call
    (their tasks outlive the call, and touch nothing of it)."""
    fake_model.delay_s = 0.4
    before = rejected("translate-en-it", "disconnected")
    async with channel(make_app(grpc_port=0, max_batch_size=1)) as chan:
        first = asyncio.ensure_future(method(chan, "ModelInfer")(infer_request(["ab"])))
        await asyncio.sleep(0.05)
        stream = chan.stream_stream(f"/{pb.SERVICE}/ModelStreamInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelStreamInferResponse.FromString)
        call = stream(requests_of([infer_request(["cd"]), infer_request(["ef"], stream=True)], keep_open=True))
        await asyncio.sleep(0.1)
        call.cancel()
        await first
        await asyncio.sleep(0.5)
    assert "ab" in fake_model.seen and "cd" not in fake_model.seen and "ef" not in fake_model.seen
    assert rejected("translate-en-it", "disconnected") == before + 2


@pytest.mark.anyio
async def test_a_stream_needs_the_key(make_app: AppFactory) -> None:
    async with channel(make_app(grpc_port=0, api_key="s3cret")) as chan:
        stream = chan.stream_stream(f"/{pb.SERVICE}/ModelStreamInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelStreamInferResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as keyless:
            [answer async for answer in stream(requests_of([infer_request(["ab"])]))]
        keyed = [answer async for answer in stream(requests_of([infer_request(["ab"])]),
                                                  metadata=(("authorization", "Bearer s3cret"),))]
    assert keyless.value.code() == grpc.StatusCode.UNAUTHENTICATED
    [answer] = keyed
    assert not answer.error_message and answer.infer_response.parameters["triton_final_response"].bool_param


def test_serve_without_the_extra_refuses_a_grpc_port_in_one_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from attnserve import cli
    from service.process import commands

    monkeypatch.setattr(commands, "_grpc_available", lambda: False)
    assert cli.main(["serve", "--grpc-port", "8001", "--port", "1"]) == 2
    assert "--grpc-port needs the grpc extra: pip install 'attnserve[grpc]'" in caplog.text


def test_the_grpc_port_differs_from_the_http_ports() -> None:
    from pydantic import ValidationError

    from service.core.settings import Settings

    with pytest.raises(ValidationError, match="grpc_port must differ"):
        Settings(port=8000, grpc_port=8000)
    with pytest.raises(ValidationError, match="grpc_port must differ"):
        Settings(metrics_port=9000, grpc_port=9000)
    assert Settings(grpc_port=0).grpc_port == 0  # any free port (tests)


# ------------------------------------------------------------ fuzzed messages

TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
PARAMETER_VALUES = st.sampled_from(["bool_param", "int64_param", "string_param", "double_param",
                                    "uint64_param", None])


@st.composite
def infer_messages(draw: Any) -> Any:
    """A ModelInferRequest of any fields: well-formed texts (raw or as contents) or any bytes,
    any names, datatypes, shapes (negative and huge dimensions), parameters and outputs."""
    request = pb.ModelInferRequest(model_name=draw(TEXT), id=draw(TEXT))
    for name in draw(st.lists(st.sampled_from(["beam_size", "max_new_tokens", "return_scores",
                                               "target_prefix", "truncate"]) | TEXT, max_size=3)):
        kind = draw(PARAMETER_VALUES)
        value = {"bool_param": st.booleans(), "int64_param": st.integers(-2**63, 2**63 - 1),
                 "string_param": TEXT, "double_param": st.floats(allow_nan=True),
                 "uint64_param": st.integers(0, 2**64 - 1), None: st.none()}[kind]
        parameter = request.parameters[name]
        if kind is not None:
            setattr(parameter, kind, draw(value))
    for _ in range(draw(st.integers(0, 2))):
        texts = draw(st.lists(TEXT, max_size=3))
        tensor = request.inputs.add(
            name=draw(st.just("text") | TEXT), datatype=draw(st.sampled_from(["BYTES", "FP32"]) | TEXT),
            shape=draw(st.just([len(texts)]) | st.lists(st.integers(-2**63, 2**63 - 1), max_size=9)))
        form = draw(st.sampled_from(["raw", "contents", "floats", "garbage", "none"]))
        if form == "raw":
            request.raw_input_contents.append(open_inference.serialize_bytes(texts))
        elif form == "garbage":
            request.raw_input_contents.append(draw(st.binary(max_size=24)))
        elif form == "contents":
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=3))
                                                  if draw(st.booleans()) else [t.encode() for t in texts])
        elif form == "floats":
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=3)))
    for name in draw(st.lists(st.sampled_from(["output", "finish_reason", "score"]) | TEXT, max_size=3)):
        request.outputs.add(name=name)
    return request


@given(request=infer_messages())
@settings(max_examples=400, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_infer_messages_parse_or_raise_invalid_input(request: Any) -> None:
    """Any ModelInferRequest: an `Inference` whose texts fill its shape, or `InvalidInput`,
    never another error."""
    try:
        parsed = open_inference.parse_document(*grpc_inference._document(request))
    except InvalidInput as error:
        assert error.message and len(error.message) < 2000
        return
    assert len(parsed.texts) == int(np.prod(parsed.shape)) and all(t.strip() for t in parsed.texts)


@pytest.mark.anyio
async def test_bytes_that_are_no_message_are_invalid_argument(make_app: AppFactory) -> None:
    async with channel(make_app(grpc_port=0)) as chan:
        codes = []
        for raw in (b"\xff\xff\xff", b"\x0a\xff", b"\x2a\x05\x0a\x01"):  # bad tag, bad length, short
            call = chan.unary_unary(INFER, request_serializer=lambda data: data,
                                    response_deserializer=pb.ModelInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(raw)
            codes.append((caught.value.code(), caught.value.details()))
        after = await method(chan, "ModelInfer")(infer_request(["abc"]))
    assert {code for code, _ in codes} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert all("not a ModelInferRequest message" in details for _, details in codes)
    assert after.outputs
