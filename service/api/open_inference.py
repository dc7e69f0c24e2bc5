"""The KServe v2 / Open Inference Protocol: its schemas, the conversion to and from texts, and
the inference itself (`generate`), the same over REST (`service.api.routes.kserve`) and gRPC
(`service.api.grpc_inference`).

A model takes one BYTES input tensor `text` (any shape, usually `[N]`; one text per element)
and gives two BYTES output tensors of the same shape: `output` (the generated texts) and
`finish_reason` ("eos" or "length"). Request parameters `max_new_tokens`, `beam_size` and
(summarization) `truncate` are the options of `/v1/translate` and `/v1/summarize`, and so are
`return_scores` (adds the FP32 output `score` of the same shape: each output's summed
log-probability, `</s>` included; asking for the output `score` by name does the same) and
`target_prefix` (one string, the prefix of every output; `service.api.decode_options`) and
sampling's `temperature`, `top_k`, `top_p` and `seed` (element i of the input draws from the seed
and i);
`binary_data_output` is the protocol's own. n-best hypotheses have no tensor here (`/v1` gives
them).

Tensors travel as JSON (`"data": ["...", ...]`) or with the binary tensor data extension:
the body is the JSON header (its length in the `Inference-Header-Content-Length` header), then
the tensors' bytes in input order, an input's size in its `binary_data_size` parameter; a BYTES
element is a 4-byte little-endian length then that many bytes. Outputs are binary when the
request asks (`binary_data` on a requested output, or `binary_data_output`). Problems are
`InvalidInput` (400 on these routes).

The model repository extension (`repository_index`, and with `model_control` the registry's
`load` and `unload`, checked by `check_model_control`): every model folder and model served with
its state, READY, LOADING or UNAVAILABLE with the reason; a load reads a model folder's files
again and takes no parameters (Triton's `config` and `file:` overrides are refused).

Hostile bodies are refused the same way: JSON nested too deep for the parser, `data` nested
deeper than a shape may have dimensions, dimensions over `MAX_DIM`, and texts (or an `id`)
holding control characters or lone surrogates, as `/v1` refuses them
(`service.api.schemas.clean_text`). Names a client sent are quoted shortened
(`service.api.errors.shorten`).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.requests import Request

from service.api import pipeline
from service.api.deadline import Deadline
from service.api.decode_options import decode_options, sampling, whole_texts
from service.api.errors import describe_validation_errors
from service.api.media_type import load_json
from service.api.schemas import (
    MAX_BEAM_SIZE,
    MAX_NEW_TOKENS,
    PrefixText,
    Seed,
    Temperature,
    TopK,
    TopP,
    clean_text,
)
from service.core.errors import Forbidden, InvalidInput, ModelNotFound, shorten
from service.core.registry import ModelEntry, ModelRegistry
from service.core.settings import Settings
from service.generation.sampling import Sampling
from service.observability.timing import RequestTiming

PLATFORM = "attnserve"
MODEL_VERSION = "1"
INPUT = "text"
OUTPUTS = ("output", "finish_reason")  # given unless `outputs` names others
SCORE = "score"  # FP32, with `return_scores`
BYTES = "BYTES"
FP32 = "FP32"
_FLOAT = struct.Struct("<f")
EXTENSIONS = ["binary_tensor_data", "model_repository"]
HEADER_LENGTH = "Inference-Header-Content-Length"
_LENGTH = struct.Struct("<I")
MAX_DIMS = 8  # dimensions of a tensor's shape, and nesting levels of its `data`
MAX_DIM = 2**31 - 1  # size of one dimension
MAX_ID_CHARS = 1024

M = TypeVar("M", bound=BaseModel)


# ---------------------------------------------------------------- metadata


class ServerMetadata(BaseModel):
    """`GET /v2`."""

    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    """One input or output of a model; -1 is a dimension of any size."""

    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    """`GET /v2/models/{name}`."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


def model_metadata(name: str) -> ModelMetadata:
    """The metadata of every model served here (they differ only by name)."""
    return ModelMetadata(
        name=name,
        versions=[MODEL_VERSION],
        platform=PLATFORM,
        inputs=[TensorMetadata(name=INPUT, datatype=BYTES, shape=[-1])],
        outputs=[*(TensorMetadata(name=n, datatype=BYTES, shape=[-1]) for n in OUTPUTS),
                 TensorMetadata(name=SCORE, datatype=FP32, shape=[-1])],
    )


