"""Transport schemas of the HTTP API: what goes over the wire, with its hard limits.

The hard limits are the ceilings of `service.core.limits`; the configured ones (`Settings.max_texts`,
`max_text_chars`, the model's token limits) are at most these and are checked after parsing,
with the same 422 error body. Internal types (batch items, generations) live elsewhere.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, model_validator

from service.core.limits import (
    MAX_ATTENTION_INDICES,
    MAX_BEAM_SIZE,
    MAX_DECIMALS,
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    MAX_TIMEOUT_MS,
    MAX_TOP_K,
)

# Control characters but tab and newlines, and the surrogate code points (JSON "\ud800").
_REFUSED_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Refuse NUL, other control characters and lone surrogates, which no tokenizer should
    see; the message names the code point, never the text."""
    found = _REFUSED_CHARS.search(text)
    if found is not None:
        code = ord(found.group())
        kind = "lone surrogate" if 0xD800 <= code <= 0xDFFF else "control character"
        raise ValueError(f"the text holds a {kind} (U+{code:04X}) at {found.start()}")
    return text


Text = Annotated[
    StrictStr, Field(min_length=1, max_length=MAX_TEXT_CHARS), AfterValidator(clean_text)
]
# a target prefix: any text within the same limits, "" for none
PrefixText = Annotated[StrictStr, Field(max_length=MAX_TEXT_CHARS), AfterValidator(clean_text)]
# sampling (`service.generation.sampling`): absent or 0 temperature decodes deterministically
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=1, le=MAX_TOP_K)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
FinishReason = Literal["eos", "length"]
Task = Literal["translate", "summarize"]
AttentionKind = Literal["encoder", "decoder", "cross"]
Indices = Annotated[
    list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_ATTENTION_INDICES)
]


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
    return_attention: bool = Field(
        default=False,
        description="add to each output its cross-attention (last decoder layer, mean of the "
        "heads), one row per generated token (and `</s>` when it ended with one), one column "
        "per source token (and `</s>`), with the tokens of both",
    )
    return_alignment: bool = Field(
        default=False,
        description="add to each output its word alignment to the source (`alignment`): "
        "Pharaoh `i-j` links between whitespace-separated source and output words, with "
        "their character spans; with `stream`, in the final event's output",
    )
    stream: bool = Field(
        default=False,
        description="answer with Server-Sent Events: one event per generated token (greedy; "
        "beam search sends the final hypothesis's tokens), then a final event with the output "
        "and usage; one `text` only, without `return_attention`",
    )
    truncate: Annotated[int, Field(ge=1)] | bool | None = Field(
        None,
        description="summarization: keep the first `truncate` source tokens of each text (`true`: "
        "as many as the model takes) instead of refusing a longer text; outputs then report "
        "`truncated`. Translation splits long texts into sentences instead",
    )
    return_scores: bool = Field(
        default=False,
        description="add to each output its `score`, the summed log-probability of its tokens "
        "and of `</s>` when it ended with one, and `token_scores`, one log-probability per "
        "output token; with `stream`, in the final event's output",
    )
    num_hypotheses: int | None = Field(
        None, ge=1, le=MAX_BEAM_SIZE,
        description="add to each output `hypotheses`, the beam search's best finished "
        "hypotheses (at most `beam_size`), best first by the beam's own rank, each with its score",
    )
    target_prefix: PrefixText | Annotated[list[PrefixText], Field(min_length=1, max_length=MAX_TEXTS)] | None = Field(
        None,
        description="text each output starts with (the decoder is forced through its tokens, "
        "which count towards `max_new_tokens`); a string for every text, or with `texts` a "
        "list of one prefix per text (\"\" for none)",
    )
    temperature: Temperature | None = Field(
        None,
        description="above 0: sample each output token from the model's distribution at this "
        "temperature instead of taking the most likely (greedy decoding only, `beam_size` 1); "
        "absent or 0: deterministic decoding",
    )
    top_k: TopK | None = Field(None, description="with `temperature`: draw from the k most likely tokens only")
    top_p: TopP | None = Field(
        None, description="with `temperature`: draw from the smallest set of the most likely tokens "
        "whose probability reaches `top_p` (nucleus sampling)",
    )
    seed: Seed | None = Field(
        None, description="with `temperature`: the same seed, texts and settings give the same outputs "
        "(text i draws from the seed and i)",
    )
    timeout_ms: int | None = Field(
        None, ge=1, le=MAX_TIMEOUT_MS,
        description="deadline of this request in milliseconds (also the X-Request-Timeout-Ms "
        "header); at most the server's request_timeout_s; 504 when it passes",
    )

    @model_validator(mode="after")
    def _one_input(self) -> Self:
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of `text` and `texts`")
        if self.stream and self.texts is not None:
            raise ValueError("`stream` takes one `text`, not `texts`")
        if self.stream and self.return_attention:
            raise ValueError("`stream` and `return_attention` do not go together")
        if self.num_hypotheses is not None and self.num_hypotheses > self.beam_size:
            raise ValueError(f"`num_hypotheses` ({self.num_hypotheses}) may be at most `beam_size` "
                             f"({self.beam_size})")
        if isinstance(self.target_prefix, list) and (self.texts is None
                                                     or len(self.target_prefix) != len(self.texts)):
            raise ValueError("a list `target_prefix` needs `texts`, one prefix per text")
        return self

    @property
    def inputs(self) -> list[str]:
        """The texts of the request, as a list even for one `text`."""
        return self.texts if self.texts is not None else [self.text or ""]


