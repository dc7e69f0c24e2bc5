"""The one stopping rule of every decoding loop."""

from __future__ import annotations

from model.stopping import CANCELLED, EOS, LENGTH, StoppingCriteria


def test_eos_then_the_token_limit_then_cancellation() -> None:
    stop = StoppingCriteria(eos_id=3, max_new_tokens=2)
    assert stop(3, 0) == EOS
    assert stop(3, 1, cancelled=True) == EOS  # EOS wins: the row ended on its own
    assert stop(7, 0) is None
    assert stop(7, 1) == LENGTH  # its second token: the limit
    assert stop(7, 0, cancelled=True) == CANCELLED
    assert stop(7, 1, cancelled=True) == LENGTH
    assert StoppingCriteria(eos_id=3, max_new_tokens=1)(9, 0) == LENGTH
