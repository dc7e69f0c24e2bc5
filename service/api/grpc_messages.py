"""The messages of KServe v2 / the Open Inference Protocol over gRPC (package `inference`), built
at import from a descriptor written here: no generated code, any protobuf runtime from 4.25 on.

Names and field numbers are the protocol's (`grpc_predict_v2.proto`, which Triton's
`grpc_service.proto` extends), so a stock client (`tritonclient[grpc]`) and this server read
each other's bytes; the messages live in a pool of their own, beside any generated copy a
client library registers in protobuf's default pool. Only the core methods' messages are here
(`METHODS`): health, metadata, `ModelInfer`, and the model repository's (Triton's index, load
and unload); Triton's streaming `ModelStreamInfer` (`STREAM_METHODS`); and gRPC's own health
checking protocol (`grpc.health.v1.Health/Check`).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_FIELD = descriptor_pb2.FieldDescriptorProto
_BOOL, _STRING, _BYTES = _FIELD.TYPE_BOOL, _FIELD.TYPE_STRING, _FIELD.TYPE_BYTES
_INT32, _INT64, _UINT32, _UINT64 = _FIELD.TYPE_INT32, _FIELD.TYPE_INT64, _FIELD.TYPE_UINT32, _FIELD.TYPE_UINT64
_FLOAT, _DOUBLE, _MESSAGE = _FIELD.TYPE_FLOAT, _FIELD.TYPE_DOUBLE, _FIELD.TYPE_MESSAGE

# A field: (name, number, type, repeated, message type name (relative to the package) or None).
Field = tuple[str, int, int, bool, str | None]


def _one(name: str, number: int, kind: int, message: str | None = None) -> Field:
    return name, number, kind, False, message


def _many(name: str, number: int, kind: int, message: str | None = None) -> Field:
    return name, number, kind, True, message


def _parameters(number: int) -> Field:
    """A `map<string, InferParameter>` field (its entry type is the nested `ParametersEntry`;
    `ModelRepositoryParameter` values in the repository's messages, `_REPOSITORY_PARAMETERS`)."""
    return _many("parameters", number, _MESSAGE, "ParametersEntry")


_TENSOR = [_one("name", 1, _STRING), _one("datatype", 2, _STRING), _many("shape", 3, _INT64)]

# Each message: its fields and its nested messages (the same form, by name).
_MESSAGES: dict[str, tuple[list[Field], dict[str, Any]]] = {
    "InferParameter": ([  # one of these (the oneof `parameter_choice`)
        _one("bool_param", 1, _BOOL), _one("int64_param", 2, _INT64),
        _one("string_param", 3, _STRING), _one("double_param", 4, _DOUBLE),
        _one("uint64_param", 5, _UINT64),
    ], {}),
    "InferTensorContents": ([
        _many("bool_contents", 1, _BOOL), _many("int_contents", 2, _INT32),
        _many("int64_contents", 3, _INT64), _many("uint_contents", 4, _UINT32),
        _many("uint64_contents", 5, _UINT64), _many("fp32_contents", 6, _FLOAT),
        _many("fp64_contents", 7, _DOUBLE), _many("bytes_contents", 8, _BYTES),
    ], {}),
    "ServerLiveRequest": ([], {}),
    "ServerLiveResponse": ([_one("live", 1, _BOOL)], {}),
    "ServerReadyRequest": ([], {}),
    "ServerReadyResponse": ([_one("ready", 1, _BOOL)], {}),
    "ModelReadyRequest": ([_one("name", 1, _STRING), _one("version", 2, _STRING)], {}),
    "ModelReadyResponse": ([_one("ready", 1, _BOOL)], {}),
    "ServerMetadataRequest": ([], {}),
    "ServerMetadataResponse": ([
        _one("name", 1, _STRING), _one("version", 2, _STRING), _many("extensions", 3, _STRING),
    ], {}),
    "ModelMetadataRequest": ([_one("name", 1, _STRING), _one("version", 2, _STRING)], {}),
    "ModelMetadataResponse": ([
        _one("name", 1, _STRING), _many("versions", 2, _STRING), _one("platform", 3, _STRING),
        _many("inputs", 4, _MESSAGE, "TensorMetadata"),
        _many("outputs", 5, _MESSAGE, "TensorMetadata"),
    ], {"TensorMetadata": (_TENSOR, {})}),
    "ModelInferRequest": ([
        _one("model_name", 1, _STRING), _one("model_version", 2, _STRING), _one("id", 3, _STRING),
        _parameters(4), _many("inputs", 5, _MESSAGE, "InferInputTensor"),
        _many("outputs", 6, _MESSAGE, "InferRequestedOutputTensor"),
        _many("raw_input_contents", 7, _BYTES),
    ], {
        "InferInputTensor": ([*_TENSOR, _parameters(4),
                              _one("contents", 5, _MESSAGE, "InferTensorContents")], {}),
        "InferRequestedOutputTensor": ([_one("name", 1, _STRING), _parameters(2)], {}),
    }),
    "ModelRepositoryParameter": ([  # one of these (the oneof `parameter_choice`)
        _one("bool_param", 1, _BOOL), _one("int64_param", 2, _INT64),
        _one("string_param", 3, _STRING), _one("bytes_param", 4, _BYTES),
    ], {}),
    "RepositoryIndexRequest": ([_one("repository_name", 1, _STRING), _one("ready", 2, _BOOL)], {}),
    "RepositoryIndexResponse": ([_many("models", 1, _MESSAGE, "ModelIndex")], {
        "ModelIndex": ([_one("name", 1, _STRING), _one("version", 2, _STRING), _one("state", 3, _STRING),
                        _one("reason", 4, _STRING)], {}),
    }),
    "RepositoryModelLoadRequest": ([
        _one("repository_name", 1, _STRING), _one("model_name", 2, _STRING), _parameters(3),
    ], {}),
    "RepositoryModelLoadResponse": ([], {}),
    "RepositoryModelUnloadRequest": ([
        _one("repository_name", 1, _STRING), _one("model_name", 2, _STRING), _parameters(3),
    ], {}),
    "RepositoryModelUnloadResponse": ([], {}),
    "ModelStreamInferResponse": ([
        _one("error_message", 1, _STRING), _one("infer_response", 2, _MESSAGE, "ModelInferResponse"),
    ], {}),
    "ModelInferResponse": ([
        _one("model_name", 1, _STRING), _one("model_version", 2, _STRING), _one("id", 3, _STRING),
        _parameters(4), _many("outputs", 5, _MESSAGE, "InferOutputTensor"),
        _many("raw_output_contents", 6, _BYTES),
    ], {
        "InferOutputTensor": ([*_TENSOR, _parameters(4),
                               _one("contents", 5, _MESSAGE, "InferTensorContents")], {}),
    }),
}

# The methods: name -> (request message, response message); all unary. The core ones, and the
# model repository's (Triton's, what tritonclient's load_model and unload_model call).
METHODS: dict[str, tuple[str, str]] = {
    name: (f"{name}Request", f"{name}Response")
    for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                 "ModelInfer", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
}
# Triton's streaming inference (its decoupled models'): a stream of requests each answered by one
# or more responses, on one bidirectional call.
STREAM_METHODS: dict[str, tuple[str, str]] = {"ModelStreamInfer": ("ModelInferRequest", "ModelStreamInferResponse")}
_ONE_OF = ("InferParameter", "ModelRepositoryParameter")  # each field in the oneof `parameter_choice`
_REPOSITORY_PARAMETERS = ("RepositoryModelLoadRequest", "RepositoryModelUnloadRequest")


def _message(name: str, fields: list[Field], nested: dict[str, Any],
             scope: str) -> descriptor_pb2.DescriptorProto:
    """The descriptor of message `name` (full name `scope.name`); nested types resolve first in
    the message, then in the package; a message with a `parameters` field gets its map entry."""
    proto = descriptor_pb2.DescriptorProto(name=name)
    full = f"{scope}.{name}"
    for nested_name, (nested_fields, deeper) in nested.items():
        proto.nested_type.append(_message(nested_name, nested_fields, deeper, full))
    if any(field[0] == "parameters" for field in fields):
        entry = proto.nested_type.add(name="ParametersEntry")
        entry.options.map_entry = True
        entry.field.append(_FIELD(name="key", number=1, type=_STRING, label=_FIELD.LABEL_OPTIONAL))
        value = "ModelRepositoryParameter" if name in _REPOSITORY_PARAMETERS else "InferParameter"
        entry.field.append(_FIELD(name="value", number=2, type=_MESSAGE, label=_FIELD.LABEL_OPTIONAL,
                                  type_name=f".{PACKAGE}.{value}"))
    local = {*nested, "ParametersEntry"}
    oneof = name in _ONE_OF
    if oneof:
        proto.oneof_decl.add(name="parameter_choice")
    for field_name, number, kind, repeated, message in fields:
        field = _FIELD(name=field_name, number=number, type=kind,
                       label=_FIELD.LABEL_REPEATED if repeated else _FIELD.LABEL_OPTIONAL)
        if message is not None:
            field.type_name = f".{full}.{message}" if message in local else f".{PACKAGE}.{message}"
        if oneof:
            field.oneof_index = 0
        proto.field.append(field)
    return proto


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name="attnserve/grpc_predict_v2.proto",
                                               package=PACKAGE, syntax="proto3")
    for name, (fields, nested) in _MESSAGES.items():
        proto.message_type.append(_message(name, fields, nested, PACKAGE))
    service = proto.service.add(name=SERVICE.rsplit(".", 1)[1])
    for method, (request, response) in METHODS.items():
        service.method.add(name=method, input_type=f".{PACKAGE}.{request}",
                           output_type=f".{PACKAGE}.{response}")
    for method, (request, response) in STREAM_METHODS.items():
        service.method.add(name=method, input_type=f".{PACKAGE}.{request}",
                           output_type=f".{PACKAGE}.{response}", client_streaming=True, server_streaming=True)
    return proto


