"""The in-flight batch contract: the rows decoding together, which newcomers join between two
decoder steps and which each row leaves the moment it stops.

In the spirit of TGI's `Batch`: `concatenate` adds newcomers (encoded here, in groups of
similar source length), `filter` keeps only the rows of the given owners, and `generate_token`
runs one decoder step for every row and returns the rows that stopped, by the one rule of
`model.stopping.StoppingCriteria` (EOS, the row's token limit, its request cancelled). A row's
hooks may force its first tokens (`RowHooks.prefix`: fed as the step's choice while they last),
draw its tokens rather than take the most likely (`RowHooks.sampler`), and ask for its tokens'
log-probabilities (`RowHooks.scores`), computed for those rows only (`choose`). Two
batches implement it: `service.batching.slot_batch.SlotBatch` on the step graph (each row's
cache in its own slot) and `service.batching.running_batch.RunningBatch` on the merged decoder
(every row's cache padded to the oldest row's, `pads_to_oldest`). The batch is changed in
place; its owner (`service.batching.batcher.Batcher`) keeps it while it lives.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from model.stopping import EOS, StoppingCriteria
from service.generation.hooks import RowHooks
from service.generation.sampling import Sampler
from service.generation.search import GenerationResult, pick
from service.runtime import EncoderState
from service.runtime.protocol import Runtime

Owner = TypeVar("Owner")


class InFlightBatch(Protocol[Owner]):
    """What the batcher uses of an in-flight batch (owners are its rows)."""

    # True when every row's cache is padded to the oldest row's (the join age limit applies)
    pads_to_oldest: bool
    # True when beam-search rows join it too (`concatenate`'s `beam_sizes`), one row per beam
    takes_beams: bool

    def __len__(self) -> int: ...
    @property
    def owners(self) -> list[Owner]: ...
    @property
    def oldest_age(self) -> int: ...
    @property
    def cache_bytes(self) -> int: ...  # bytes of the keys/values it holds, on the host or the device
    def concatenate(self, sources: Sequence[list[int]], owners: Sequence[Owner], max_new_tokens: Sequence[int],
                    hooks: Sequence[RowHooks | None] | None = None,
                    beam_sizes: Sequence[int] | None = None) -> None: ...
    def filter(self, owners: Collection[Owner]) -> list[Owner]: ...
    def generate_token(self) -> list[tuple[Owner, GenerationResult]]: ...


@dataclass(eq=False)
class Member(Generic[Owner]):
    """One row of a running batch (`RunningBatch`, `SlotBatch`) and what it has decoded so far."""

    owner: Owner
    max_new_tokens: int
    hooks: RowHooks | None
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0  # summed log-probability of `tokens` (0 without the batch's `scores` or the row's ask)
    prefix: tuple[int, ...] = ()  # the tokens its output is forced to start with
    token_scores: list[float] | None = None  # each token's log-probability, when the row asks

    @classmethod
    def of(cls, owner: Owner, max_new_tokens: int, hooks: RowHooks | None) -> Member[Owner]:
        """A new row with what its hooks ask (a forced prefix, scores)."""
        if hooks is None or (not hooks.prefix and not hooks.scores):
            return cls(owner, max_new_tokens, hooks)
        return cls(owner, max_new_tokens, hooks, prefix=hooks.prefix,
                   token_scores=[] if hooks.scores else None)


def newcomer_order(sources: Sequence[list[int]]) -> list[int]:
    """The order newcomers take their slots in: by source length, ties in arrival order."""
    return sorted(range(len(sources)), key=lambda i: len(sources[i]))


def encode_newcomers(runtime: Runtime, sources: Sequence[list[int]], owners: Sequence[Owner],
                     max_new_tokens: Sequence[int], hooks: Sequence[RowHooks | None] | None,
                     padding_slack: float, encode: Callable[[list[list[int]]], EncoderState] | None = None,
                     ) -> tuple[list[EncoderState], list[Member[Owner]]]:
    """Check the newcomers, put them in `newcomer_order` and encode them in groups of similar
    length (`_length_groups`; each group by `encode`, default the runtime's encoder on the group
    padded to its longest); returns each group's encoder state and the members in that order."""
    if len(owners) != len(sources) or len(max_new_tokens) != len(sources):
        raise ValueError("one owner and one max_new_tokens per source")
    if any(not source for source in sources) or min(max_new_tokens) < 1:
        raise ValueError("every source needs its EOS and max_new_tokens >= 1")
    hooks = hooks if hooks is not None else [None] * len(sources)
    order = newcomer_order(sources)
    groups = _length_groups([len(sources[i]) for i in order], padding_slack)
    if encode is None:
        def encode(group: list[list[int]]) -> EncoderState:
            return runtime.encode(runtime.pad(group))
    states = [encode([sources[order[i]] for i in group]) for group in groups]
    return states, [Member.of(owners[i], max_new_tokens[i], hooks[i]) for i in order]


