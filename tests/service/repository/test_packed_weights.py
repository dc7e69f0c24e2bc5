"""Packed bfloat16 weight files: exact round trip, refusal of anything lossy, and a repository
served from its packed fp32 weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.repository import packed_weights
from service.repository.manifest import read_manifest


def _bf16_exact(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def test_round_trip_is_exact_and_half_the_size() -> None:
    weights = _bf16_exact(np.random.default_rng(0).standard_normal(1000)).tobytes() + b"\0" * 64
    packed = packed_weights.pack(weights)
    assert len(packed) == len(weights) // 2
    assert packed_weights.unpack(packed).tobytes() == weights


@pytest.mark.parametrize("raw", [np.float32([1.0, 0.1]).tobytes(), b"\0" * 6],
                         ids=["not-bfloat16", "not-whole-words"])
def test_lossy_packing_is_refused(raw: bytes) -> None:
    with pytest.raises(packed_weights.NotBfloat16):
        packed_weights.pack(raw)


def test_repository_fp32_weights_are_packed_and_serve_equal_to_pytorch(tiny_model_repository: Path,
                                                                      tiny_runtime) -> None:
    """The fp32 variant stores only the packed file; the runtime expands it in memory, and the
    graphs then hold exactly the checkpoint's numbers (the export's parity check passed)."""
    manifest = read_manifest(tiny_model_repository)
    assert not (tiny_model_repository / "weights.bin").exists()
    packed = tiny_model_repository / "weights.bin.bf16"
    unpacked = packed_weights.read_unpacked(packed)
    assert unpacked.nbytes == 2 * packed.stat().st_size
    assert manifest.exporter["parity"]["greedy_rows_identical"] >= 2
    assert tiny_runtime.variant == "fp32"
