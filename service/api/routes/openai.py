"""OpenAI's API: `POST /v1/completions` and `POST /v1/chat/completions`, so that OpenAI's clients
(and the tools built on them) reach the models with only this server's address.

A completion's `prompt` (a text, or a list of texts) is the source the model translates or
summarizes; a chat completion's source is the text of its last message, which must be the
user's (the model is no chat model: earlier messages, a system prompt among them, do not
condition it). `model` names the model, of any task. Without `temperature` (or with 0) decoding
is deterministic: greedy, or with `n` > 1 (or `best_of` on completions) a beam search whose `n`
best finished hypotheses are the choices, best first; this differs from OpenAI, whose default
temperature is 1. With `temperature` > 0 each token is sampled (`/v1/translate`'s sampling,
`service.generation.sampling`), within the `top_p` nucleus and, as vLLM's extra field, the `top_k`
most likely tokens; `top_p` below 1 without a temperature samples at temperature 1; the `n`
choices of a prompt are `n` samples, and `seed` makes them repeatable. `max_tokens` (chat:
`max_completion_tokens` too) is the output's token limit, by default the server's. `stream`
answers one text with `n` 1 as OpenAI's chunks (`data: {json}` events, then `data: [DONE]`;
`stream_options.include_usage` adds a last chunk with the usage). `finish_reason` is "stop" when the model ended the output and "length" at the
token limit.

`logprobs` (chat: `true`; completions: 0) gives each choice's tokens with their
log-probabilities (`/v1/translate`'s `return_scores`: `token_texts`, `token_scores`), in
OpenAI's shapes; a token that completes no character is "".

What this server does not do is refused with a 400 that says so: stop sequences, penalties,
logit biases, the tokens' alternatives (`top_logprobs`, completions' `logprobs` above 0),
`logprobs` with `stream`, `echo`, `suffix`, `best_of` above `n` with sampling, tools, a response
format other than text, and non-text message parts. Fields OpenAI defines that change nothing here (`user`, `metadata`, `seed` without
sampling, ...) and unknown fields are ignored.

The texts take `/v1/translate`'s path (`service.api.routes.generate.generate_texts`): the limits,
long texts split into sentences, continuous batching, the deadline, the client's disconnect,
`Server-Timing`, metrics under the route's path. Errors have OpenAI's body,
`{"error": {"message", "type", "param", "code"}}`, with the server's statuses, bad input a 400;
a full queue's 429 carries `Retry-After`, which OpenAI's clients wait for before retrying.
`GET /v1/models` lists the models in OpenAI's shape too (`object`, `data`:
`service.api.routes.models`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from service.api import streaming
from service.api.errors import ProtocolRoute, describe_validation_errors
from service.api.routes.deps import JsonInferenceDep, Serving
from service.api.routes.generate import generate_texts
from service.api.schemas import (
    MAX_BEAM_SIZE,
    MAX_TEXTS,
    GenerateRequest,
    GenerateResponse,
    Hypothesis,
    Output,
    Seed,
    Temperature,
    TopK,
    TopP,
)
from service.core.errors import InvalidInput
from service.core.limits import MAX_NEW_TOKENS

MAX_MESSAGES = 256
FinishReason = Literal["stop", "length"]
FINISH_REASONS: dict[str, FinishReason] = {"eos": "stop", "length": "length"}


class OpenAIRoute(ProtocolRoute):
    """A route whose errors have OpenAI's body (bad input: 400)."""

    @staticmethod
    def body(message: str, error_type: str, status: int) -> Any:
        return _error(message, error_type, status)


