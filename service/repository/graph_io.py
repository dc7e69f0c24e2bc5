"""Names of the ONNX graphs' inputs and outputs: the contract between `export/` and `service/`.

Torch-free, so the service can import it. Per-layer tensors are numbered `name.{i}`.

encoder.onnx
  inputs   input_ids (batch, source_len) int64: token ids + EOS, right-padded with pad
  outputs  encoder_attention.{i} (batch, heads, source_len, source_len), one per encoder layer;
           cross_key.{i}, cross_value.{i} (batch, heads, source_len, head_dim), one pair per
           decoder layer (the decoder's cross-attention keys/values, computed once here)

decoder.onnx (one merged graph: past_len may be 0)
  inputs   input_ids, positions (batch, new_len) int64; source_mask (batch, source_len) bool;
           target_mask (batch, total_len) bool with total_len = past_len + new_len;
           past_key.{i}, past_value.{i} (batch, heads, past_len, head_dim);
           cross_key.{i}, cross_value.{i} (batch, heads, source_len, head_dim)
  outputs  logits (batch, new_len, vocab); present_key.{i}, present_value.{i}
           (batch, heads, total_len, head_dim); self_attention.{i} (batch, heads, new_len,
           total_len); cross_attention.{i} (batch, heads, new_len, source_len)

decoder_step.onnx (continuous batching, `export.step_graph`: each row over its own length)
  inputs   input_ids, positions (batch, 1) int64 (positions: each row's cached length);
           source_mask (batch, source_len) bool; past_key.{i}, past_value.{i}
           (batch, heads, capacity, head_dim); cross_key.{i}, cross_value.{i}
  outputs  logits (batch, vocab); present_key.{i}, present_value.{i} (batch, heads, capacity,
           head_dim): the past buffers with each row's new position written
  An int8-cache step graph (`export.kv_cache`) takes the cache and the cross keys/values as
  int8 (a value = its int8 times a fixed scale per tensor and layer): the cache's scales are
  its own, the cross keys/values' are in its metadata (`CROSS_SCALES`), for the caller that
  writes them there. Instead of `source_mask` it takes each row's last source position,
  source_last (batch,) int32 (its source length - 1), and the cross keys/values there,
  cross_last_key.{i}, cross_last_value.{i} (batch, 1, heads * head_dim) float: the int8
  column times its scale, heads in order (`cross_last_names`; the caller keeps them beside
  its slots, so a step does not gather and dequantize them again).
"""

from __future__ import annotations

from typing import Any

# named dynamic axes
BATCH, SOURCE_LEN, NEW_LEN, PAST_LEN, TOTAL_LEN = "batch", "source_len", "new_len", "past_len", "total_len"
CAPACITY = "capacity"
# the step graph's metadata key: a JSON list of the int8 cross keys/values' scales, one per
# input in the order cross_key.0, cross_value.0, cross_key.1, ...
CROSS_SCALES = "cross_kv_scales"


def encoder_inputs() -> list[str]:
    return ["input_ids"]


def encoder_attention_outputs(n_encoder_layers: int) -> list[str]:
    return [f"encoder_attention.{i}" for i in range(n_encoder_layers)]


def cross_names(n_decoder_layers: int) -> list[str]:
    """cross_key.0, cross_value.0, cross_key.1, ...: encoder outputs and decoder inputs."""
    return [f"cross_{kind}.{i}" for i in range(n_decoder_layers) for kind in ("key", "value")]


def encoder_outputs(n_encoder_layers: int, n_decoder_layers: int) -> list[str]:
    return encoder_attention_outputs(n_encoder_layers) + cross_names(n_decoder_layers)


def past_names(n_decoder_layers: int) -> list[str]:
    return [f"past_{kind}.{i}" for i in range(n_decoder_layers) for kind in ("key", "value")]


def present_names(n_decoder_layers: int) -> list[str]:
    return [f"present_{kind}.{i}" for i in range(n_decoder_layers) for kind in ("key", "value")]


def decoder_inputs(n_decoder_layers: int) -> list[str]:
    return (["input_ids", "positions", "source_mask", "target_mask"]
            + past_names(n_decoder_layers) + cross_names(n_decoder_layers))


def step_inputs(n_decoder_layers: int) -> list[str]:
    return ["input_ids", "positions", "source_mask"] + past_names(n_decoder_layers) + cross_names(n_decoder_layers)


SOURCE_LAST = "source_last"


def cross_last_names(n_decoder_layers: int) -> list[str]:
    """cross_last_key.0, cross_last_value.0, ...: an int8-cache step graph's cross keys/values
    at each row's last source position (the module's docstring)."""
    return [f"cross_last_{kind}.{i}" for i in range(n_decoder_layers) for kind in ("key", "value")]