class Token(BaseModel):
    """A SentencePiece piece and the characters `text[start:end]` it stands for.

    `▁` in a piece is a space; special pieces (`</s>`) span no characters (start == end).
    """

    piece: str
    start: int
    end: int


class WordSpan(BaseModel):
    """A whitespace-separated word (punctuation included) and its characters `text[start:end]`."""

    word: str
    start: int
    end: int


class WordAlignment(BaseModel):
    """Hard links between the source's and the target's words, read from cross-attention
    (`service.generation.alignment`): `links` `[i, j]` join source word i and target word j
    (0-based, sorted); `pharaoh` is the same as `"i-j i-j ..."`; words may have no link."""

    pharaoh: str
    links: list[tuple[int, int]]
    source_words: list[WordSpan]
    target_words: list[WordSpan]


class Hypothesis(BaseModel):
    """One of the best finished hypotheses of a beam search (`num_hypotheses`)."""

    text: str
    score: float | None = Field(None, description="summed log-probability, `</s>` included")
    finish_reason: FinishReason
    output_tokens: int
    token_scores: list[float] | None = Field(None, description="with `return_scores`")
    token_texts: list[str] | None = Field(None, description="with `return_scores`: what each token adds to `text`")


class Output(BaseModel):
    """One generated text; the attention fields only when `return_attention` was asked, the
    alignment only with `return_alignment`, the scores with `return_scores`, the hypotheses
    with `num_hypotheses`."""

    text: str
    finish_reason: FinishReason
    input_tokens: int
    output_tokens: int
    truncated: bool | None = Field(
        None, description="with `truncate`: whether the text was cut to fit"
    )
    attention: list[list[float]] | None = Field(
        None, description="[target token][source token]: last decoder layer, mean of heads"
    )
    source_tokens: list[Token] | None = None
    target_tokens: list[Token] | None = None
    alignment: WordAlignment | None = None
    score: float | None = Field(None, description="summed log-probability of the output's "
                                "tokens and of `</s>` when it ended with one")
    token_scores: list[float] | None = Field(None, description="log-probability of each output token")
    token_texts: list[str] | None = Field(
        None, description="with `return_scores`: what each output token adds to `text` (one per "
        "`token_scores`; they join to `text`, a token that completes no character adding \"\")",
    )
    hypotheses: list[Hypothesis] | None = None


class Usage(BaseModel):
    """Token counts of the whole request."""

    input_tokens: int
    output_tokens: int


class GenerateResponse(BaseModel):
    """Response of the generation routes: always a list of outputs, in input order."""

    model: str
    outputs: list[Output]
    usage: Usage


def _cross_only() -> list[AttentionKind]:
    return ["cross"]


