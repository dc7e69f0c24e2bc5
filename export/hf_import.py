"""`attnserve import-hf`: a local Hugging Face Marian or BART folder -> a model repository.

Both encoder-decoders are our `model.transformer.Transformer` with post-LayerNorm layers of the
same shape, token embeddings shared with the output projection and a bias on the logits
(`final_logits_bias`); `config.model_type` picks what differs:

    marian  an activation of its own (swish for OPUS-MT), sinusoids laid out as all sines then
            all cosines, optionally scaled token embeddings, pad as the decoder's start token
    bart    GELU, learned positions (transformers' table is offset by 2: position p is its row
            p + 2; the converted table keeps the rows from 2 on, so position p is row p), a
            LayerNorm after token embedding + position in both stacks (`layernorm_embedding`),
            unscaled embeddings, eos as the decoder's start token

`convert_hf` copies the weights into a `Transformer` whose `ModelConfig` says so,
`check_conversion` compares the two in PyTorch (logits and every attention map,
teacher-forced), and `export.repository.write_repository` does the rest as for our own models
(graphs with attention outputs, the step graph, tokenizer, manifest with hashes, parity of
onnxruntime with PyTorch).

Tokenizer. A Marian folder has source.spm, target.spm and vocab.json. When the two
SentencePiece models are one and vocab.json maps each of its pieces to the piece's own id (and
holds nothing else), the repository keeps that model as its tokenizer.model, like our own
models. Otherwise, as in the OPUS-MT folders on the Hub (two models and a joint vocabulary:
`</s>` 0, `<unk>` 1, ..., `<pad>` last), it keeps the three files and the service tokenizes with
`model.tokenizer.VocabTokenizer` as transformers' MarianTokenizer does: source texts by
source.spm, target texts and outputs by target.spm, pieces to ids by vocab.json, special ids
from vocab.json. A separate target vocabulary (target_vocab.json) is refused. A BART folder is
accepted when it holds its SentencePiece model as sentencepiece.bpe.model (and a vocab.json
beside it, if any, maps pieces to those ids); the Hub's BART folders tokenize with byte-level
BPE (vocab.json and merges.txt, no SentencePiece model) and are refused with the reason. Either
way the model's vocabulary size and pad/eos ids must be the tokenizer's.

Generation settings of the folder that the service does not apply (e.g. BART's
forced_bos_token_id) are logged and recorded in the manifest.

The folder is read with `local_files_only`: nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from export.parity import ATTENTION_ATOL, LOGITS_ATOL, OutputMismatch, parity_sources
from model.config import ModelConfig
from model.embedding import Embedding
from model.tokenizer import Tokenizer, VocabFiles, VocabTokenizer, load_tokenizer
from model.transformer import DecoderLayer, EncoderLayer, Transformer
from service.repository.manifest import Manifest, sha256_file

log = logging.getLogger(__name__)

SOURCE_SPM, TARGET_SPM, VOCAB_JSON = "source.spm", "target.spm", "vocab.json"
TARGET_VOCAB_JSON, TOKENIZER_CONFIG = "target_vocab.json", "tokenizer_config.json"
BART_SPM, MERGES_TXT = "sentencepiece.bpe.model", "merges.txt"
# model_type -> the transformers class read, and the `ModelConfig` fields that tell it apart
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "marian": ("MarianMTModel", {"position_layout": "halves", "embedding_norm": False}),
    "bart": ("BartForConditionalGeneration", {"position_layout": "learned", "embedding_norm": True}),
}
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}
# generation settings of the folder that the service does not apply (recorded, and warned about)
IGNORED_GENERATION = ("bad_words_ids", "forced_eos_token_id", "forced_bos_token_id", "no_repeat_ngram_size",
                      "repetition_penalty", "num_beams", "length_penalty", "max_length")


class UnsupportedModel(ValueError):
    """The folder is not a model `import-hf` can convert exactly."""


def parse_task(task: str) -> tuple[str, str, str]:
    """"translate-en-de" -> ("translate", "en", "de"); "summarize-en" -> ("summarize", "en", "en")."""
    parts = task.split("-")
    if len(parts) == 3 and parts[0] == "translate" and all(parts[1:]):
        return "translate", parts[1], parts[2]
    if len(parts) == 2 and parts[0] == "summarize" and parts[1]:
        return "summarize", parts[1], parts[1]
    raise ValueError(f"task must look like translate-<src>-<tgt> or summarize-<lang>, got {task!r}")


def load_hf_model(model_dir: str | Path) -> Any:
    """The folder's model as its `ARCHITECTURES` class (fp32, eval, eager attention: it returns
    attention weights); any other model_type is refused."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if config.model_type not in ARCHITECTURES:
        raise UnsupportedModel(f"{model_dir}: model_type {config.model_type!r}; import-hf converts "
                               f"{' and '.join(ARCHITECTURES)} only")
    model_class = getattr(transformers, ARCHITECTURES[config.model_type][0])
    model = model_class.from_pretrained(str(model_dir), local_files_only=True, attn_implementation="eager",
                                        dtype=torch.float32)
    return model.eval()


