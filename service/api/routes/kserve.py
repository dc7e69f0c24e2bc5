"""KServe v2 / Open Inference Protocol REST routes (what `tritonclient[http]` speaks).

`GET /v2`, `/v2/health/live`, `/v2/health/ready`, `/v2/models/{name}`,
`/v2/models/{name}/ready`, `POST /v2/models/{name}/infer` (and the same under
`/v2/models/{name}/versions/1/...`), and the model repository extension:
`POST /v2/repository/index` (every model folder and model served, with its state), and with
`model_control` `POST /v2/repository/models/{name}/load` (load, or reload while the version
served keeps serving: `service.core.registry.ModelRegistry.load`) and `.../unload` (403 while
`model_control` is off); the three need the API key when one is set. Health answers 200 with
an empty body when true, as the protocol asks. Errors on these routes have the protocol's body `{"error": "..."}`, with the
service's statuses except that bad input is a 400 (not 422). Conversion: `service.api.open_inference`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from service.api import open_inference
from service.api.auth import require_api_key_for_metadata
from service.api.deadline import request_budget_s
from service.api.errors import ProtocolRoute
from service.api.media_type import load_json
from service.api.routes.deps import AuthorizedDep, RegistryDep
from service.core.errors import InvalidInput
from service.observability.timing import SERVER_TIMING, RequestTiming


def kserve_error(status_code: int, message: str,
                 headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The protocol's error body."""
    return JSONResponse({"error": message}, status_code=status_code, headers=headers)


class KServeRoute(ProtocolRoute):
    """A route whose errors take the protocol's shape (bad input: 400)."""

    @staticmethod
    def body(message: str, error_type: str, status: int) -> Any:
        return {"error": message}


router = APIRouter(tags=["kserve v2"], route_class=KServeRoute)
ERROR: dict[str, Any] = {"content": {"application/json": {"example": {"error": "..."}}}}
RESPONSES: dict[int | str, dict[str, Any]] = {
    code: ERROR for code in (400, 401, 404, 408, 413, 429, 500, 503, 504)
}


@router.get("/v2", responses=RESPONSES)
async def server_metadata() -> open_inference.ServerMetadata:
    """The server's name, version and protocol extensions."""
    return open_inference.ServerMetadata(name="attnserve", version="0.1.0",
                                 extensions=open_inference.EXTENSIONS)


@router.get("/v2/health/live", responses=RESPONSES, response_class=Response)
async def server_live() -> Response:
    """200 while the process serves HTTP."""
    return Response(status_code=200)


@router.get("/v2/health/ready", responses=RESPONSES, response_class=Response)
async def server_ready(registry: RegistryDep) -> Response:
    """200 once every model is ready (as `/health/ready`); 503 otherwise."""
    if not registry.ready:
        return kserve_error(503, registry.not_ready_reason())
    return Response(status_code=200)


@router.get("/v2/models/{name}", responses=RESPONSES,
            dependencies=[Depends(require_api_key_for_metadata)])
@router.get("/v2/models/{name}/versions/{version}", responses=RESPONSES,
            dependencies=[Depends(require_api_key_for_metadata)])
async def model_metadata(
    name: str, registry: RegistryDep, version: str = open_inference.MODEL_VERSION
) -> open_inference.ModelMetadata:
    """The model's inputs and outputs (known while it loads); with `api_key`, the token is
    needed (unless `public_metadata`)."""
    open_inference.known_model(registry, name, version)
    return open_inference.model_metadata(name)


@router.get("/v2/models/{name}/ready", responses=RESPONSES, response_class=Response)
@router.get("/v2/models/{name}/versions/{version}/ready", responses=RESPONSES,
            response_class=Response)
async def model_ready(
    name: str, registry: RegistryDep, version: str = open_inference.MODEL_VERSION
) -> Response:
    """200 when the model is ready; 503 while it loads or after it failed; 404 unknown."""
    open_inference.known_model(registry, name, version)
    registry.resolve(None, name)
    return Response(status_code=200)