def _error(message: str, error_type: str, status: int | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


router = APIRouter(tags=["openai"], route_class=OpenAIRoute)
ERROR: dict[str, Any] = {"content": {"application/json": {"example": _error("...", "invalid_input", 400)}}}
RESPONSES: dict[int | str, dict[str, Any]] = {
    code: ERROR for code in (400, 401, 404, 408, 413, 415, 429, 500, 503, 504)
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class Options(BaseModel):
    """The fields both routes share: the model, the choices, streaming, and OpenAI's sampling
    fields, each checked for a value this server honours (`refusals`)."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    n: int = Field(1, ge=1, le=MAX_BEAM_SIZE,
                   description="choices per prompt: n samples, or the n best hypotheses of a beam of n (or `best_of`)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = Field(None, description="above 0: sampled; 0 or absent: deterministic")
    top_p: TopP | None = Field(None, description="nucleus sampling; below 1 without temperature: sampled at 1")
    top_k: TopK | None = Field(None, description="vLLM's extra field: sample from the k most likely tokens")
    stop: str | list[str] | None = Field(None, description="not supported: absent or empty")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = Field(
        None, description="each choice's tokens and their log-probabilities: chat true, completions 0 "
        "(no alternatives)")
    seed: Seed | None = Field(None, description="with sampling: the same seed gives the same choices")
    user: str | None = None

    def sampling(self) -> dict[str, Any]:
        """`/v1/translate`'s sampling fields for this request (none: deterministic): at
        `temperature` when above 0, or at 1 when it is absent and `top_p` is below 1 (OpenAI's
        default temperature); `top_p`, `top_k` and `seed` with it."""
        temperature = self.temperature
        if temperature is None and self.top_p is not None and self.top_p < 1:
            temperature = 1.0
        if not temperature:
            return {}
        given = {"top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        return {"temperature": temperature, **{name: value for name, value in given.items() if value is not None}}

    def refusals(self) -> list[str]:
        """What the request asks that this server does not do, one reason each."""
        found = []
        if self.stop:
            found.append("stop: stop sequences are not supported; the output ends with the model's end of sequence")
        if self.presence_penalty or self.frequency_penalty:
            found.append("presence_penalty, frequency_penalty: penalties are not supported")
        if self.logit_bias:
            found.append("logit_bias: not supported")
        if self.stream and self.logprobs_asked():
            found.append("logprobs: not with stream here; the final event of POST /v1/translate's stream "
                         "with return_scores has them")
        return found

    def logprobs_asked(self) -> bool:
        """Whether the choices carry their tokens' log-probabilities."""
        return False


class CompletionRequest(Options):
    """`POST /v1/completions`' body."""

    def logprobs_asked(self) -> bool:
        """`logprobs`: 0 gives each token's own (more, the alternatives, is refused)."""
        return self.logprobs is not None and self.logprobs is not False

    # each text checked as `/v1/translate` checks its own (`_generate`)
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_TEXTS)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="default: the server's")
    best_of: int | None = Field(None, ge=1, le=MAX_BEAM_SIZE, description="the beam's width (at least n)")
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None


class ChatRequest(Options):
    """`POST /v1/chat/completions`' body."""

    def logprobs_asked(self) -> bool:
        """`logprobs: true` gives each token's own (`top_logprobs` above 0, the alternatives, is refused)."""
        return bool(self.logprobs)

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="default: the server's")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


STREAMED = {"text/event-stream": {"schema": {"type": "string"},
                                  "description": "with `stream`: OpenAI's chunks, then `data: [DONE]`"}}


@router.post("/v1/completions", response_model=CompletionResponse, responses={**RESPONSES, 200: {"content": STREAMED}})
async def completions(body: CompletionRequest, request: Request, response: Response,
                      serving: JsonInferenceDep) -> Any:
    """Translate or summarize `prompt` with `model`, as OpenAI's completions."""
    refused = body.refusals()
    if body.echo:
        refused.append("echo: not supported")
    if body.suffix:
        refused.append("suffix: not supported")
    if body.best_of is not None and body.best_of < body.n:
        refused.append("best_of: must be at least n")
    if body.best_of is not None and body.best_of > body.n and body.sampling():
        refused.append("best_of: with sampling the n samples are the choices; send best_of = n or leave it out")
    if body.logprobs_asked() and body.logprobs is not None and body.logprobs >= 1:
        refused.append("logprobs: the tokens' alternatives are not returned; send 0 for each token's own "
                       "log-probability")
    _refuse(refused)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    _check_stream(body, len(prompts))
    beams = max(body.n, body.best_of or 1)
    identity, created = f"cmpl-{_request_id(request)}", int(time.time())
    answer = await _answer(
        _generate(prompts, body, beams, body.max_tokens, ("prompt",)), request, response,
        serving, _Chunks("text_completion", identity, created, body.model, _include_usage(body)),
    )
    if isinstance(answer, Response):
        return answer
    sampled = bool(body.sampling())
    choices = [CompletionChoice(index=i * body.n + j, text=found.text, finish_reason=FINISH_REASONS[found.finish_reason],
                                logprobs=_completion_logprobs(found) if body.logprobs_asked() else None)
               for i, per_prompt in enumerate(_choices(answer, body.n, sampled)) for j, found in enumerate(per_prompt)]
    return CompletionResponse(id=identity, created=created, model=answer.model, choices=choices,
                              usage=_usage(answer, body.n, sampled))