def known_model(registry: ModelRegistry, name: str, version: str) -> ModelEntry:
    """The model's entry (ready or not); `ModelNotFound` for an unknown name or version."""
    entry = next((e for e in registry.entries if e.name == name), None)
    if entry is None:
        raise ModelNotFound(f"no model {shorten(repr(name))} on this server")
    if version != MODEL_VERSION:
        raise ModelNotFound(f"model {name!r} has no version {shorten(repr(version))}; "
                            f"it has {MODEL_VERSION!r}")
    return entry


# ---------------------------------------------------------------- model repository


class RepositoryModel(BaseModel):
    """A model of the repository index."""

    name: str
    version: str = MODEL_VERSION
    state: str  # READY, LOADING, UNAVAILABLE
    reason: str = ""


def repository_index(registry: ModelRegistry, ready_only: bool) -> list[RepositoryModel]:
    """Every model folder of the models folder and every model served, by name (the ready ones
    only with `ready_only`): READY, LOADING, or UNAVAILABLE with the reason (its load error, or
    "not loaded")."""
    found = []
    for name, entry in registry.folders():
        if entry is None:
            found.append(RepositoryModel(name=name, state="UNAVAILABLE", reason="not loaded"))
        elif entry.state == "failed":
            found.append(RepositoryModel(name=name, state="UNAVAILABLE", reason=entry.error or "failed"))
        else:
            found.append(RepositoryModel(name=name, state=entry.state.upper()))
    return [model for model in found if model.state == "READY" or not ready_only]


def check_model_control(settings: Settings, parameters: dict[str, Any], unload: bool) -> None:
    """A load's or unload's check: `Forbidden` while `model_control` is off; `InvalidInput` for
    parameters (an unload's `unload_dependents` aside: no model depends on another here)."""
    if not settings.model_control:
        raise Forbidden("model control is off: start the server with --model-control "
                        "(ATTNSERVE_MODEL_CONTROL=1) to load and unload models while it serves")
    taken = {"unload_dependents"} if unload else set()
    if set(parameters) - taken:
        raise InvalidInput("parameters are not supported: a model is loaded from its folder's files"
                           + ("; an unload takes unload_dependents only" if unload else ""))


# ---------------------------------------------------------------- inference request


class InputTensor(BaseModel):
    """An input tensor: data inline (JSON) or in the binary part (`binary_data_size`)."""

    name: StrictStr
    shape: Annotated[
        list[Annotated[StrictInt, Field(ge=0, le=MAX_DIM)]], Field(max_length=MAX_DIMS)
    ]
    datatype: StrictStr
    parameters: dict[str, Any] | None = None
    data: Any = None


class RequestedOutput(BaseModel):
    """An output asked for, optionally in binary (`{"binary_data": true}`)."""

    name: StrictStr
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    """Body (or JSON header) of `POST /v2/models/{name}/infer`."""

    id: Annotated[
        StrictStr, Field(max_length=MAX_ID_CHARS), AfterValidator(clean_text)
    ] | None = None
    parameters: dict[str, Any] | None = None
    inputs: Annotated[list[InputTensor], Field(min_length=1)]
    outputs: list[RequestedOutput] | None = None


class InferParameters(BaseModel):
    """The request parameters understood here."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    beam_size: Annotated[int, Field(ge=1, le=MAX_BEAM_SIZE)] = 1
    truncate: Annotated[int, Field(ge=1)] | StrictBool | None = None
    return_scores: StrictBool = False
    target_prefix: PrefixText | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    binary_data_output: StrictBool = False


class OutputTensor(BaseModel):
    """An output tensor: `data` inline, or `binary_data_size` bytes in the binary part."""

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[str] | list[float] | None = None


class InferenceResponse(BaseModel):
    """Body (or JSON header) of an infer response."""

    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OutputTensor]


@dataclass(frozen=True)
class Inference:
    """What an infer request asks for, in the service's terms."""

    id: str | None
    texts: list[str]
    shape: list[int]
    max_new_tokens: int | None
    beam_size: int
    outputs: dict[str, bool]  # output name -> in binary
    truncate: int | bool | None = None
    target_prefix: str | None = None
    sampling: Sampling | None = None  # temperature > 0: tokens sampled

    @property
    def return_scores(self) -> bool:
        """Whether the `score` output is given."""
        return SCORE in self.outputs


