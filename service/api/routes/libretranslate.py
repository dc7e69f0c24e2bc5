"""LibreTranslate's API: `POST /translate` and `GET /languages`, so that LibreTranslate's clients,
and the applications built on them, need only this server's address.

`POST /translate` takes a JSON object or a URL-encoded form: `q` (a text, or with JSON a list of
texts), `source` and `target` (language codes: the translation model whose manifest translates
`source` into `target` answers; the first by name when several do), `format` ("text"), and
`alternatives` (0 to `MAX_BEAM_SIZE - 1`: the next best translations of a beam of
`alternatives + 1`). It answers `{"translatedText": ...}` (a list for a list of texts) and, when
asked, `"alternatives"` (a list per text). With `api_key` set, the key comes as LibreTranslate's
clients send it, the body's `api_key`, or in the `Authorization: Bearer` header. Refused with a 400
and a message saying why: `source: "auto"` (the server detects no language), `format: "html"`
(tags would not be carried over), and a pair no model translates.

The texts take `/v1/translate`'s path (`service.api.routes.generate.generate_texts`): the limits,
long texts split into sentences, continuous batching, the deadline (`X-Request-Timeout-Ms`), the
client's disconnect, `Server-Timing`, metrics under the route `/translate`. Errors have the
server's body, `{"error": ..., "error_type": ...}` (LibreTranslate's clients read `error`), bad
input with LibreTranslate's status, 400. Unknown fields are ignored, as LibreTranslate does.

`GET /languages` lists every language a model translates from or into (LibreTranslate's
`code`, `name`, `targets`), from the manifests, while the models load too; like the other
descriptions of the API it needs the key unless `public_metadata` (here also as `api_key` in
the query or a form body, as LibreTranslate's clients send it).
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.exceptions import HTTPException

from service.api.auth import check_api_key
from service.api.errors import ProtocolRoute, describe_validation_errors
from service.api.media_type import is_json, load_json, media_type
from service.api.routes.deps import RegistryDep
from service.api.routes.generate import generate_texts
from service.api.schemas import MAX_BEAM_SIZE, MAX_TEXTS, ErrorBody, GenerateRequest, Text
from service.core.errors import InvalidInput, shorten
from service.core.registry import ModelRegistry
from service.core.settings import Settings

TRANSLATE = "translate"
AUTO = "auto"
FORM = "application/x-www-form-urlencoded"
MAX_FORM_FIELDS = 16
# Names of the languages LibreTranslate serves most; another code is its own name.
LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek", "en": "English",
    "es": "Spanish", "fi": "Finnish", "fr": "French", "hi": "Hindi", "hu": "Hungarian",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "nl": "Dutch",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sv": "Swedish",
    "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese",
}


router = APIRouter(tags=["libretranslate"], route_class=ProtocolRoute)
RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 408, 413, 415, 429, 500, 503, 504)
}


class Language(BaseModel):
    """A language of `GET /languages` and those it translates into."""

    code: str
    name: str
    targets: list[str]


class TranslateBody(BaseModel):
    """`POST /translate`'s fields (as JSON or a URL-encoded form)."""

    model_config = ConfigDict(extra="ignore")

    q: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS)]
    source: Annotated[StrictStr, Field(min_length=1, max_length=32)]
    target: Annotated[StrictStr, Field(min_length=1, max_length=32)]
    format: Literal["text", "html"] = "text"
    alternatives: Annotated[int, Field(ge=0, le=MAX_BEAM_SIZE - 1)] = 0
    api_key: Annotated[StrictStr, Field(max_length=1024)] | None = None


class TranslateAnswer(BaseModel):
    """`POST /translate`'s answer."""

    translatedText: str | list[str]  # LibreTranslate's name
    alternatives: list[str] | list[list[str]] | None = None


async def languages_key(request: Request) -> None:
    """`GET /languages`' key, unless `public_metadata` (as the API's other descriptions): the
    bearer header, or LibreTranslate's `api_key` as its clients send it here (the query, or a
    form body)."""
    settings: Settings = request.app.state.settings
    if settings.public_metadata or settings.api_key is None:
        return
    authorization = request.headers.get("authorization")
    if authorization is None:
        key = request.query_params.get("api_key")
        if key is None and media_type(request.headers.get("content-type")) == FORM:
            key = (await _fields(request)).get("api_key")
        authorization = f"Bearer {key}" if key is not None else None
    check_api_key(authorization, settings)