def choose(members: Sequence[Member[Owner] | None], logits: np.ndarray,
           scores: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row's token of this step from its (B, V) `logits` (None: a dead slot): the next
    token of its forced prefix while that lasts, else a draw of its sampler when it has one
    (`RowHooks.sampler`), else the argmax; and the log-probabilities
    (`service.generation.search.pick`) of every row with the batch's `scores`, else of the rows
    that ask for them only."""
    forced: list[tuple[int, int]] = []
    asking: list[int] = []
    sampled: list[tuple[int, Sampler]] = []
    for i, member in enumerate(members):
        if member is None:
            continue
        if member.prefix and len(member.tokens) < len(member.prefix):
            forced.append((i, member.prefix[len(member.tokens)]))
        elif member.hooks is not None and member.hooks.sampler is not None:
            sampled.append((i, member.hooks.sampler))
        if member.token_scores is not None:
            asking.append(i)
    return pick(logits, scores, forced, asking, sampled)


def advance(members: Sequence[Member[Owner] | None], best: np.ndarray, chosen: np.ndarray | None, eos: int,
            scores: bool) -> list[tuple[int, tuple[Owner, GenerationResult]]]:
    """Give each live row (None: a dead slot) its token of this step, `best[i]` (and its
    log-probability `chosen[i]`, when scored), and stop it by `StoppingCriteria`; returns the
    rows that finished, with their index."""
    finished: list[tuple[int, tuple[Owner, GenerationResult]]] = []
    rules: dict[int, StoppingCriteria] = {}  # one per token limit
    tokens = best.tolist()
    for i, member in enumerate(members):
        if member is None:
            continue
        token = tokens[i]
        asked = member.token_scores
        if chosen is not None and (scores or asked is not None):
            member.score += float(chosen[i])
        cancelled = member.hooks is not None and member.hooks.cancelled
        rule = rules.get(member.max_new_tokens)
        if rule is None:
            rule = rules[member.max_new_tokens] = StoppingCriteria(eos, member.max_new_tokens)
        reason = rule(token, len(member.tokens), cancelled)
        if reason != EOS:
            member.tokens.append(token)
            if asked is not None and chosen is not None:
                asked.append(float(chosen[i]))
            if member.hooks is not None and member.hooks.on_token is not None:
                member.hooks.on_token(token)
        if reason is not None:
            score = member.score if scores else None
            if asked is None:
                result = GenerationResult(member.tokens, reason, score)
            else:
                result = GenerationResult(member.tokens, reason, score, token_scores=tuple(asked),
                                          log_prob=member.score)
            finished.append((i, (member.owner, result)))
    return finished


def _length_groups(lengths: list[int], slack: float) -> list[list[int]]:
    """Split positions of ascending `lengths` into runs whose padded size (rows x longest) stays
    within `slack` x their real tokens: one encoder call per run, little padding."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for index, length in enumerate(lengths):
        if current and (len(current) + 1) * length > slack * (real + length):
            groups.append(current)
            current, real = [], 0
        current.append(index)
        real += length
    if current:
        groups.append(current)
    return groups


def dropped(owners: Sequence[Owner], keep: Collection[Owner]) -> list[int]:
    """Indices of the `owners` not in `keep` (what `filter` takes out)."""
    return [i for i, owner in enumerate(owners) if owner not in keep]
