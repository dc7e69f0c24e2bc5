"""What a row asks of the decoding loop while it decodes: its tokens as they come, and a flag
that takes it out of the batch at the next decoder step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RowHooks:
    """A row's hooks, read in the worker thread: `on_token` sees each token kept (greedy), and
    `cancel` set ends the row with finish reason "cancelled" at the next step."""

    on_token: Callable[[int], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        """Whether the row should leave the batch at the next decoder step."""
        return self.cancel.is_set()