@router.post("/v1/chat/completions", response_model=ChatResponse, responses={**RESPONSES, 200: {"content": STREAMED}})
async def chat_completions(body: ChatRequest, request: Request, response: Response,
                           serving: JsonInferenceDep) -> Any:
    """Translate or summarize the last (user's) message with `model`, as OpenAI's chat completions."""
    refused = body.refusals()
    if body.top_logprobs:
        refused.append("top_logprobs: the tokens' alternatives are not returned; send 0 or leave it out "
                       "(logprobs: true gives each token's own)")
    if body.tools or body.functions or body.tool_choice not in (None, "none"):
        refused.append("tools: the model calls no tools")
    if body.response_format is not None and body.response_format.get("type") != "text":
        refused.append("response_format: text only")
    _refuse(refused)
    source = _source(body.messages)
    _check_stream(body, 1)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    identity, created = f"chatcmpl-{_request_id(request)}", int(time.time())
    answer = await _answer(
        _generate([source], body, body.n, limit, ("messages", len(body.messages) - 1, "content")), request, response,
        serving, _Chunks("chat.completion.chunk", identity, created, body.model, _include_usage(body)),
    )
    if isinstance(answer, Response):
        return answer
    sampled = bool(body.sampling())
    [per_prompt] = _choices(answer, body.n, sampled)
    choices = [ChatChoice(index=j, message=AssistantMessage(content=found.text),
                          finish_reason=FINISH_REASONS[found.finish_reason],
                          logprobs=_chat_logprobs(found) if body.logprobs_asked() else None)
               for j, found in enumerate(per_prompt)]
    return ChatResponse(id=identity, created=created, model=answer.model, choices=choices,
                        usage=_usage(answer, body.n, sampled))


async def _answer(body: GenerateRequest, request: Request, response: Response, serving: Serving,
                  chunks: _Chunks) -> GenerateResponse | Response:
    """`/v1/translate`'s work for `body` (a stream written as `chunks`); its token limit's
    refusal names OpenAI's field."""
    try:
        return await generate_texts(None, body, request, response, serving.registry, serving.settings, chunks)
    except InvalidInput as error:
        if error.message.startswith("max_new_tokens:"):
            raise InvalidInput("max_tokens:" + error.message.removeprefix("max_new_tokens:")) from None
        raise


def _request_id(request: Request) -> str:
    """The request's id (its `X-Request-ID`), which names the completion."""
    return str(request.scope.get("state", {}).get("request_id", ""))


def _refuse(reasons: list[str]) -> None:
    if reasons:
        raise InvalidInput("; ".join(reasons))


def _check_stream(body: Options, texts: int) -> None:
    if body.stream and (texts != 1 or body.n != 1):
        raise InvalidInput("stream: one prompt and n = 1 only")


def _include_usage(body: Options) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _source(messages: list[Message]) -> str:
    """The text of the last message, which must be the user's."""
    last = messages[-1]
    if last.role != "user":
        raise InvalidInput(f"messages: the last message must be the user's (the text to answer), not {last.role!r}")
    if last.content is None or isinstance(last.content, str):
        text = last.content or ""
    else:
        if any(part.type != "text" or part.text is None for part in last.content):
            raise InvalidInput("messages: only text parts are supported")
        text = "".join(part.text or "" for part in last.content)
    return text


def _generate(texts: list[str], body: Options, beams: int, max_tokens: int | None,
              where: tuple[str | int, ...]) -> GenerateRequest:
    """`/v1/translate`'s request for these texts, validated as it validates its own; a text's
    errors are located at `where` (and the prompt's index when there are several). Sampled,
    each text is sent `n` times, greedy rows whose draws differ (row i draws from the seed and
    i); else a beam of `beams` gives the `n` best."""
    sampled = body.sampling()
    n, stream = body.n, body.stream
    fields: dict[str, Any] = {"texts": texts, "model": body.model, "beam_size": beams, "stream": stream}
    if body.logprobs_asked():
        fields["return_scores"] = True
    if sampled:
        fields.update(sampled, texts=[text for text in texts for _ in range(n)], beam_size=1)
    elif n > 1:
        fields["num_hypotheses"] = n
    if max_tokens is not None:
        fields["max_new_tokens"] = max_tokens
    if stream:
        fields = {"text": texts[0], **{k: v for k, v in fields.items() if k != "texts"}}
    try:
        return GenerateRequest.model_validate(fields)
    except ValidationError as error:
        index = slice(1, None) if len(texts) > 1 else slice(2, None)  # a lone text's index dropped
        errors = [{**e, "loc": (*where, *_prompt_index(e["loc"][index], n if sampled else 1))}
                  if e.get("loc") and e["loc"][0] in ("text", "texts") else e for e in error.errors()]
        raise InvalidInput(describe_validation_errors(errors)) from None