def _inlined(schema: Any, definitions: dict[str, Any] | None = None) -> Any:
    """A JSON schema with its local `$ref`s (`#/$defs/...`) replaced by their definitions."""
    if definitions is None:
        definitions = schema.get("$defs", {}) if isinstance(schema, dict) else {}
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inlined(definitions[schema["$ref"].rsplit("/", 1)[-1]], definitions)
        return {k: _inlined(v, definitions) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inlined(item, definitions) for item in schema]
    return schema


# The body is read by hand (JSON or the binary extension); its JSON form documented here.
INFER_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inlined(open_inference.InferenceRequest.model_json_schema())}}}}


@router.post("/v2/models/{name}/infer", responses=RESPONSES, openapi_extra=INFER_BODY)
@router.post("/v2/models/{name}/versions/{version}/infer", responses=RESPONSES,
             openapi_extra=INFER_BODY)
async def infer(
    name: str, request: Request, serving: AuthorizedDep,
    version: str = open_inference.MODEL_VERSION,
) -> Response:
    """Generate for every element of the BYTES input `text`; JSON or binary tensors; the
    request's stage times in `Server-Timing` (`service.observability.timing`; from the body read
    and parsed, as FastAPI has done before the /v1 routes start, to the outputs gathered, before
    their encoding, as there)."""
    registry, settings = serving.registry, serving.settings
    open_inference.known_model(registry, name, version)
    entry = registry.resolve(None, name)
    request.state.model = entry.name  # the metrics label of this request
    inference = open_inference.parse_request(await request.body(),
                                     request.headers.get(open_inference.HEADER_LENGTH))
    timing = RequestTiming(time.perf_counter())
    request.state.timing = timing  # for the request's trace (service.observability.tracing)
    budget_s = request_budget_s(request, None, settings)  # header only
    values = await open_inference.generate(entry, inference, settings, timing, budget_s, request)
    headers = {SERVER_TIMING: timing.header(time.perf_counter())}
    body, header_length = open_inference.response_body(entry.name, inference, values)
    if header_length is None:
        return Response(body, media_type="application/json", headers=headers)
    return Response(body, media_type="application/octet-stream",
                    headers={**headers, open_inference.HEADER_LENGTH: str(header_length)})


async def _control_body(request: Request) -> dict[str, Any]:
    """A repository request's body: empty (tritonclient's index), or a JSON object."""
    raw = await request.body()
    if not raw.strip():
        return {}
    body = load_json(raw)
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    return body


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("parameters: must be an object")
    return parameters


@router.post("/v2/repository/index", responses=RESPONSES)
async def repository_index(request: Request, serving: AuthorizedDep) -> list[open_inference.RepositoryModel]:
    """Every model folder of the models folder and every model served, by name, with its state
    (`{"ready": true}`: the ready ones only)."""
    ready_only = (await _control_body(request)).get("ready", False)
    if not isinstance(ready_only, bool):
        raise InvalidInput("ready: must be true or false")
    return open_inference.repository_index(serving.registry, ready_only)


@router.post("/v2/repository/models/{name}/load", responses={**RESPONSES, 403: ERROR}, response_class=Response)
async def repository_load(name: str, request: Request, serving: AuthorizedDep) -> Response:
    """Load model folder `name`, or reload it from its folder while the version served keeps
    serving until the new one is ready; 200 once it serves. A load that fails is a 400 with the
    reason, and the version served (if any) stays."""
    open_inference.check_model_control(serving.settings, _parameters(await _control_body(request)), unload=False)
    await serving.registry.load(name)
    return Response(status_code=200)


@router.post("/v2/repository/models/{name}/unload", responses={**RESPONSES, 403: ERROR},
             response_class=Response)
async def repository_unload(name: str, request: Request, serving: AuthorizedDep) -> Response:
    """Stop serving model `name`: requests for it are a 404 from now, its rows in flight finish."""
    open_inference.check_model_control(serving.settings, _parameters(await _control_body(request)), unload=True)
    await serving.registry.unload(name)
    return Response(status_code=200)