def parse_request(body: bytes, header_length: str | None) -> Inference:
    """The texts, options and outputs of an infer request (`InvalidInput` when malformed)."""
    header, binary = _split(body, header_length)
    return parse_document(load_json(header), binary)


def parse_document(document: Any, binary: bytes = b"") -> Inference:
    """The texts, options and outputs of an infer request in its JSON form, `binary` the bytes
    of an input with `binary_data_size` (the binary extension over REST, the raw contents over
    gRPC: `service.api.grpc_inference`); `InvalidInput` when malformed."""
    request = _validated(InferenceRequest, document)
    parameters = _validated(InferParameters, request.parameters or {}, "parameters")
    if len(request.inputs) != 1 or request.inputs[0].name != INPUT:
        names = [shorten(tensor.name) for tensor in request.inputs[:3]]
        more = f" and {len(request.inputs) - 3} more" if len(request.inputs) > 3 else ""
        raise InvalidInput(f"inputs: expected one input {INPUT!r}, got {names}{more}")
    tensor = request.inputs[0]
    texts = _texts(tensor, binary)
    outputs = {name: parameters.binary_data_output for name in OUTPUTS}
    if parameters.return_scores:
        outputs[SCORE] = parameters.binary_data_output
    if request.outputs is not None:
        outputs = {}
        for requested in request.outputs:
            if requested.name not in (*OUTPUTS, SCORE):
                raise InvalidInput(f"outputs: unknown output {shorten(repr(requested.name))}; "
                                   f"this model has {[*OUTPUTS, SCORE]}")
            binary_flag = (requested.parameters or {}).get("binary_data", False)
            if not isinstance(binary_flag, bool):
                raise InvalidInput(f"outputs.{requested.name}: binary_data must be a boolean")
            outputs[requested.name] = binary_flag
    sampled = sampling(parameters.temperature, parameters.top_k, parameters.top_p, parameters.seed,
                       parameters.beam_size, where="parameters.")
    return Inference(request.id, texts, list(tensor.shape), parameters.max_new_tokens,
                     parameters.beam_size, outputs, truncate=parameters.truncate,
                     target_prefix=parameters.target_prefix, sampling=sampled)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary part of a body."""
    if header_length is None:
        return body, b""
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidInput(f"{HEADER_LENGTH} is not a number") from None
    if not 0 < length <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} {length} does not fit a body of {len(body)} bytes")
    return body[:length], body[length:]


def _validated(model: type[M], document: Any, where: str = "") -> M:
    try:
        return model.model_validate(document)
    except ValidationError as error:
        message = describe_validation_errors(error.errors())
        raise InvalidInput(f"{where}: {message}" if where else message) from None


def _texts(tensor: InputTensor, binary: bytes) -> list[str]:
    """The texts of the `text` tensor, from its JSON data or the binary part."""
    if tensor.datatype != BYTES:
        raise InvalidInput(f"inputs.{INPUT}: datatype must be {BYTES}, "
                           f"got {shorten(repr(tensor.datatype))}")
    count = math.prod(tensor.shape)
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size != len(binary):
            raise InvalidInput(f"inputs.{INPUT}: binary_data_size {shorten(repr(size))} "
                               "does not match the "
                               f"{len(binary)} bytes after the JSON header")
        if tensor.data is not None:
            raise InvalidInput(f"inputs.{INPUT}: give data or binary_data_size, not both")
        elements = deserialize_bytes(binary)
        try:
            texts = [element.decode("utf-8") for element in elements]
        except UnicodeDecodeError:
            raise InvalidInput(f"inputs.{INPUT}: an element is not UTF-8 text") from None
    else:
        if binary:
            raise InvalidInput("binary data after the JSON header, but no input has "
                               "binary_data_size")
        if tensor.data is None:
            raise InvalidInput(f"inputs.{INPUT}: no data")
        texts = list(_flatten(tensor.data))
    if len(texts) != count:
        raise InvalidInput(f"inputs.{INPUT}: shape {tensor.shape} holds {count} elements, "
                           f"got {len(texts)}")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidInput(f"inputs.{INPUT}[{i}]: the text is empty")
        try:
            clean_text(text)
        except ValueError as error:
            raise InvalidInput(f"inputs.{INPUT}[{i}]: {error}") from None
    return texts


def _flatten(data: Any) -> Iterator[str]:
    """Elements of (nested) JSON lists, row-major; each must be a string, nested at most
    `MAX_DIMS` lists deep. Iterative: no depth reaches the interpreter's recursion limit."""
    stack: list[Iterator[Any]] = [iter([data])]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, str):
            yield item
        elif isinstance(item, list):
            if len(stack) > MAX_DIMS:
                raise InvalidInput(f"inputs.{INPUT}: data nested deeper than {MAX_DIMS} lists")
            stack.append(iter(item))
        else:
            raise InvalidInput(f"inputs.{INPUT}: {BYTES} elements must be strings")