def check_tokenizer(model_dir: str | Path, hf_config: Any) -> Path | VocabFiles:
    """The folder's tokenizer, when its ids are the model's (see the module's docstring): a
    SentencePiece model, or the `VocabFiles` of a Marian vocabulary."""
    directory = Path(model_dir)
    files = _marian_files(directory) if hf_config.model_type == "marian" else _bart_spm(directory)
    name = VOCAB_JSON if isinstance(files, VocabFiles) else files.name
    try:
        tokenizer = load_tokenizer(files)
    except (OSError, RuntimeError, ValueError) as error:
        raise UnsupportedModel(f"{directory}: cannot read its tokenizer ({name}): {error}") from error
    if isinstance(tokenizer, Tokenizer):
        _check_vocab_json(directory, tokenizer, name)
    if tokenizer.vocab_size != hf_config.vocab_size:
        raise UnsupportedModel(f"{directory}: {name} has {tokenizer.vocab_size} pieces, the model "
                               f"{hf_config.vocab_size} ids")
    specials = {"pad": tokenizer.pad_id, "unk": tokenizer.unk_id, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    if min(specials.values()) < 0:
        raise UnsupportedModel(f"{directory}: {name} lacks a special piece ({specials}); the service needs "
                               "pad, unk, bos and eos")
    if (tokenizer.pad_id, tokenizer.eos_id) != (hf_config.pad_token_id, hf_config.eos_token_id):
        raise UnsupportedModel(f"{directory}: {name}'s pad/eos ids {tokenizer.pad_id}/{tokenizer.eos_id} "
                               f"differ from the model's {hf_config.pad_token_id}/{hf_config.eos_token_id}")
    return files


def _marian_files(directory: Path) -> Path | VocabFiles:
    """source.spm when target.spm is the same model and vocab.json maps its pieces to their own
    ids; else the three files (a vocabulary of its own); a separate target vocabulary is refused."""
    source, target, vocab_path = directory / SOURCE_SPM, directory / TARGET_SPM, directory / VOCAB_JSON
    for path in (source, target, vocab_path):
        if not path.is_file():
            raise UnsupportedModel(f"{directory}: no {path.name} (a Marian folder has source.spm, target.spm, "
                                   "vocab.json)")
    config_path = directory / TOKENIZER_CONFIG
    settings = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if (directory / TARGET_VOCAB_JSON).is_file() or settings.get("separate_vocabs"):
        raise UnsupportedModel(f"{directory}: separate source and target vocabularies ({TARGET_VOCAB_JSON}); the "
                               "service serves one vocabulary for both sides")
    if sha256_file(source) == sha256_file(target):
        try:
            if _maps_own_ids(vocab_path, Tokenizer.from_file(source)):
                return source
        except (OSError, RuntimeError, ValueError) as error:
            raise UnsupportedModel(f"{directory}: cannot read its tokenizer: {error}") from error
    return VocabFiles(source, target, vocab_path)


def _bart_spm(directory: Path) -> Path:
    """sentencepiece.bpe.model; a byte-level BPE tokenizer alone is refused."""
    path = directory / BART_SPM
    if path.is_file():
        return path
    if (directory / MERGES_TXT).is_file():
        raise UnsupportedModel(f"{directory}: a byte-level BPE tokenizer (vocab.json, merges.txt) and no "
                               f"{BART_SPM}; the service tokenizes with one SentencePiece model whose ids are "
                               "the model's, and cannot serve this vocabulary")
    raise UnsupportedModel(f"{directory}: no {BART_SPM} (the SentencePiece model whose ids are the model's)")


def _maps_own_ids(vocab_path: Path, tokenizer: Tokenizer) -> bool:
    """Whether the JSON file maps every piece of the SentencePiece model to its own id, and holds
    nothing else."""
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    return bool(vocab == {piece: i for i, piece in enumerate(pieces)})


def _check_vocab_json(directory: Path, tokenizer: Tokenizer, spm_name: str) -> None:
    """vocab.json, where there is one, maps every piece to its own SentencePiece id and holds nothing else."""
    vocab_path = directory / VOCAB_JSON
    if vocab_path.is_file() and not _maps_own_ids(vocab_path, tokenizer):
        raise UnsupportedModel(f"{directory}: vocab.json does not map every piece of {spm_name} to its own "
                               "SentencePiece id (and nothing else); the service maps pieces by a vocabulary "
                               "for Marian folders (source.spm, target.spm, vocab.json) only")


def hf_model_config(hf_config: Any, tokenizer: Tokenizer | VocabTokenizer, max_source_len: int, max_target_len: int,
                    tied: bool) -> ModelConfig:
    """Our `ModelConfig` of a Marian or BART config (refusing what `Transformer` cannot express).

    Lengths are capped by the folder's `max_position_embeddings`; with learned positions the
    decoder's table must also hold position `max_target_len` (`ModelConfig.learned_positions`)."""
    c = hf_config
    variation = ARCHITECTURES[c.model_type][1]
    if c.encoder_attention_heads != c.decoder_attention_heads or c.encoder_ffn_dim != c.decoder_ffn_dim:
        raise UnsupportedModel("encoder and decoder differ in heads or feed-forward width")
    if getattr(c, "decoder_vocab_size", None) not in (None, c.vocab_size):
        raise UnsupportedModel(f"separate target vocabulary ({c.decoder_vocab_size} ids, source {c.vocab_size})")
    if c.activation_function not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {c.activation_function!r} (supported: {sorted(ACTIVATIONS)})")
    if variation["position_layout"] != "learned" and c.d_model % 2:
        raise UnsupportedModel(f"odd d_model {c.d_model} (sinusoidal positions)")
    positions = c.max_position_embeddings
    target_positions = positions - 1 if variation["position_layout"] == "learned" else positions
    return ModelConfig(
        vocab_size=c.vocab_size, d_model=c.d_model, n_heads=c.encoder_attention_heads,
        n_encoder_layers=c.encoder_layers, n_decoder_layers=c.decoder_layers, d_ff=c.encoder_ffn_dim,
        dropout=0.0, max_source_len=min(max_source_len, positions),
        max_target_len=min(max_target_len, target_positions), pad_id=tokenizer.pad_id,
        unk_id=tokenizer.unk_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, norm_first=False,
        tie_embeddings=tied, activation=ACTIVATIONS[c.activation_function],
        scale_embedding=bool(c.scale_embedding), output_bias=True, decoder_start_id=c.decoder_start_token_id,
        **variation,
    )


def _copy_linear(ours: nn.Linear, theirs: nn.Linear) -> None:
    ours.weight.copy_(theirs.weight)
    if ours.bias is not None:
        ours.bias.copy_(theirs.bias)


def _copy_norm(ours: nn.Module, theirs: nn.LayerNorm) -> None:
    assert isinstance(ours, nn.LayerNorm)
    if ours.eps != theirs.eps:
        raise UnsupportedModel(f"LayerNorm eps {theirs.eps} (ours {ours.eps})")
    ours.weight.copy_(theirs.weight)
    ours.bias.copy_(theirs.bias)


def _copy_attention(ours: nn.Module, theirs: nn.Module) -> None:
    for mine, name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("output", "out_proj")):
        _copy_linear(getattr(ours, mine), getattr(theirs, name))


