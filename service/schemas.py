"""Transport schemas of the HTTP API: what goes over the wire, with its hard limits.

The limits here are ceilings fixed in code; the configured ones (`Settings.max_texts`,
`max_text_chars`, the model's token limits) are at most these and are checked after parsing,
with the same 422 error body. Internal types (batch items, generations) live elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

MAX_TEXTS = 256
MAX_TEXT_CHARS = 100_000
MAX_BEAM_SIZE = 8
MAX_NEW_TOKENS = 4096

Text = Annotated[StrictStr, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
FinishReason = Literal["eos", "length"]


class GenerateRequest(BaseModel):
    """Body of `POST /v1/translate` and `POST /v1/summarize`: `text` or `texts`, and options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Text | None = None
    texts: Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS)] | None = None
    model: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = Field(
        None, description="defaults to the route's task's model"
    )
    beam_size: int = Field(default=1, ge=1, le=MAX_BEAM_SIZE)
    max_new_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="defaults to the server's setting"
    )
    return_attention: bool = Field(default=False, description="not supported here yet")
    stream: bool = Field(default=False, description="not supported yet")

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of `text` and `texts`")
        if self.return_attention:
            raise ValueError("`return_attention` is not supported here; use /v1/attention")
        if self.stream:
            raise ValueError("`stream` is not supported yet")
        return self

    @property
    def inputs(self) -> list[str]:
        """The texts of the request, as a list even for one `text`."""
        return self.texts if self.texts is not None else [self.text or ""]


class Output(BaseModel):
    """One generated text."""

    text: str
    finish_reason: FinishReason
    input_tokens: int
    output_tokens: int


class Usage(BaseModel):
    """Token counts of the whole request."""

    input_tokens: int
    output_tokens: int


class GenerateResponse(BaseModel):
    """Response of the generation routes: always a list of outputs, in input order."""

    model: str
    outputs: list[Output]
    usage: Usage


class ErrorBody(BaseModel):
    """The one error body of every route."""

    error: str
    error_type: str


class BatchCounters(BaseModel):
    """What a model's batcher has run since start."""

    batches: int
    rows: int
    max_batch_rows: int


class ModelCard(BaseModel):
    """One model of `GET /v1/models`."""

    name: str
    task: str | None
    state: Literal["loading", "ready", "failed"]
    ready: bool
    provider: str | None
    variant: str | None
    max_source_len: int | None
    max_target_len: int | None
    error: str | None
    batching: BatchCounters


class ModelList(BaseModel):
    """Body of `GET /v1/models`."""

    models: list[ModelCard]


class Health(BaseModel):
    """Body of the health routes when they answer 200."""

    status: Literal["live", "ready"]
    models: dict[str, bool] = Field(default_factory=dict)