_END = object()


def deserialize_bytes(buffer: bytes) -> list[bytes]:
    """BYTES elements of the binary extension: each a 4-byte little-endian length, then bytes."""
    elements, offset = [], 0
    while offset < len(buffer):
        if offset + _LENGTH.size > len(buffer):
            raise InvalidInput(f"inputs.{INPUT}: truncated binary data")
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += _LENGTH.size
        if offset + length > len(buffer):
            raise InvalidInput(f"inputs.{INPUT}: truncated binary data")
        elements.append(buffer[offset:offset + length])
        offset += length
    return elements


def serialize_bytes(elements: Sequence[str]) -> bytes:
    """The binary form of BYTES elements (UTF-8)."""
    parts = []
    for element in elements:
        data = element.encode("utf-8")
        parts.append(_LENGTH.pack(len(data)) + data)
    return b"".join(parts)


# ---------------------------------------------------------------- inference response


def serialize_floats(elements: Sequence[float]) -> bytes:
    """The binary form of FP32 elements (little-endian)."""
    return b"".join(_FLOAT.pack(element) for element in elements)


def response_body(
    model: str, inference: Inference, values: dict[str, Any]
) -> tuple[bytes, int | None]:
    """The response body and, when some output is binary, the length of its JSON header;
    `values` holds each output's elements (str, float for `score`)."""
    tensors, chunks = [], []
    for name, binary in inference.outputs.items():
        datatype = FP32 if name == SCORE else BYTES
        tensor = OutputTensor(name=name, shape=inference.shape, datatype=datatype)
        if binary:
            chunk = serialize_floats(values[name]) if datatype == FP32 else serialize_bytes(values[name])
            tensor.parameters = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            tensor.data = values[name]
        tensors.append(tensor)
    response = InferenceResponse(model_name=model, model_version=MODEL_VERSION,
                                 id=inference.id, outputs=tensors)
    header = response.model_dump_json(exclude_none=True).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


# ---------------------------------------------------------------- inference


def prepare(entry: ModelEntry, inference: Inference, settings: Settings,
            budget_s: float) -> tuple[pipeline.Prepared, Deadline]:
    """`inference`'s texts checked and tokenized for the model (`service.api.pipeline`), with
    their decoding options, and their deadline, `budget_s` from now."""
    where = [f"inputs.{INPUT}[{i}]" for i in range(len(inference.texts))]
    prepared = pipeline.prepare(entry, inference.texts, inference.beam_size,
                                inference.max_new_tokens, settings, where, truncate=inference.truncate,
                                whole_texts=whole_texts(return_scores=inference.return_scores,
                                                        target_prefix=inference.target_prefix))
    options = decode_options(prepared.runtime, len(inference.texts), inference.beam_size,
                             prepared.max_new_tokens, return_scores=inference.return_scores,
                             target_prefix=inference.target_prefix, where="parameters.target_prefix",
                             sampled=inference.sampling)
    prepared = dataclasses.replace(prepared, options=options)
    return prepared, Deadline(at=prepared.started + budget_s, budget_s=budget_s)


async def generate(
    entry: ModelEntry, inference: Inference, settings: Settings, timing: RequestTiming,
    budget_s: float, request: Request | None = None,
) -> dict[str, list[Any]]:
    """Every text of `inference` through the model's batcher (`service.api.pipeline`), within
    `budget_s` of its preparation (with `request`, dropped once its HTTP client goes away);
    each output's elements, by name (`score` with `return_scores`). The same over REST and gRPC."""
    prepared, deadline = prepare(entry, inference, settings, budget_s)
    results = await pipeline.generate(prepared, settings, deadline, request, timing)
    outputs = pipeline.outputs(prepared, results)
    values: dict[str, list[Any]] = {"output": [o.text for o in outputs],
                                    "finish_reason": [o.finish_reason for o in outputs]}
    if inference.return_scores:  # one row per text (`whole_texts`)
        values[SCORE] = [prepared.options.extras(prepared.runtime, r).get("score", math.nan) for r in results]
    return values