def _copy_embedding(ours: Embedding, theirs: Any, norm: nn.LayerNorm | None) -> None:
    """A stack's learned position table and embedding LayerNorm, where the model has them."""
    if ours.positions is not None:
        offset = int(theirs.embed_positions.offset)
        rows = ours.positions.num_embeddings
        table = theirs.embed_positions.weight[offset: offset + rows]
        if table.size(0) != rows:
            raise UnsupportedModel(f"{rows} positions needed, the folder's table has {table.size(0)}")
        ours.positions.weight.copy_(table)
    if norm is not None:
        _copy_norm(ours.norm, norm)


@torch.no_grad()
def convert_hf(hf_model: Any, tokenizer: Tokenizer | VocabTokenizer, max_source_len: int = 256,
               max_target_len: int = 128) -> Transformer:
    """A `Transformer` computing what the Marian or BART model computes, with its weights copied."""
    encoder, decoder = hf_model.model.encoder, hf_model.model.decoder
    source_tokens, target_tokens = encoder.embed_tokens.weight, decoder.embed_tokens.weight
    output = hf_model.lm_head.weight
    tied = torch.equal(source_tokens, target_tokens) and torch.equal(target_tokens, output)
    model = Transformer(hf_model_config(hf_model.config, tokenizer, max_source_len, max_target_len, tied)).eval()
    model.source_embedding.tokens.weight.copy_(source_tokens)
    if not tied:
        model.target_embedding.tokens.weight.copy_(target_tokens)
        model.output_projection.weight.copy_(output)
    model.output_projection.bias.copy_(hf_model.final_logits_bias[0])
    for ours_embedding, stack in ((model.source_embedding, encoder), (model.target_embedding, decoder)):
        _copy_embedding(ours_embedding, stack, getattr(stack, "layernorm_embedding", None))
    for ours, theirs in zip(model.encoder_layers, encoder.layers, strict=True):
        assert isinstance(ours, EncoderLayer)
        _copy_attention(ours.attention, theirs.self_attn)
        _copy_norm(ours.attention_sublayer.norm, theirs.self_attn_layer_norm)
        _copy_linear(ours.feed_forward.inner, theirs.fc1)
        _copy_linear(ours.feed_forward.outer, theirs.fc2)
        _copy_norm(ours.feed_forward_sublayer.norm, theirs.final_layer_norm)
    for ours, theirs in zip(model.decoder_layers, decoder.layers, strict=True):
        assert isinstance(ours, DecoderLayer)
        _copy_attention(ours.self_attention, theirs.self_attn)
        _copy_norm(ours.self_sublayer.norm, theirs.self_attn_layer_norm)
        _copy_attention(ours.cross_attention, theirs.encoder_attn)
        _copy_norm(ours.cross_sublayer.norm, theirs.encoder_attn_layer_norm)
        _copy_linear(ours.feed_forward.inner, theirs.fc1)
        _copy_linear(ours.feed_forward.outer, theirs.fc2)
        _copy_norm(ours.feed_forward_sublayer.norm, theirs.final_layer_norm)
    return model


