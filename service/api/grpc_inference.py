"""KServe v2 / the Open Inference Protocol over gRPC (`grpc_port`, the `grpc` extra): what
`tritonclient[grpc]` speaks, served beside the REST routes (`service.api.routes.kserve`) by the
same process, on the same event loop, models and batchers.

The service `inference.GRPCInferenceService` answers its core methods: `ServerLive`,
`ServerReady`, `ModelReady` (false for an unknown model, as a probe expects), `ServerMetadata`,
`ModelMetadata` and `ModelInfer`, the model repository's `RepositoryIndex`,
`RepositoryModelLoad` and `RepositoryModelUnload` (as the REST routes: `model_control`, the key),
and Triton's streaming `ModelStreamInfer` (token by token with the request parameter `stream`:
`InferenceService.model_stream_infer`); Triton's other additions (shared memory, statistics)
answer UNIMPLEMENTED. gRPC's health checking protocol answers too
(`grpc.health.v1.Health`: `Check`, for Kubernetes' gRPC probes and load balancers, and `Watch`,
for gRPC clients' own health checking): SERVING while the server is ready. The messages:
`service.api.grpc_messages`.

`ModelInfer` is the REST infer route's work (`service.api.open_inference`): the BYTES input
`text` from `raw_input_contents` (each element a 4-byte little-endian length, then its bytes,
as tritonclient sends it) or `contents.bytes_contents`, the same request parameters and
outputs, and the same checks and messages; outputs come back in `raw_output_contents`, as
Triton sends them. The client's gRPC deadline is the request's (at most `request_timeout_s`),
and a call the client cancels, or whose deadline passes, has its rows dropped from the batch.

Every call, as every HTTP request: its id from the `x-request-id` metadata (else a new one) in
the initial metadata of the answer and on the records logged meanwhile, one access line, and
`requests_total` / `request_duration_seconds` with the method's path (`/inference.
GRPCInferenceService/ModelInfer`) as the route and the status the REST route would answer
(400 for bad input). A successful infer's stages go in the trailing metadata `server-timing`; with tracing on
(`otlp_endpoint`) each call has a server span and an infer its stages' spans
(`service.observability.tracing.CallTracer`).
With `api_key`, `ModelInfer` (and `ModelMetadata`, unless `public_metadata`) need the metadata
`authorization: Bearer <key>`. Errors carry the service's message and the gRPC code of its
kind (`CODES`): bad input INVALID_ARGUMENT, unknown model NOT_FOUND, model control off
PERMISSION_DENIED, a full queue
RESOURCE_EXHAUSTED (with a `retry-after` trailer, seconds), not ready UNAVAILABLE, past the
deadline DEADLINE_EXCEEDED, anything unexpected INTERNAL with a fixed message (the trace goes
to the log). Messages over `max_body_bytes` are refused by gRPC itself (RESOURCE_EXHAUSTED),
and calls beyond `max_connections` at once too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.api import grpc_messages as pb
from service.api import open_inference, streaming
from service.api.auth import check_api_key
from service.api.deadline import within_budget
from service.api.errors import protocol_status, protocol_status_of
from service.api.request_id import CLIENT_GONE, id_from, log_access
from service.core.errors import InvalidInput, ModelNotFound, Overloaded, ServiceError, shorten
from service.core.registry import ModelRegistry
from service.core.settings import Settings
from service.observability import logs, metrics
from service.observability.timing import RequestTiming
from service.observability.tracing import CallTracer

logger = logging.getLogger(__name__)

ID_KEY = "x-request-id"
WATCH_INTERVAL_S = 0.1  # how often a health `Watch` looks at readiness
STREAM_PARAMETER = "stream"  # a ModelStreamInfer request's: answer token by token
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"  # tritonclient's; the last response is marked anyway
FINAL_PARAMETER = "triton_final_response"  # on a request's last response
TIMING_KEY = "server-timing"
RETRY_KEY = "retry-after"

# The gRPC code of each status the REST routes answer.
CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass
class Call:
    """What a handler learns about its call for the access line, the metrics and the trace."""

    metadata: dict[str, Any]
    model: str = ""
    timing: RequestTiming | None = None  # an infer's stages


Handler = Callable[[Any, grpc.aio.ServicerContext, Call], Awaitable[Any]]


class InferenceService:
    """The handlers of `GRPCInferenceService`'s core methods over the app's models."""

    def __init__(self, registry: ModelRegistry, settings: Settings,
                 tracer: CallTracer | None = None) -> None:
        self.registry = registry
        self.settings = settings
        self.tracer = tracer

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods for `grpc.aio.Server.add_generic_rpc_handlers`."""
        handlers: dict[str, Handler] = {
            "ServerLive": self.server_live, "ServerReady": self.server_ready,
            "ModelReady": self.model_ready, "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata, "ModelInfer": self.model_infer,
            "RepositoryIndex": self.repository_index, "RepositoryModelLoad": self.repository_load,
            "RepositoryModelUnload": self.repository_unload,
        }
        methods = {  # requests arrive as bytes: `_call` parses them (bad bytes: INVALID_ARGUMENT)
            name: grpc.unary_unary_rpc_method_handler(
                self._call(f"/{pb.SERVICE}/{name}", pb.message_class(request), handlers[name]),
                response_serializer=pb.message_class(response).SerializeToString)
            for name, (request, response) in pb.METHODS.items()
        }
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer, response_serializer=pb.ModelStreamInferResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(pb.SERVICE, methods)

    def health_handler(self) -> grpc.GenericRpcHandler:
        """gRPC's health checking service (`grpc.health.v1.Health`: `Check` and `Watch`)."""
        check = grpc.unary_unary_rpc_method_handler(
            self._call(pb.HEALTH_PATH, pb.HealthCheckRequest, self.health_check),
            response_serializer=pb.HealthCheckResponse.SerializeToString)
        watch = grpc.unary_stream_rpc_method_handler(
            self.health_watch, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(pb.HEALTH_SERVICE, {"Check": check, "Watch": watch})

    async def health_watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """`Watch`, what gRPC clients' own health checking calls: the status `Check` gives now,
        then each change of it (looked at every `WATCH_INTERVAL_S`). Once the server drains
        it sends NOT_SERVING and ends the call, so that a shutdown does not wait for it. An
        unknown service gets SERVICE_UNKNOWN and the call stays open, as the protocol asks."""
        if request.service not in ("", pb.SERVICE):
            yield pb.HealthCheckResponse(status=pb.SERVING_STATUSES.index("SERVICE_UNKNOWN"))
            while not self.registry.draining:
                await asyncio.sleep(WATCH_INTERVAL_S)
            return
        sent = None
        while True:
            status = "SERVING" if self.registry.ready else "NOT_SERVING"
            if status != sent:
                yield pb.HealthCheckResponse(status=pb.SERVING_STATUSES.index(status))
                sent = status
            if self.registry.draining:
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def health_check(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        """SERVING while the server is ready (`/health/ready`), NOT_SERVING while it loads or
        drains, for the server ("") and for `inference.GRPCInferenceService`; NOT_FOUND for
        another service, as the protocol asks."""
        if request.service not in ("", pb.SERVICE):
            raise ModelNotFound(f"no service {shorten(repr(request.service))} on this server")
        status = "SERVING" if self.registry.ready else "NOT_SERVING"
        return pb.HealthCheckResponse(status=pb.SERVING_STATUSES.index(status))

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        return pb.ServerReadyResponse(ready=self.registry.ready)

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        try:
            open_inference.known_model(self.registry, request.name, _version(request.version))
            self.registry.resolve(None, request.name)
        except ServiceError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext,
                              call: Call) -> Any:
        return pb.ServerMetadataResponse(name=open_inference.PLATFORM, version="0.1.0")

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext,
                             call: Call) -> Any:
        if not self.settings.public_metadata:
            check_api_key(call.metadata.get("authorization"), self.settings)
        entry = open_inference.known_model(self.registry, request.name, _version(request.version))
        metadata = open_inference.model_metadata(entry.name)
        response = pb.ModelMetadataResponse(name=metadata.name, versions=metadata.versions,
                                            platform=metadata.platform)
        for tensors, given in ((response.inputs, metadata.inputs), (response.outputs, metadata.outputs)):
            for tensor in given:
                tensors.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        return response

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        check_api_key(call.metadata.get("authorization"), self.settings)
        open_inference.known_model(self.registry, request.model_name, _version(request.model_version))
        entry = self.registry.resolve(None, request.model_name)
        call.model = entry.name
        inference = open_inference.parse_document(*_document(request))
        timing = call.timing = RequestTiming(time.perf_counter())
        budget_s = within_budget(context.time_remaining(), self.settings)
        values = await open_inference.generate(entry, inference, self.settings, timing, budget_s)
        context.set_trailing_metadata(((TIMING_KEY, timing.header(time.perf_counter())),))
        return _infer_response(entry.name, inference.id or "", {name: values[name] for name in inference.outputs},
                               inference.shape)

    async def repository_index(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        check_api_key(call.metadata.get("authorization"), self.settings)
        response = pb.RepositoryIndexResponse()
        for model in open_inference.repository_index(self.registry, request.ready):
            response.models.add(**model.model_dump())
        return response

    async def repository_load(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        check_api_key(call.metadata.get("authorization"), self.settings)
        open_inference.check_model_control(self.settings, _parameters(request.parameters), unload=False)
        await self.registry.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_unload(self, request: Any, context: grpc.aio.ServicerContext, call: Call) -> Any:
        check_api_key(call.metadata.get("authorization"), self.settings)
        open_inference.check_model_control(self.settings, _parameters(request.parameters), unload=True)
        await self.registry.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def _call(self, path: str, message: Any, handle: Handler) -> Callable[..., Awaitable[Any]]:
        """`handle` of the method at `path` (one of `pb.PATHS`) with the call's request parsed as
        a `message`, its id, access line, metrics and errors (module docstring)."""

        async def call_method(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            metadata = dict(context.invocation_metadata() or ())
            given = metadata.get(ID_KEY)
            identity = id_from(given.encode("ascii", "replace") if isinstance(given, str) else None)
            token = logs.REQUEST_ID.set(identity)
            call = Call(metadata)
            status = 200
            span = self.tracer.start(path, metadata) if self.tracer is not None else None
            try:
                await context.send_initial_metadata(((ID_KEY, identity),))
                try:
                    request = message.FromString(raw)
                except DecodeError:
                    raise InvalidInput(f"the request is not a {message.DESCRIPTOR.name} message") from None
                return await handle(request, context, call)
            except ServiceError as error:
                status = protocol_status(error)  # as the REST routes of the protocol
                trailer = ((RETRY_KEY, str(error.retry_after_s)),) if isinstance(error, Overloaded) else ()
                await context.abort(CODES.get(status, grpc.StatusCode.INTERNAL), error.message, trailer)
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                remaining = context.time_remaining()
                status = 504 if remaining is not None and remaining <= 0 else CLIENT_GONE
                if call.model:
                    metrics.REJECTED_TOTAL.labels(
                        call.model, "deadline" if status == 504 else "disconnected").inc()
                raise
            except Exception as error:
                logger.error("unhandled error on %s", path, exc_info=error)
                status = 500
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            finally:
                logs.REQUEST_ID.reset(token)
                if span is not None and self.tracer is not None:
                    code = grpc.StatusCode.OK if status == 200 else CODES.get(status, grpc.StatusCode.INTERNAL)
                    self.tracer.end(span, code, identity, call.model, call.timing)
                _record(path, context.peer(), status, started, identity, call.model)

        return call_method

    async def model_stream_infer(self, requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Triton's `ModelStreamInfer`: each request of the stream answered as it comes, the
        answers in the order they are ready (matched by their `id`). A request with the
        parameter `stream: true` (one text) is answered token by token: a response per token
        whose `output` is the text it adds, then a last one with the rest and `finish_reason`;
        another request gets one response, `ModelInfer`'s. Every last response of a request has
        the parameter `triton_final_response: true`. A request that fails gets a response with
        its `error_message` and the stream goes on; the stream's metadata is checked for the
        key first (UNAUTHENTICATED). Each request counts as a call of the method (its id, access
        line, metrics); when the client ends the call, every row of its requests leaves the batch."""
        path = f"/{pb.SERVICE}/ModelStreamInfer"
        metadata = dict(context.invocation_metadata() or ())
        try:
            check_api_key(metadata.get("authorization"), self.settings)
        except ServiceError as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, error.message)
        answers: asyncio.Queue[Any] = asyncio.Queue()
        working: set[asyncio.Task[None]] = set()
        # read once: the requests' tasks may outlive the call (its context is gone then)
        peer, remaining = context.peer(), context.time_remaining()
        ends = time.perf_counter() + remaining if remaining is not None else None

        async def read() -> None:
            async for raw in requests:
                task = asyncio.ensure_future(self._stream_one(raw, answers, path, peer, ends))
                working.add(task)
                task.add_done_callback(working.discard)
            while working:
                await asyncio.gather(*list(working), return_exceptions=True)
            answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await reader
        finally:
            for task in (reader, *working):
                task.cancel()

    async def _stream_one(self, raw: bytes, answers: asyncio.Queue[Any], path: str, peer: str | None,
                          ends: float | None) -> None:
        """One request of a `ModelStreamInfer` call (from `peer`, its deadline `ends`, the
        clock's): its responses put on `answers`."""
        started = time.perf_counter()
        status, model, identity = 200, "", id_from(None)
        token = logs.REQUEST_ID.set(identity)
        failed = pb.ModelStreamInferResponse()  # an error's response: the request's id and model, once known
        try:
            try:
                request = pb.ModelInferRequest.FromString(raw)
            except DecodeError:
                raise InvalidInput("the request is not a ModelInferRequest message") from None
            failed.infer_response.id, failed.infer_response.model_name = request.id, request.model_name
            if request.id:
                identity = id_from(request.id.encode("utf-8", "replace"))
                logs.REQUEST_ID.set(identity)
            open_inference.known_model(self.registry, request.model_name, _version(request.model_version))
            entry = self.registry.resolve(None, request.model_name)
            model = entry.name
            document, binary = _document(request)
            parameters = document["parameters"]
            streamed = parameters.pop(STREAM_PARAMETER, False)
            parameters.pop(EMPTY_FINAL_PARAMETER, None)
            if not isinstance(streamed, bool):
                raise InvalidInput(f"parameters.{STREAM_PARAMETER}: must be true or false")
            inference = open_inference.parse_document(document, binary)
            budget_s = within_budget(ends - time.perf_counter() if ends is not None else None, self.settings)
            reply = _Replies(entry.name, request.id)
            if not streamed:
                timing = RequestTiming(time.perf_counter())
                values = await open_inference.generate(entry, inference, self.settings, timing, budget_s)
                answers.put_nowait(reply.whole(inference, values))
                return
            if len(inference.texts) != 1:
                raise InvalidInput(f"parameters.{STREAM_PARAMETER}: one text per streamed request")
            prepared, deadline = open_inference.prepare(entry, inference, self.settings, budget_s)
            async for answer in streaming.admit(prepared, self.settings, deadline, False,
                                                RequestTiming(time.perf_counter()), reply):
                answers.put_nowait(answer)
            status = reply.status
        except ServiceError as error:
            status = protocol_status(error)
            failed.error_message = error.message
            answers.put_nowait(failed)
        except asyncio.CancelledError:  # the client ended the call: the request's rows leave the batch
            status = CLIENT_GONE
            if model:
                metrics.REJECTED_TOTAL.labels(model, "disconnected").inc()
            raise
        except Exception as error:
            logger.error("unhandled error on %s", path, exc_info=error)
            status = 500
            failed.error_message = "internal error"
            answers.put_nowait(failed)
        finally:
            logs.REQUEST_ID.reset(token)
            _record(path, peer, status, started, identity, model)


class _Replies:
    """A request's `ModelStreamInfer` responses: written from a streamed row's events
    (`service.api.streaming.EventWriter`), or from a whole answer; `status` is what the access
    line and the metrics count."""

    def __init__(self, model: str, identity: str) -> None:
        self.model, self.identity = model, identity
        self.status = 200

    def _response(self, values: dict[str, list[Any]], shape: list[int], final: bool) -> Any:
        response = _infer_response(self.model, self.identity, values, shape)
        if final:
            response.parameters[FINAL_PARAMETER].bool_param = True
        return pb.ModelStreamInferResponse(infer_response=response)

    def whole(self, inference: open_inference.Inference, values: dict[str, list[Any]]) -> Any:
        """`ModelInfer`'s answer, as the request's one (and last) response."""
        return self._response({name: values[name] for name in inference.outputs}, inference.shape, final=True)

    def opening(self) -> None:
        return None

    def token(self, data: dict[str, Any]) -> Any:
        return self._response({"output": [data["delta"]]}, [1], final=False) if data["delta"] else None

    def final(self, data: dict[str, Any]) -> Any:
        output = data["output"]
        values: dict[str, list[Any]] = {"output": [data["delta"]], "finish_reason": [output["finish_reason"]]}
        if "score" in output:
            values[open_inference.SCORE] = [output["score"]]
        return self._response(values, [1], final=True)

    def error(self, message: str, error_type: str) -> Any:
        self.status = protocol_status_of(error_type)
        failed = pb.ModelStreamInferResponse(error_message=message)
        failed.infer_response.id, failed.infer_response.model_name = self.identity, self.model
        return failed


def _infer_response(model: str, identity: str, values: dict[str, list[Any]], shape: list[int]) -> Any:
    """A `ModelInferResponse` of these outputs (each of `shape`), in `raw_output_contents`, as
    Triton sends them."""
    response = pb.ModelInferResponse(model_name=model, model_version=open_inference.MODEL_VERSION, id=identity)
    for name, elements in values.items():
        score = name == open_inference.SCORE
        response.outputs.add(name=name, shape=shape, datatype=open_inference.FP32 if score else open_inference.BYTES)
        response.raw_output_contents.append(
            open_inference.serialize_floats(elements) if score else open_inference.serialize_bytes(elements))
    return response


def _record(path: str, peer: str | None, status: int, started: float, identity: str, model: str) -> None:
    """A call's (or a streamed request's) access line and metrics."""
    log_access({"method": "POST", "path": path, "client": _client(peer)},
               status, started, identity, model or None)
    metrics.REQUESTS_TOTAL.labels(path, model, metrics.status_class(status)).inc()
    metrics.REQUEST_DURATION_SECONDS.labels(path, model).observe(time.perf_counter() - started)


def _version(version: str) -> str:
    """A requested model version: empty means the model's one."""
    return version or open_inference.MODEL_VERSION


def _document(request: Any) -> tuple[dict[str, Any], bytes]:
    """An infer request's JSON form (`open_inference.parse_document`) and its input's raw bytes."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents: {len(raw)} given for {len(request.inputs)} "
                           "inputs; one per input, or none")
    inputs = []
    for i, tensor in enumerate(request.inputs):
        document: dict[str, Any] = {"name": tensor.name, "shape": list(tensor.shape),
                                    "datatype": tensor.datatype,
                                    "parameters": _parameters(tensor.parameters)}
        if raw:
            document["parameters"]["binary_data_size"] = len(raw[i])
        if tensor.HasField("contents"):
            document["data"] = _elements(tensor.contents, tensor.datatype, f"inputs[{i}]")
        inputs.append(document)
    outputs = [{"name": output.name, "parameters": _parameters(output.parameters)}
               for output in request.outputs]
    return ({"id": request.id or None, "parameters": _parameters(request.parameters),
             "inputs": inputs, "outputs": outputs or None}, raw[0] if raw else b"")


def _parameters(parameters: Any) -> dict[str, Any]:
    """A `map<string, InferParameter>` (or `ModelRepositoryParameter`) as a dict of its values."""
    values = {}
    for name, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        values[name] = getattr(parameter, kind) if kind is not None else None
    return values


def _elements(contents: Any, datatype: str, where: str) -> list[Any]:
    """A tensor's `contents`: its BYTES elements as text, else the values of its one field."""
    if datatype == open_inference.BYTES:
        try:
            return [element.decode("utf-8") for element in contents.bytes_contents]
        except UnicodeDecodeError:
            raise InvalidInput(f"{where}: an element is not UTF-8 text") from None
    return next((list(values) for _, values in contents.ListFields()), [])


def _client(peer: str | None) -> tuple[str, int] | None:
    """The (address, port) of a gRPC peer such as `ipv4:127.0.0.1:5000` or `ipv6:[::1]:5000`."""
    if not peer or not peer.startswith(("ipv4:", "ipv6:")):
        return None
    host, _, port = peer.split(":", 1)[1].rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


@dataclass
class GrpcServer:
    """A started gRPC server and the port it listens on."""

    server: grpc.aio.Server
    port: int

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls and give those in flight `grace_s` to finish."""
        await self.server.stop(grace_s)


async def start(registry: ModelRegistry, settings: Settings,
                tracer_provider: Any | None = None) -> GrpcServer:
    """Serve `GRPCInferenceService` on `settings.host`:`settings.grpc_port` in this event loop;
    with `tracer_provider` (OpenTelemetry's, `service.observability.tracing`) each call is traced.

    Several `workers` share the port (SO_REUSEPORT, as their HTTP socket); a single process
    refuses a port another server holds. Raises RuntimeError when the port cannot be bound.
    """
    assert settings.grpc_port is not None
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", settings.max_body_bytes),
                 ("grpc.so_reuseport", int(settings.workers > 1))],
        maximum_concurrent_rpcs=settings.max_connections,
    )
    tracer = CallTracer(tracer_provider) if tracer_provider is not None else None
    service = InferenceService(registry, settings, tracer)
    server.add_generic_rpc_handlers((service.handler(), service.health_handler()))
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:  # older grpcio reports a failed bind this way, newer ones raise
        message = f"gRPC: cannot listen on {address} (in use, or not an address of this machine)"
        logger.error(message)
        raise RuntimeError(message) from None
    await server.start()
    logger.info("serving KServe v2 over gRPC on %s:%d", settings.host, port)
    return GrpcServer(server, port)
