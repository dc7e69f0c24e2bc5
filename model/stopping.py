"""When a generated row stops: one rule for every decoding loop (the PyTorch reference, the
service's greedy search and its in-flight batches). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

EOS, LENGTH, CANCELLED = "eos", "length", "cancelled"


@dataclass(frozen=True)
class StoppingCriteria:
    """A row stops when it picks EOS (not part of its output), once it holds `max_new_tokens`
    tokens, or when its request is cancelled: checked in that order after each decoder step."""

    eos_id: int
    max_new_tokens: int

    def __call__(self, token: int, generated: int, cancelled: bool = False) -> str | None:
        """The finish reason once a step picked `token` for a row that held `generated` tokens
        before it, or None when the row goes on."""
        if token == self.eos_id:
            return EOS
        if generated + 1 >= self.max_new_tokens:
            return LENGTH
        if cancelled:
            return CANCELLED
        return None
