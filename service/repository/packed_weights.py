"""fp32 weight files whose every value is a bfloat16 number, stored at half the size.

The exporter rounds the weights to bfloat16 (so the graphs hold exactly the numbers of
checkpoint.safetensors) and keeps them as float32 in the graphs, which CPU kernels run fastest.
The low 16 bits of every such float32 are zero, so the external-data file (tensors and their
zero alignment padding) is stored as its upper halves only, `weights.bf16`, and expanded back
to the exact original bytes when a session is built. numpy only: the service imports this.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PACKED_SUFFIX = ".bf16"  # weights.bin -> weights.bin.bf16
ENCODING = "bfloat16-upper-halves"


class NotBfloat16(ValueError):
    """The data is not a sequence of float32 words whose low 16 bits are zero."""


def pack(raw: bytes) -> bytes:
    """The upper 16 bits of each little-endian float32 word of `raw`; raises `NotBfloat16`
    when packing would lose anything (a length not divisible by 4, a non-zero low half)."""
    if len(raw) % 4:
        raise NotBfloat16(f"{len(raw)} bytes is not a whole number of float32 words")
    words = np.frombuffer(raw, dtype="<u4")
    if np.any(words & 0xFFFF):
        raise NotBfloat16("some float32 words have non-zero low 16 bits (not bfloat16 values)")
    return (words >> 16).astype("<u2").tobytes()


def unpack(packed: bytes) -> np.ndarray:
    """The original float32 file bytes of `pack`'s output, as a uint8 array (a buffer
    onnxruntime reads external data from)."""
    halves = np.frombuffer(packed, dtype="<u2")
    return (halves.astype("<u4") << 16).view(np.uint8)


def packed_name(file_name: str) -> str:
    """Where the packed form of an external-data file is stored."""
    return file_name + PACKED_SUFFIX


def read_unpacked(path: str | Path) -> np.ndarray:
    """Read a packed file and expand it (see `unpack`)."""
    return unpack(Path(path).read_bytes())
