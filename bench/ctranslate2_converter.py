"""Our checkpoint -> a CTranslate2 `TransformerSpec` with the same weights, written as a CT2 model.

The mapping follows `model/transformer.py`:
- token embeddings (scaled by sqrt(d_model)) plus our sinusoidal encodings, which interleave
  sin/cos channels, so the table is written out (CT2's built-in table concatenates them);
- per layer: LayerNorm + self-attention with q/k/v fused into one linear, residual; the decoder
  adds LayerNorm + cross-attention (query linear, fused k/v linear); LayerNorm + ReLU FFN;
- pre-LN stacks end with a final LayerNorm (`norm_first`), post-LN ones do not;
- the output projection (tied to the embeddings when `tie_embeddings`), no bias;
- vocabulary: the SentencePiece pieces, id for id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which model/ uses


def sinusoidal_table(length: int, d_model: int) -> np.ndarray:
    """(length, D) float32 encodings of positions 0..length-1, as `model.embedding` computes them."""
    positions = np.arange(length, dtype=np.float32)[:, None]  # (L, 1)
    channel = np.arange(0, d_model, 2, dtype=np.float32)  # (D/2,)
    inv_freq = np.exp(channel * (-np.log(10000.0) / d_model)).astype(np.float32)  # (D/2,)
    angles = positions * inv_freq  # (L, D/2)
    return np.stack((np.sin(angles), np.cos(angles)), axis=-1).reshape(length, d_model)  # (L, D)


def vocabulary(tokenizer_path: Path, vocab_size: int) -> list[str]:
    """The model's vocabulary as pieces; ids the tokenizer lacks get unique filler pieces."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    pieces = [processor.id_to_piece(i) for i in range(min(processor.get_piece_size(), vocab_size))]
    pieces += [f"<unused_{i}>" for i in range(len(pieces), vocab_size)]
    return pieces


def _array(state: dict[str, Any], name: str) -> np.ndarray:
    return state[name].detach().to("cpu").float().numpy()


def _set_linear(spec: Any, state: dict[str, Any], *prefixes: str, bias: bool = True) -> None:
    """Fill a CT2 LinearSpec from one or more (fused along the output axis) torch Linears."""
    spec.weight = np.concatenate([_array(state, f"{p}.weight") for p in prefixes], axis=0)  # (sum out, in)
    if bias:
        spec.bias = np.concatenate([_array(state, f"{p}.bias") for p in prefixes], axis=0)  # (sum out,)


def _set_norm(spec: Any, state: dict[str, Any], prefix: str) -> None:
    spec.gamma = _array(state, f"{prefix}.weight")  # (D,)
    spec.beta = _array(state, f"{prefix}.bias")  # (D,)


def build_spec(checkpoint_dir: Path, tokenizer_path: Path) -> Any:
    """A validated-shape `ctranslate2.specs.TransformerSpec` holding the checkpoint's weights."""
    from ctranslate2.specs import common_spec, transformer_spec

    from model.checkpoint import load_model

    model = load_model(checkpoint_dir)
    config = model.config
    state = model.state_dict()
    spec = transformer_spec.TransformerSpec.from_config(
        (config.n_encoder_layers, config.n_decoder_layers), config.n_heads,
        pre_norm=config.norm_first, no_final_norm=not config.norm_first,
        activation=common_spec.Activation.RELU,
    )
    # 1. embeddings and position encodings
    spec.encoder.embeddings[0].weight = _array(state, "source_embedding.tokens.weight")  # (V, D)
    spec.decoder.embeddings.weight = _array(state, "target_embedding.tokens.weight")  # (V, D)
    spec.encoder.position_encodings.encodings = sinusoidal_table(config.max_source_len, config.d_model)
    spec.decoder.position_encodings.encodings = sinusoidal_table(config.max_target_len + 1, config.d_model)
    # 2. encoder layers
    for i, layer in enumerate(spec.encoder.layer):
        p = f"encoder_layers.{i}"
        _set_norm(layer.self_attention.layer_norm, state, f"{p}.attention_sublayer.norm")
        attention = f"{p}.attention"
        _set_linear(layer.self_attention.linear[0], state, f"{attention}.query", f"{attention}.key",
                    f"{attention}.value")
        _set_linear(layer.self_attention.linear[1], state, f"{attention}.output")
        _set_norm(layer.ffn.layer_norm, state, f"{p}.feed_forward_sublayer.norm")
        _set_linear(layer.ffn.linear_0, state, f"{p}.feed_forward.inner")
        _set_linear(layer.ffn.linear_1, state, f"{p}.feed_forward.outer")
    # 3. decoder layers
    for i, layer in enumerate(spec.decoder.layer):
        p = f"decoder_layers.{i}"
        _set_norm(layer.self_attention.layer_norm, state, f"{p}.self_sublayer.norm")
        own = f"{p}.self_attention"
        _set_linear(layer.self_attention.linear[0], state, f"{own}.query", f"{own}.key", f"{own}.value")
        _set_linear(layer.self_attention.linear[1], state, f"{own}.output")
        _set_norm(layer.attention.layer_norm, state, f"{p}.cross_sublayer.norm")
        cross = f"{p}.cross_attention"
        _set_linear(layer.attention.linear[0], state, f"{cross}.query")
        _set_linear(layer.attention.linear[1], state, f"{cross}.key", f"{cross}.value")
        _set_linear(layer.attention.linear[2], state, f"{cross}.output")
        _set_norm(layer.ffn.layer_norm, state, f"{p}.feed_forward_sublayer.norm")
        _set_linear(layer.ffn.linear_0, state, f"{p}.feed_forward.inner")
        _set_linear(layer.ffn.linear_1, state, f"{p}.feed_forward.outer")
    # 4. final norms (pre-LN only) and the output projection
    if config.norm_first:
        _set_norm(spec.encoder.layer_norm, state, "encoder_norm")
        _set_norm(spec.decoder.layer_norm, state, "decoder_norm")
    _set_linear(spec.decoder.projection, state, "output_projection", bias=False)  # (V, D)
    # 5. vocabulary and special tokens (ours: <pad>=0, <unk>=1, <s>=2, </s>=3)
    pieces = vocabulary(tokenizer_path, config.vocab_size)
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token = pieces[config.unk_id]
    spec.config.bos_token = pieces[config.bos_id]
    spec.config.eos_token = pieces[config.eos_id]
    spec.config.decoder_start_token = pieces[config.bos_id]
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    return spec


def convert(model_dir: Path, output_dir: Path, quantization: str | None = None) -> Path:
    """Write the CT2 model of a model repository (checkpoint.safetensors, config.json,
    tokenizer.model) to `output_dir`; returns it. `quantization` as CT2's (None keeps fp32)."""
    import ctranslate2

    class _CheckpointConverter(ctranslate2.converters.Converter):
        def _load(self) -> Any:
            return build_spec(model_dir, model_dir / "tokenizer.model")

    _CheckpointConverter().convert(str(output_dir), quantization=quantization, force=True)
    return output_dir
