"""The decoding options of a generation request beyond its beam size and token limit: scores,
n-best hypotheses, a target prefix and sampling, for `/v1/translate`, `/v1/summarize` (plain and
streamed) and the KServe v2 infer route.

- `return_scores`: each output's `score` is the sum of the log-probabilities (natural log) of
  its tokens and of `</s>` when it ended with one (finish_reason "eos"): the probability of the
  whole sequence, end included; `token_scores` has one log-probability per output token (`</s>`
  excluded), and `token_texts` what each of those tokens adds to the text
  (`service.api.detokenize`). The same for greedy and beam search; beam search ranks by the
  length-normalised score instead.
- `num_hypotheses` n (at most `beam_size`): `hypotheses`, the n best finished hypotheses of the
  beam search, best first in the beam's own order (score / tokens counting `</s>`), each with
  its text, score, finish reason and token count (and `token_scores` with `return_scores`); the
  first is the output itself. Greedy decoding (beam 1) has the one.
- `target_prefix`: text the output starts with. It is tokenized as a target text (the
  tokenizer's `encode_target_batch`, no `</s>`) and the decoder is fed its tokens as its first
  choices, greedy rows in the running batch beside the others, every beam alike; then it
  decodes freely. The output's text, tokens, scores and `output_tokens` include the prefix,
  which counts towards `max_new_tokens` and must leave at least one token to generate. A string
  applies to every text; a list (with `texts`) gives one prefix per text, `""` for none.

- `temperature` > 0: each output token is drawn (`service.generation.sampling`) rather than the
  most likely, from the model's distribution at that temperature, within the `top_k` most likely
  pieces and the `top_p` nucleus when given; `seed` makes the draws repeatable (text i draws
  from (seed, i)). Greedy decoding only (beam 1); it does not make texts whole, a long text's
  sentences each draw from their own row's generator. `top_k`, `top_p` and `seed` without a
  temperature are refused: they would change nothing.

The decoding loop sees these through each row's `RowHooks` (`prefix`, `scores`, `hypotheses`,
`sampler`); a request that asks none of them gets no hooks from here and decodes exactly as
before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.api.detokenize import token_texts
from service.api.schemas import Hypothesis
from service.core.errors import InvalidInput
from service.generation.hooks import RowHooks
from service.generation.sampling import Sampling
from service.runtime.protocol import Runtime


@dataclass(frozen=True)
class DecodeOptions:
    """What a request asks of decoding beyond beam size and token limit (default: nothing)."""

    scores: bool = False  # return_scores
    hypotheses: int | None = None  # num_hypotheses, when asked
    prefixes: tuple[tuple[int, ...], ...] = ()  # forced token ids, one per text (or none at all)
    sampling: Sampling | None = None  # temperature > 0: tokens drawn, not the most likely

    @property
    def per_text(self) -> bool:
        """Whether the request asks for something of each text's one output (scores,
        hypotheses, a prefix): its texts are then decoded whole, one row each, and its outputs
        carry `extras`."""
        return self.scores or self.hypotheses is not None or any(self.prefixes)

    @property
    def plain(self) -> bool:
        """Whether the request asks nothing of these options."""
        return not self.per_text and self.sampling is None

    def row_hooks(self, row: int, on_token: Callable[[int], None] | None = None) -> RowHooks:
        """The hooks of the request's `row`-th row (its `row`-th text when `per_text`)."""
        return RowHooks(on_token=on_token, prefix=self.prefixes[row] if self.prefixes else (),
                        scores=self.scores or self.hypotheses is not None,
                        hypotheses=self.hypotheses or 1,
                        sampler=self.sampling.sampler(row) if self.sampling is not None else None)

    def hooks(self, rows: int) -> list[RowHooks] | None:
        """The hooks of every row of a request that is not streamed; None for a plain one."""
        return None if self.plain else [self.row_hooks(row) for row in range(rows)]

    def extras(self, runtime: Runtime, result: Any) -> dict[str, Any]:
        """The output fields these options add to one generated row (`Output`)."""
        extra: dict[str, Any] = {}
        if self.scores:
            extra.update(_scores(runtime, result, with_tokens=True))
        if self.hypotheses is not None:
            found = getattr(result, "hypotheses", None) or (result,)
            extra["hypotheses"] = [
                Hypothesis(text=runtime.tokenizer.decode(h.tokens), finish_reason=h.finish_reason,
                           output_tokens=len(h.tokens), **_scores(runtime, h, with_tokens=self.scores))
                for h in found[: self.hypotheses]
            ]
        return extra