HEALTH_PACKAGE = "grpc.health.v1"
HEALTH_SERVICE = f"{HEALTH_PACKAGE}.Health"
SERVING_STATUSES = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _health_file() -> descriptor_pb2.FileDescriptorProto:
    """gRPC's health checking protocol (`grpc.health.v1`): `Check`, what Kubernetes' gRPC probes
    and grpc_health_probe call, and `Watch`, what gRPC clients' own health checking calls."""
    package = HEALTH_PACKAGE
    proto = descriptor_pb2.FileDescriptorProto(name="attnserve/health.proto", package=package,
                                               syntax="proto3")
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.append(_FIELD(name="service", number=1, type=_STRING, label=_FIELD.LABEL_OPTIONAL))
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(SERVING_STATUSES):
        status.value.add(name=name, number=number)
    response.field.append(_FIELD(name="status", number=1, type=_FIELD.TYPE_ENUM, label=_FIELD.LABEL_OPTIONAL,
                                 type_name=f".{package}.HealthCheckResponse.ServingStatus"))
    health = proto.service.add(name="Health")
    health.method.add(name="Check", input_type=f".{package}.HealthCheckRequest",
                      output_type=f".{package}.HealthCheckResponse")
    health.method.add(name="Watch", input_type=f".{package}.HealthCheckRequest",
                      output_type=f".{package}.HealthCheckResponse", server_streaming=True)
    return proto