def _prompt_index(loc: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    """An error's location in the texts sent (each prompt `n` times when sampled) as a location
    in the prompts."""
    return (loc[0] // n, *loc[1:]) if loc and isinstance(loc[0], int) else loc


def _choices(answer: GenerateResponse, n: int, sampled: bool) -> list[list[Output | Hypothesis]]:
    """Per prompt, its n choices: its n samples, the output, or its n best hypotheses."""
    if sampled:
        return [list(answer.outputs[i:i + n]) for i in range(0, len(answer.outputs), n)]
    if n == 1:
        return [[output] for output in answer.outputs]
    return [list((output.hypotheses or [])[:n]) for output in answer.outputs]


def _completion_logprobs(found: Output | Hypothesis) -> CompletionLogprobs:
    """A completion choice's `logprobs`: its tokens' texts, log-probabilities and offsets in its text."""
    texts, scores = found.token_texts or [], found.token_scores or []
    offsets = [sum(len(text) for text in texts[:i]) for i in range(len(texts))]
    return CompletionLogprobs(tokens=texts, token_logprobs=scores, text_offset=offsets)


def _chat_logprobs(found: Output | Hypothesis) -> ChatLogprobs:
    """A chat choice's `logprobs`: each token's text, log-probability and UTF-8 bytes."""
    return ChatLogprobs(content=[TokenLogprob(token=text, logprob=score, bytes=list(text.encode()))
                                 for text, score in zip(found.token_texts or [], found.token_scores or [], strict=True)])


def _usage(answer: GenerateResponse, n: int, sampled: bool) -> Usage:
    """The prompts' tokens (each prompt once) and those of every choice."""
    if sampled:
        prompt = sum(output.input_tokens for output in answer.outputs[::n])
        completion = answer.usage.output_tokens
    elif n == 1:
        prompt, completion = answer.usage.input_tokens, answer.usage.output_tokens
    else:
        prompt = answer.usage.input_tokens
        completion = sum(h.output_tokens for output in answer.outputs for h in (output.hypotheses or [])[:n])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Chunks(streaming.Events):
    """A stream as OpenAI's chunks of `kind` ("text_completion" or "chat.completion.chunk")."""

    def __init__(self, kind: str, identity: str, created: int, model: str, include_usage: bool) -> None:
        self.kind, self.identity, self.created, self.model = kind, identity, created, model
        self.include_usage = include_usage

    def _chunk(self, delta: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "text_completion":
            choice.update(text=delta or "", logprobs=None)
        else:
            message: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                message["content"] = delta
            choice.update(delta=message, logprobs=None)
        choice["finish_reason"] = finish_reason
        return streaming.event({"id": self.identity, "object": self.kind, "created": self.created,
                                "model": self.model, "choices": [choice]})

    def opening(self) -> bytes:
        return b"" if self.kind == "text_completion" else self._chunk("", None, role=True)

    def token(self, data: dict[str, Any]) -> bytes:
        return self._chunk(data["delta"], None) if data["delta"] else b""

    def final(self, data: dict[str, Any]) -> bytes:
        output = data["output"]
        end = self._chunk(data["delta"] or None, FINISH_REASONS[output["finish_reason"]])
        if self.include_usage:
            usage = data["usage"]
            end += streaming.event({
                "id": self.identity, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [], "usage": Usage(prompt_tokens=usage["input_tokens"],
                                              completion_tokens=usage["output_tokens"],
                                              total_tokens=usage["input_tokens"] + usage["output_tokens"]).model_dump()})
        return end + b"data: [DONE]\n\n"

    def error(self, message: str, error_type: str) -> bytes:
        return streaming.event(_error(message, error_type)) + b"data: [DONE]\n\n"