class AttentionRequest(BaseModel):
    """Body of `POST /v1/attention`: the attention maps of a source and a target.

    Without `target`, the model's greedy output is the target (and is returned). The maps come
    from one teacher-forced pass over the decoder input `<s>` + target.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    source: Text
    target: Text | None = Field(None, description="teacher-forced; generated when absent")
    model: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = Field(
        None, description="defaults to the task's model"
    )
    task: Task | None = Field(None, description="the model's task; translate by default")
    kinds: Annotated[list[AttentionKind], Field(min_length=1, max_length=3)] = Field(
        default_factory=_cross_only
    )
    layers: Indices | None = Field(None, description="layer indices, in this order; all if absent")
    heads: Indices | None = Field(None, description="head indices, in this order; all if absent")
    average_heads: bool = Field(
        default=False, description="one mean over the (selected) heads in place of the heads"
    )
    decimals: int = Field(default=4, ge=1, le=MAX_DECIMALS, description="weights rounded to")
    alignment: bool = Field(
        default=False, description="add the word alignment of source and target (`alignment`), "
        "from every layer's cross-attention of the same pass, whatever `kinds` and `layers` ask"
    )

    @model_validator(mode="after")
    def _no_repeats(self) -> Self:
        for name in ("kinds", "layers", "heads"):
            values = getattr(self, name)
            if values is not None and len(set(values)) != len(values):
                raise ValueError(f"`{name}` lists a value twice")
        return self


class AttentionResponse(BaseModel):
    """Response of `POST /v1/attention`; `attention` holds only the kinds asked for.

    Each kind is `[layer][head][query][key]`: encoder `[source][source]`, decoder
    `[target][target]` (zero above the diagonal), cross `[target][source]`. Source tokens are
    the source's pieces, then `</s>`. The decoder's position i reads `<s>` + target[:i] and is
    labelled by the token it predicts, `target_tokens[i]`: the target's pieces, then `</s>`.
    """

    model: str
    source_tokens: list[Token]
    target_tokens: list[Token]
    target_text: str = Field(description="the target given, or the one generated")
    generated: bool = Field(description="whether the model generated the target")
    layers: dict[AttentionKind, list[int]] = Field(description="layer indices of each kind")
    heads: list[int] = Field(description="head indices (averaged into one with average_heads)")
    average_heads: bool
    attention: dict[AttentionKind, list[list[list[list[float]]]]]
    alignment: WordAlignment | None = Field(None, description="only when `alignment` was asked")


class ErrorBody(BaseModel):
    """The one error body of every route."""

    error: str
    error_type: str


class BatchCounters(BaseModel):
    """What a model's batchers have run since start, together (in the process that answers)."""

    continuous: bool = Field(
        default=False, description="greedy rows join the running batch between decoder steps"
    )
    workers: int = Field(default=0, description="batch workers: each runs its own batches")
    processes: int = Field(
        default=1, description="server processes (`--workers`), each with its own batch workers: with "
        "more than one, the counters are those of the process that answered (`/metrics` adds them up)",
    )
    shortlist_rows: int = Field(
        default=0, description="continuous: steps of at most this many rows compute only the "
        "logits of the batch's vocabulary shortlist (0: every step computes the whole vocabulary)",
    )
    batches: int = Field(description="batches run (continuous: times rows joined the running one)")
    rows: int
    max_batch_rows: int
    cancelled: int = Field(description="rows cancelled because their request stopped waiting "
                           "(client gone, deadline passed)")
    running: int = Field(description="rows of the batches generating now (cancelled ones excluded)")
    cache_bytes: int = Field(
        default=0, description="continuous: bytes the running batches' keys/values hold now (every "
        "slot's cache and cross keys/values, on the host or the device)",
    )
    max_cache_bytes: int = Field(default=0, description="continuous: the most bytes they held at once")


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
    step_graph: bool | None = Field(
        default=None, description="continuous batching runs on the step graph (else on the merged decoder)")
    lone_step: bool | None = Field(
        default=None, description="a request alone in its running batch decodes in the lone slot (the step "
        "graph at fixed dimensions; on CUDA replayed as a CUDA graph)")
    gpu_memory_limit_mb: int | None = Field(
        default=None, description="cap of each CUDA session's memory arena in MiB (on CUDA; 0 = none)")
    error: str | None
    batching: BatchCounters


class OpenAIModel(BaseModel):
    """One model of `GET /v1/models` as OpenAI's clients read it."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when the list was made (Unix seconds)")
    owned_by: str = "attnserve"


class ModelList(BaseModel):
    """Body of `GET /v1/models`: the models, and the same names in OpenAI's shape (`object`,
    `data`) for its clients."""

    models: list[ModelCard]
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class Health(BaseModel):
    """Body of the health routes when they answer 200."""

    status: Literal["live", "ready"]
    models: dict[str, bool] = Field(default_factory=dict)