def cross_present_names(n_decoder_layers: int) -> list[str]:
    """The step graph's cross keys/values as outputs: its cross-attention writes into their
    buffers (unchanged values), so they are bound to the same memory as `cross_names`."""
    return [f"present_{name}" for name in cross_names(n_decoder_layers)]


def step_outputs(n_decoder_layers: int) -> list[str]:
    return ["logits"] + present_names(n_decoder_layers) + cross_present_names(n_decoder_layers)


def decoder_attention_outputs(n_decoder_layers: int) -> list[str]:
    return ([f"self_attention.{i}" for i in range(n_decoder_layers)]
            + [f"cross_attention.{i}" for i in range(n_decoder_layers)])


def decoder_outputs(n_decoder_layers: int) -> list[str]:
    return ["logits"] + present_names(n_decoder_layers) + decoder_attention_outputs(n_decoder_layers)


_AXES = {
    "positions": [BATCH, NEW_LEN],
    "source_mask": [BATCH, SOURCE_LEN],
    "target_mask": [BATCH, TOTAL_LEN],
    "encoder_attention": [BATCH, "heads", SOURCE_LEN, SOURCE_LEN],
    "cross_key": [BATCH, "heads", SOURCE_LEN, "head_dim"],
    "cross_value": [BATCH, "heads", SOURCE_LEN, "head_dim"],
    "past_key": [BATCH, "heads", PAST_LEN, "head_dim"],
    "past_value": [BATCH, "heads", PAST_LEN, "head_dim"],
    "present_key": [BATCH, "heads", TOTAL_LEN, "head_dim"],
    "present_value": [BATCH, "heads", TOTAL_LEN, "head_dim"],
    "logits": [BATCH, NEW_LEN, "vocab"],
    "self_attention": [BATCH, "heads", NEW_LEN, TOTAL_LEN],
    "cross_attention": [BATCH, "heads", NEW_LEN, SOURCE_LEN],
}
# decoder_step: the cache axis is the buffer's capacity; one new position per row
_STEP_AXES = {
    "positions": [BATCH, "one"],
    "past_key": [BATCH, "heads", CAPACITY, "head_dim"],
    "past_value": [BATCH, "heads", CAPACITY, "head_dim"],
    "present_key": [BATCH, "heads", CAPACITY, "head_dim"],
    "present_value": [BATCH, "heads", CAPACITY, "head_dim"],
    "present_cross_key": [BATCH, "heads", SOURCE_LEN, "head_dim"],
    "present_cross_value": [BATCH, "heads", SOURCE_LEN, "head_dim"],
    "logits": [BATCH, "vocab"],
}
_DTYPES = {"input_ids": "int64", "positions": "int64", "source_mask": "bool", "target_mask": "bool"}


def axes(graph: str, name: str) -> list[str]:
    """The named axes of a tensor of `graph` ("encoder" | "decoder" | "decoder_step"); "heads",
    "head_dim" and "vocab" are fixed sizes ("one": the step graph's single new position), the
    others dynamic."""
    if name == "input_ids":
        return {"encoder": [BATCH, SOURCE_LEN], "decoder_step": [BATCH, "one"]}.get(graph, [BATCH, NEW_LEN])
    kind = name.split(".")[0]
    if graph == "decoder_step" and kind in _STEP_AXES:
        return _STEP_AXES[kind]
    return _AXES[kind]


def dtype(name: str) -> str:
    return _DTYPES.get(name, "float32")


def describe(graph: str, names: list[str]) -> list[dict[str, Any]]:
    """The manifest's io entries of `graph`: name, dtype and named axes of each tensor."""
    return [{"name": n, "dtype": dtype(n), "axes": axes(graph, n)} for n in names]


def io_section(n_encoder_layers: int, n_decoder_layers: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The manifest's `io`: inputs and outputs of the encoder, decoder and decoder step graphs."""
    return {
        "encoder": {
            "inputs": describe("encoder", encoder_inputs()),
            "outputs": describe("encoder", encoder_outputs(n_encoder_layers, n_decoder_layers)),
        },
        "decoder": {
            "inputs": describe("decoder", decoder_inputs(n_decoder_layers)),
            "outputs": describe("decoder", decoder_outputs(n_decoder_layers)),
        },
        "decoder_step": {
            "inputs": describe("decoder_step", step_inputs(n_decoder_layers)),
            "outputs": describe("decoder_step", step_outputs(n_decoder_layers)),
        },
    }
