"""What a row asks of the decoding loop while it decodes: its tokens as they come, a flag that
takes it out of the batch at the next decoder step, the tokens its output must start with,
whether its tokens' log-probabilities and several hypotheses are returned, and its sampler when
its tokens are drawn rather than the most likely."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.generation.sampling import Sampler


@dataclass
class RowHooks:
    """A row's hooks, read in the worker thread: `on_token` sees each token kept (greedy), and
    `cancel` set ends the row with finish reason "cancelled" at the next step.

    `prefix`: tokens the decoder is forced through first (its output starts with them; they
    count towards its token limit). `scores`: its result carries each output token's
    log-probability (`GenerationResult.token_scores`) and their sum (`log_prob`).
    `hypotheses`: beam search returns this many finished hypotheses, best first
    (`GenerationResult.hypotheses`). `sampler`: each token after the prefix is drawn by it
    (`service.generation.sampling`) instead of being the most likely; greedy rows only."""

    on_token: Callable[[int], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    prefix: tuple[int, ...] = ()
    scores: bool = False
    hypotheses: int = 1
    sampler: Sampler | None = None

    @property
    def cancelled(self) -> bool:
        """Whether the row should leave the batch at the next decoder step."""
        return self.cancel.is_set()