def _scores(runtime: Runtime, result: Any, with_tokens: bool) -> dict[str, Any]:
    """`score` and, `with_tokens`, `token_scores` and `token_texts` of a result that carries
    them."""
    found: dict[str, Any] = {}
    log_prob = getattr(result, "log_prob", None)
    if log_prob is not None:
        found["score"] = float(log_prob)
    token_scores = getattr(result, "token_scores", None)
    if with_tokens and token_scores is not None:
        found["token_scores"] = [float(s) for s in token_scores]
        found["token_texts"] = token_texts(runtime.tokenizer, result.tokens)
    return found


def whole_texts(*, return_scores: bool = False, num_hypotheses: int | None = None,
                target_prefix: str | Sequence[str] | None = None, maps: bool = False) -> bool:
    """Whether a request's texts are decoded whole, one row per text, instead of split into
    sentences (`service.api.documents`): the rule is that any of these options, or attention
    maps and alignments (`maps`), describes one output per text, so a request asking any of
    them is not split."""
    return return_scores or num_hypotheses is not None or target_prefix is not None or maps


def sampling(temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, beam_size: int = 1, where: str = "") -> Sampling | None:
    """A request's sampling settings, checked (`InvalidInput`; `where` prefixes the fields'
    names), or None when it decodes deterministically (no temperature, or 0)."""
    if not temperature:
        given = [name for name, value in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if value is not None]
        if given:
            raise InvalidInput(f"{where}{given[0]}: applies to sampling only; set {where}temperature > 0 "
                               f"(absent or 0: the most likely tokens)")
        return None
    if beam_size > 1:
        raise InvalidInput(f"{where}temperature: sampling draws one token per step; it does not go "
                           f"with beam_size {beam_size} (send beam_size 1, or temperature 0)")
    try:
        return Sampling(temperature, top_k, 1.0 if top_p is None else top_p, seed)
    except ValueError as error:  # out of range (the schemas' types already refuse it)
        raise InvalidInput(f"{where}{error}") from None


def decode_options(
    runtime: Runtime, texts: int, beam_size: int, max_new_tokens: int, *,
    return_scores: bool = False, num_hypotheses: int | None = None,
    target_prefix: str | Sequence[str] | None = None, where: str = "target_prefix",
    sampled: Sampling | None = None,
) -> DecodeOptions:
    """The options of a request of `texts` texts, checked (`InvalidInput`) and the prefixes
    tokenized; `max_new_tokens` is the request's limit, defaults applied; `sampled` its
    sampling settings (`sampling`), None for deterministic decoding."""
    if num_hypotheses is not None and not 1 <= num_hypotheses <= beam_size:
        raise InvalidInput(f"num_hypotheses: {num_hypotheses} asked, but beam_size {beam_size} "
                           f"gives at most {beam_size}")
    prefixes: tuple[tuple[int, ...], ...] = ()
    if target_prefix is not None:
        given = [target_prefix] * texts if isinstance(target_prefix, str) else list(target_prefix)
        if len(given) != texts:
            raise InvalidInput(f"{where}: {len(given)} prefixes for {texts} texts")
        names = [where] * texts if isinstance(target_prefix, str) else [f"{where}.{i}" for i in range(texts)]
        encoded = runtime.tokenizer.encode_target_batch(given)
        for name, ids in zip(names, encoded, strict=True):
            if len(ids) >= max_new_tokens:
                raise InvalidInput(f"{name}: {len(ids)} tokens; at most {max_new_tokens - 1} allowed, "
                                   f"to leave one of max_new_tokens ({max_new_tokens}) to generate")
        prefixes = tuple(tuple(int(i) for i in ids) for ids in encoded)
    return DecodeOptions(scores=return_scores, hypotheses=num_hypotheses, prefixes=prefixes, sampling=sampled)