POOL = descriptor_pool.DescriptorPool()
FILE = POOL.AddSerializedFile(_file().SerializeToString())
HEALTH_FILE = POOL.AddSerializedFile(_health_file().SerializeToString())
HEALTH_PATH = f"/{HEALTH_SERVICE}/Check"
# Each method's path: the `route` label of its calls in the metrics.
PATHS = (*(f"/{SERVICE}/{name}" for name in (*METHODS, *STREAM_METHODS)), HEALTH_PATH)


def message_class(name: str, package: str = PACKAGE) -> Any:
    """The class of the message `name` of `package` (e.g. "ModelInferRequest")."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{package}.{name}"))


ServerLiveRequest = message_class("ServerLiveRequest")
ServerLiveResponse = message_class("ServerLiveResponse")
ServerReadyRequest = message_class("ServerReadyRequest")
ServerReadyResponse = message_class("ServerReadyResponse")
ModelReadyRequest = message_class("ModelReadyRequest")
ModelReadyResponse = message_class("ModelReadyResponse")
ServerMetadataRequest = message_class("ServerMetadataRequest")
ServerMetadataResponse = message_class("ServerMetadataResponse")
ModelMetadataRequest = message_class("ModelMetadataRequest")
ModelMetadataResponse = message_class("ModelMetadataResponse")
ModelInferRequest = message_class("ModelInferRequest")
ModelInferResponse = message_class("ModelInferResponse")
ModelStreamInferResponse = message_class("ModelStreamInferResponse")
InferParameter = message_class("InferParameter")
RepositoryIndexResponse = message_class("RepositoryIndexResponse")
RepositoryModelLoadResponse = message_class("RepositoryModelLoadResponse")
RepositoryModelUnloadResponse = message_class("RepositoryModelUnloadResponse")
HealthCheckRequest = message_class("HealthCheckRequest", HEALTH_PACKAGE)
HealthCheckResponse = message_class("HealthCheckResponse", HEALTH_PACKAGE)
