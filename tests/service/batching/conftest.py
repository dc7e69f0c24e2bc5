"""Fixtures of the batching tests."""

from __future__ import annotations

import pytest

EOS = 3


@pytest.fixture(scope="module")
def sources(trained_tiny) -> list[list[int]]:
    """Validation sources of varied lengths plus two long ones the model does not stop on (a
    module's own `sources` takes precedence)."""
    return ([s + [EOS] for s in trained_tiny.valid.sources[:14]]
            + [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, EOS], [19] * 10 + [EOS]])