@router.get("/languages", response_model=list[Language], responses={401: {"model": ErrorBody}},
            dependencies=[Depends(languages_key)])
async def languages(registry: RegistryDep) -> list[Language]:
    """Every language a translation model translates from or into, with those it translates into."""
    pairs = _pairs(registry)
    codes = sorted({code for pair in pairs for code in pair})
    return [Language(code=code, name=LANGUAGE_NAMES.get(code, code),
                     targets=sorted({target for source, target in pairs if source == code}))
            for code in codes]


# The body is read by hand (JSON or a form); its fields documented here.
TRANSLATE_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    media: {"schema": TranslateBody.model_json_schema()} for media in ("application/json", FORM)}}}


@router.post("/translate", response_model=TranslateAnswer, responses=RESPONSES,
             response_model_exclude_none=True, openapi_extra=TRANSLATE_BODY)
async def translate(request: Request, response: Response) -> Any:
    """Translate `q` from `source` into `target`, as LibreTranslate does."""
    settings: Settings = request.app.state.settings
    registry: ModelRegistry = request.app.state.registry
    body = _validated(await _fields(request))
    authorization = request.headers.get("authorization")
    if authorization is None and body.api_key is not None:
        authorization = f"Bearer {body.api_key}"
    check_api_key(authorization, settings)
    if body.source == AUTO:
        raise InvalidInput("source: 'auto' is not supported: this server detects no language; "
                           "give the source language (GET /languages lists them)")
    if body.format != "text":
        raise InvalidInput("format: 'html' is not supported (its tags would not be kept); send text")
    model = _model(registry, body.source, body.target)
    texts = [body.q] if isinstance(body.q, str) else body.q
    beams = body.alternatives + 1
    generate = GenerateRequest.model_validate({"texts": texts, "model": model, "beam_size": beams,
                                               "num_hypotheses": beams if body.alternatives else None})
    answer = await generate_texts(TRANSLATE, generate, request, response, registry, settings)
    assert not isinstance(answer, Response)  # never streamed
    translated = [output.text for output in answer.outputs]
    alternatives = [[h.text for h in (output.hypotheses or [])[1:]] for output in answer.outputs]
    single = isinstance(body.q, str)
    return TranslateAnswer(translatedText=translated[0] if single else translated,
                           alternatives=(alternatives[0] if single else alternatives)
                           if body.alternatives else None)


def _pairs(registry: ModelRegistry) -> list[tuple[str, str]]:
    """(source, target) of each translation model, by the models' names."""
    return [entry.languages for entry in sorted(registry.entries, key=lambda e: e.name)
            if entry.task == TRANSLATE and entry.languages is not None]


def _model(registry: ModelRegistry, source: str, target: str) -> str:
    """The name of the first translation model (by name) from `source` into `target`."""
    for entry in sorted(registry.entries, key=lambda e: e.name):
        if entry.task == TRANSLATE and entry.languages == (source, target):
            return entry.name
    raise InvalidInput(f"no model translates {shorten(repr(source))} into {shorten(repr(target))}; "
                       "GET /languages lists the languages")


async def _fields(request: Request) -> Any:
    """The body's fields: a JSON object or a URL-encoded form (its last value of each field)."""
    raw = await request.body()
    if media_type(request.headers.get("content-type")) == FORM:
        try:
            form = urllib.parse.parse_qs(raw.decode("utf-8"), keep_blank_values=True, errors="strict",
                                         max_num_fields=MAX_FORM_FIELDS)
        except (UnicodeDecodeError, ValueError):
            raise InvalidInput(f"the form is not UTF-8 text of at most {MAX_FORM_FIELDS} fields") from None
        return {name: values[-1] for name, values in form.items()}
    if not is_json(request.headers.get("content-type")):
        raise HTTPException(415, f"the body must be JSON or a form ({FORM})")
    fields = load_json(raw)
    if not isinstance(fields, dict):
        raise InvalidInput("the request body must be a JSON object")
    return fields


def _validated(fields: Any) -> TranslateBody:
    try:
        return TranslateBody.model_validate(fields)
    except ValidationError as error:
        raise InvalidInput(describe_validation_errors(error.errors())) from None