def _compare(name: str, actual: Tensor, expected: Tensor, tolerance: float, diffs: dict[str, float]) -> None:
    difference = (actual.float() - expected.float()).abs()
    worst = float(difference.max()) if difference.numel() else 0.0
    diffs[name] = max(diffs.get(name, 0.0), worst)
    if worst > tolerance:
        where = tuple(int(i) for i in np.unravel_index(int(difference.argmax()), difference.shape))
        raise OutputMismatch(name, "transformers vs converted", worst, tolerance, where)


@torch.no_grad()
def check_conversion(hf_model: Any, model: Transformer, sources: Sequence[Sequence[int]],
                     target_len: int = 6, seed: int = 0) -> dict[str, float]:
    """Teacher-forced forward passes of both models on `sources` (right-padded, ids ending
    with EOS) and random targets after the start token: logits, encoder, decoder self- and
    cross-attention of every layer must agree; returns the largest difference of each."""
    config = model.config
    width = max(len(s) for s in sources)
    source = torch.full((len(sources), width), config.pad_id, dtype=torch.long)
    for row, ids in enumerate(sources):
        source[row, : len(ids)] = torch.tensor(list(ids))
    mask = source != config.pad_id
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(4, config.vocab_size, (len(sources), target_len), generator=generator)
    target = torch.cat([torch.full((len(sources), 1), config.start_id), targets], dim=1)
    theirs = hf_model(input_ids=source, attention_mask=mask.long(), decoder_input_ids=target,
                      output_attentions=True, return_dict=True)
    encoded = model.encode(source, need_weights=True)
    ours = model.decode(target, model.start_decoding(encoded), need_weights=True)
    diffs: dict[str, float] = {}
    _compare("logits", ours.logits, theirs.logits, LOGITS_ATOL, diffs)
    for i, (a, e) in enumerate(zip(encoded.attentions, theirs.encoder_attentions, strict=True)):
        _compare(f"encoder_attention.{i}", a, e, ATTENTION_ATOL, diffs)
    for i, (a, e) in enumerate(zip(ours.self_attentions, theirs.decoder_attentions, strict=True)):
        _compare(f"self_attention.{i}", a, e, ATTENTION_ATOL, diffs)
    for i, (a, e) in enumerate(zip(ours.cross_attentions, theirs.cross_attentions, strict=True)):
        _compare(f"cross_attention.{i}", a, e, ATTENTION_ATOL, diffs)
    return diffs


