"""What each generated token adds to the output's text, as a client sees the text grow: the
rule of the streamed deltas (`service.api.streaming`) and of `token_texts` (`/v1`'s
`return_scores`, OpenAI's `logprobs`).

A token's delta is the new end of the text decoded so far; it is empty while the text does not
extend what was given before (a byte piece that is only part of a character decodes to U+FFFD,
and the tokenizer strips a space at the end until a word follows). The deltas of a whole output
join to its text: what the last token leaves undelivered goes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class Deltas:
    """The text given so far and the rule for what a longer text adds to it."""

    def __init__(self) -> None:
        self.sent = ""  # the concatenation of the deltas given

    def delta(self, text: str) -> str:
        """The new end of `text`; empty while it does not extend what was given."""
        if not text.startswith(self.sent) or text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def token_texts(tokenizer: Decoder, ids: Sequence[int]) -> list[str]:
    """What each of `ids` adds to their decoded text, by the module's rule; they join to it."""
    deltas = Deltas()
    found = [deltas.delta(tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]
    whole = tokenizer.decode(ids)
    if found and whole.startswith(deltas.sent):
        found[-1] += whole[len(deltas.sent):]
    return found
