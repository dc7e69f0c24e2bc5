"""A minimal writer of ONNX models (the protobuf wire format), for the tiny graphs the runtime
builds itself (`row_gather`, `device_slots`) without the onnx package, which is not a serving
dependency.

It writes what those graphs need and nothing more: nodes with int and int-list attributes,
graph inputs and outputs of a tensor type with named (dynamic) dimensions, one opset of the
default domain. Field numbers are those of onnx.proto (ModelProto, GraphProto, NodeProto,
AttributeProto, ValueInfoProto, TypeProto, TensorShapeProto).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# TensorProto.DataType values
FLOAT, INT8, INT64, BOOL, FLOAT16, DOUBLE = 1, 3, 7, 9, 10, 11

# ONNX element type of the numpy dtypes the runtime's buffers use, and back
ONNX_TYPES: dict[np.dtype, int] = {np.dtype(np.float32): FLOAT, np.dtype(np.float16): FLOAT16, np.dtype(np.float64): DOUBLE,
              np.dtype(np.int64): INT64, np.dtype(np.bool_): BOOL, np.dtype(np.int8): INT8}
NUMPY_TYPES: dict[int, np.dtype] = {onnx_type: dtype for dtype, onnx_type in ONNX_TYPES.items()}

_ATTRIBUTE_INT, _ATTRIBUTE_INTS = 2, 7  # AttributeProto.AttributeType


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values: two's complement, as protobuf writes them
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def integer(field_number: int, value: int) -> bytes:
    """A varint field."""
    return _varint(field_number << 3) + _varint(value)


def message(field_number: int, payload: bytes | str) -> bytes:
    """A length-delimited field: a string or an embedded message."""
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(field_number << 3 | 2) + _varint(len(data)) + data


def attribute(name: str, value: int | Sequence[int]) -> bytes:
    """AttributeProto of an int (`i`) or a list of ints (`ints`)."""
    if isinstance(value, int):
        return message(1, name) + integer(3, value) + integer(20, _ATTRIBUTE_INT)
    return message(1, name) + b"".join(integer(8, v) for v in value) + integer(20, _ATTRIBUTE_INTS)


def node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
         **attributes: int | Sequence[int]) -> bytes:
    """NodeProto of the default domain ("" for an optional input left out)."""
    return (b"".join(message(1, i) for i in inputs) + b"".join(message(2, o) for o in outputs)
            + message(3, name) + message(4, op_type)
            + b"".join(message(5, attribute(key, value)) for key, value in attributes.items()))


def value_info(name: str, element_type: int, dims: Sequence[str | int]) -> bytes:
    """ValueInfoProto: a tensor of `element_type` whose dims are named (dynamic) or fixed."""
    shape = b"".join(message(1, message(2, d) if isinstance(d, str) else integer(1, d)) for d in dims)
    return message(1, name) + message(2, message(1, integer(1, element_type) + message(2, shape)))


def model(nodes: Sequence[bytes], inputs: Sequence[bytes], outputs: Sequence[bytes], name: str,
          opset: int = 13) -> bytes:
    """A serialized ModelProto (IR version 8) of one graph: `nodes`, then the `value_info`s of
    its inputs and outputs."""
    graph = (b"".join(message(1, n) for n in nodes) + message(2, name)
             + b"".join(message(11, i) for i in inputs) + b"".join(message(12, o) for o in outputs))
    opset_import = message(1, "") + integer(2, opset)
    return integer(1, 8) + message(2, "attnserve") + message(7, graph) + message(8, opset_import)