def _generation_settings(model_dir: Path) -> dict[str, Any]:
    """The folder's generation settings the service does not apply."""
    path = model_dir / "generation_config.json"
    values = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return {k: values[k] for k in IGNORED_GENERATION if values.get(k) is not None}


def import_hf(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    task: str,
    name: str | None = None,
    variants: Sequence[str] = ("fp32", "int8"),
    max_source_len: int = 256,
    max_target_len: int = 128,
    max_size_mb: float | None = None,
    threads: int = 0,
) -> Manifest:
    """Convert the Marian or BART folder `model_dir`, check it against transformers, write `out_dir`."""
    from export.repository import write_repository

    directory = Path(model_dir)
    manifest_task, source_language, target_language = parse_task(task)
    hf_model = load_hf_model(directory)
    tokenizer_path = check_tokenizer(directory, hf_model.config)
    tokenizer = load_tokenizer(tokenizer_path)
    model = convert_hf(hf_model, tokenizer, max_source_len, max_target_len)
    config = model.config
    # within max_source_len: a learned position table has no rows past it
    sources = [ids if len(ids) <= config.max_source_len else [*ids[: config.max_source_len - 1], config.eos_id]
               for ids in parity_sources(config.vocab_size, config.eos_id)]
    diffs = check_conversion(hf_model, model, sources)
    log.info("converted %s: agrees with transformers (max abs diff %s)", directory, diffs)
    ignored = _generation_settings(directory)
    if ignored:
        log.warning("%s: generation settings the service does not apply: %s", directory, ignored)
    weights = sorted(p.name for p in directory.glob("*.safetensors")) or sorted(p.name for p in directory.glob("*.bin"))
    provenance: dict[str, Any] = {
        "hf_model_dir": str(model_dir), "architecture": hf_model.config.model_type,
        "weights": {w: sha256_file(directory / w) for w in weights},
        "transformers_parity": {"max_abs_diff": diffs, "note": "fp32 weights, before rounding to bfloat16"},
        "generation_settings_not_applied": ignored,
    }
    return write_repository(
        model, tokenizer_path, out_dir, task=manifest_task, source_language=source_language,
        target_language=target_language, name=name, variants=variants, sources=sources,
        max_size_mb=max_size_mb, threads=threads, provenance=provenance,
    )
