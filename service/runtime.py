"""A model repository on onnxruntime: verified load, provider and variant choice, and single
calls of the encoder and decoder graphs. Torch-free (numpy, onnxruntime, sentencepiece).

`service.generation` builds the decoding loop on `encode`, `decode` and the `select` methods
of `EncoderState` / `KVCache`. Graph inputs and outputs are named in `export.graph_io`.
Only the outputs a call needs are fetched: attention weights are asked for on request only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from export import graph_io
from export.manifest import Manifest, ManifestError, Variant, read_manifest, verify_files
from model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
DEFAULT_PROVIDERS = (CUDA, CPU)
# Variants to try per execution provider, best first; only servable ones are taken.
VARIANT_PREFERENCE = {CUDA: ("fp16", "fp32"), CPU: ("int8", "fp32")}


class ModelError(Exception):
    """Base of the runtime's errors."""


class ModelLoadError(ModelError):
    """The model repository cannot be served: bad manifest, missing, empty or altered file,
    no usable execution provider or variant, or a graph onnxruntime refuses."""


@dataclass
class EncoderState:
    """What the decoder needs from the encoder, per batch row."""

    source_mask: np.ndarray  # (B, S) bool, True on real source tokens
    cross_keys: list[np.ndarray]  # per decoder layer (B, h, S, d)
    cross_values: list[np.ndarray]  # per decoder layer (B, h, S, d)
    attentions: list[np.ndarray] | None = None  # per encoder layer (B, h, S, S), when asked for

    def select(self, rows: np.ndarray) -> EncoderState:
        """Keep, reorder or repeat batch rows (finished rows leave, beams follow their parent)."""
        return EncoderState(
            self.source_mask[rows],
            [k[rows] for k in self.cross_keys],
            [v[rows] for v in self.cross_values],
            None if self.attentions is None else [a[rows] for a in self.attentions],
        )


@dataclass
class KVCache:
    """Self-attention keys and values of the positions decoded so far."""

    keys: list[np.ndarray]  # per decoder layer (B, h, P, d)
    values: list[np.ndarray]  # per decoder layer (B, h, P, d)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def select(self, rows: np.ndarray) -> KVCache:
        return KVCache([k[rows] for k in self.keys], [v[rows] for v in self.values])


@dataclass
class DecoderStep:
    """One call of the decoder graph."""

    logits: np.ndarray  # (B, T, V) float32
    cache: KVCache  # grown by T positions
    self_attentions: list[np.ndarray] | None = None  # per layer (B, h, T, P+T)
    cross_attentions: list[np.ndarray] | None = None  # per layer (B, h, T, S)


@dataclass
class ModelRuntime:
    """An encoder and a decoder session of one variant of a verified model repository."""

    name: str
    task: str
    manifest: Manifest
    tokenizer: Tokenizer
    provider: str  # the execution provider the sessions run on
    variant: str  # "fp32" | "int8" | "fp16"
    encoder: ort.InferenceSession
    decoder: ort.InferenceSession

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        providers: Sequence[str] = DEFAULT_PROVIDERS,
        threads: int = 0,
        variant: str | None = None,
    ) -> ModelRuntime:
        """Read the manifest, verify every file's sha256, pick provider and variant, build sessions.

        `threads` sets each session's intra-op threads (0: onnxruntime's default, one per core);
        `variant` forces a variant (even one not marked servable); by default the first servable
        one of `VARIANT_PREFERENCE` for the provider in use.
        """
        started = time.perf_counter()
        directory = Path(model_dir)
        try:
            manifest = read_manifest(directory)
            verify_files(directory, manifest)
        except ManifestError as error:
            raise ModelLoadError(f"{directory}: {error}") from error
        available = set(ort.get_available_providers())
        usable = [p for p in providers if p in available]
        if not usable:
            raise ModelLoadError(f"{directory}: none of the providers {list(providers)} is available "
                                 f"(onnxruntime has {sorted(available)})")
        tokenizer = _load_tokenizer(directory, manifest)
        for provider in usable:
            chosen = _choose_variant(manifest, provider, variant)
            if chosen is None:
                logger.info("%s: no servable variant for %s", manifest.name, provider)
                continue
            encoder, decoder = _sessions(directory, manifest.variants[chosen], provider, threads)
            if encoder.get_providers()[0] != provider:  # e.g. CUDA listed but its libraries missing
                logger.warning("%s: %s did not start, trying the next provider", manifest.name, provider)
                continue
            runtime = cls(manifest.name, manifest.task, manifest, tokenizer, provider, chosen, encoder, decoder)
            logger.info("loaded %s (%s, variant %s, %s) in %.2fs", manifest.name, manifest.task, chosen,
                        provider, time.perf_counter() - started)
            return runtime
        raise ModelLoadError(f"{directory}: no variant of {sorted(manifest.variants)} can run on {usable}"
                             + (f" (asked for {variant!r})" if variant else ""))

    # -- configuration ---------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return int(self.manifest.special_ids["pad"])

    @property
    def bos_id(self) -> int:
        return int(self.manifest.special_ids["bos"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest.special_ids["eos"])

    @property
    def unk_id(self) -> int:
        return int(self.manifest.special_ids["unk"])

    @property
    def max_source_len(self) -> int:
        return self.manifest.max_source_len

    @property
    def max_target_len(self) -> int:
        return self.manifest.max_target_len

    @property
    def vocab_size(self) -> int:
        return int(self.manifest.model_config["vocab_size"])

    @property
    def n_encoder_layers(self) -> int:
        return int(self.manifest.model_config["n_encoder_layers"])

    @property
    def n_decoder_layers(self) -> int:
        return int(self.manifest.model_config["n_decoder_layers"])

    @property
    def n_heads(self) -> int:
        return int(self.manifest.model_config["n_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.manifest.model_config["d_model"]) // self.n_heads

    # -- graph calls -----------------------------------------------------------------------

    def pad(self, sources: Sequence[Sequence[int]]) -> np.ndarray:
        """Right-pad id lists into a (B, S) int64 batch."""
        batch = np.full((len(sources), max(len(s) for s in sources)), self.pad_id, dtype=np.int64)
        for row, ids in enumerate(sources):
            batch[row, : len(ids)] = ids
        return batch

    def encode(self, input_ids: np.ndarray, need_attention: bool = False) -> EncoderState:
        """One encoder call on (B, S) right-padded source ids (each row ending with EOS)."""
        layers = self.n_decoder_layers
        names = graph_io.cross_names(layers)
        if need_attention:
            names = graph_io.encoder_attention_outputs(self.n_encoder_layers) + names
        feeds = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64)}
        outputs = dict(zip(names, self.encoder.run(names, feeds), strict=True))
        return EncoderState(
            source_mask=input_ids != self.pad_id,
            cross_keys=[outputs[f"cross_key.{i}"] for i in range(layers)],
            cross_values=[outputs[f"cross_value.{i}"] for i in range(layers)],
            attentions=[outputs[n] for n in graph_io.encoder_attention_outputs(self.n_encoder_layers)]
            if need_attention else None,
        )

    def empty_cache(self, batch: int) -> KVCache:
        """A cache with past length 0."""
        empty = np.zeros((batch, self.n_heads, 0, self.head_dim), dtype=np.float32)
        return KVCache([empty] * self.n_decoder_layers, [empty] * self.n_decoder_layers)

    def decode(
        self,
        input_ids: np.ndarray,
        state: EncoderState,
        cache: KVCache | None = None,
        positions: np.ndarray | None = None,
        target_mask: np.ndarray | None = None,
        need_attention: bool = False,
    ) -> DecoderStep:
        """One decoder call on (B, T) new tokens after the cached positions.

        `positions` (B, T) default to P..P+T-1; `target_mask` (B, P+T) bool defaults to all
        real. With `cache=None` the past is empty: a whole prefix at once (teacher forcing).
        """
        batch, length = input_ids.shape
        layers = self.n_decoder_layers
        cache = cache if cache is not None else self.empty_cache(batch)
        past = cache.length
        if positions is None:
            positions = np.broadcast_to(np.arange(past, past + length, dtype=np.int64), (batch, length))
        if target_mask is None:
            target_mask = np.ones((batch, past + length), dtype=bool)
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "positions": np.ascontiguousarray(positions, dtype=np.int64),
            "source_mask": state.source_mask,
            "target_mask": target_mask,
        }
        for i in range(layers):
            feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = cache.keys[i], cache.values[i]
            feeds[f"cross_key.{i}"], feeds[f"cross_value.{i}"] = state.cross_keys[i], state.cross_values[i]
        names = ["logits", *graph_io.present_names(layers)]
        if need_attention:
            names += graph_io.decoder_attention_outputs(layers)
        out = dict(zip(names, self.decoder.run(names, feeds), strict=True))
        return DecoderStep(
            logits=out["logits"],
            cache=KVCache([out[f"present_key.{i}"] for i in range(layers)],
                          [out[f"present_value.{i}"] for i in range(layers)]),
            self_attentions=[out[f"self_attention.{i}"] for i in range(layers)] if need_attention else None,
            cross_attentions=[out[f"cross_attention.{i}"] for i in range(layers)] if need_attention else None,
        )

    @staticmethod
    def select(state: EncoderState | KVCache, rows: Sequence[int] | np.ndarray) -> EncoderState | KVCache:
        """Keep, reorder or repeat the batch rows of an encoder state or a cache."""
        return state.select(np.asarray(rows, dtype=np.int64))

    def warmup(self) -> None:
        """One encoder call and two decoder steps on a 2-row batch (allocations, first-run costs)."""
        source = self.pad([[self.unk_id, self.eos_id], [self.eos_id]])
        state = self.encode(source, need_attention=True)
        step = self.decode(np.full((2, 1), self.bos_id, dtype=np.int64), state, need_attention=True)
        self.decode(np.full((2, 1), self.eos_id, dtype=np.int64), state, step.cache)


def _load_tokenizer(directory: Path, manifest: Manifest) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(directory / manifest.tokenizer)
    except (OSError, RuntimeError) as error:
        raise ModelLoadError(f"{directory}: cannot load {manifest.tokenizer}: {error}") from error
    ids = {"pad": tokenizer.pad_id, "unk": tokenizer.unk_id, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    if ids != manifest.special_ids:
        raise ModelLoadError(f"{directory}: tokenizer special ids {ids} differ from the manifest's "
                             f"{manifest.special_ids}")
    return tokenizer


def _choose_variant(manifest: Manifest, provider: str, forced: str | None) -> str | None:
    if forced is not None:
        variant = manifest.variants.get(forced)
        if variant is None:
            raise ModelLoadError(f"{manifest.name} has no variant {forced!r} (has {sorted(manifest.variants)})")
        if not variant.servable:
            logger.warning("%s: variant %s is not marked servable (%s); using it as asked",
                           manifest.name, forced, variant.note or "no note")
        return forced
    for name in VARIANT_PREFERENCE.get(provider, ("fp32",)):
        variant = manifest.variants.get(name)
        if variant is not None and variant.servable:
            return name
    return None


def _sessions(directory: Path, variant: Variant, provider: str, threads: int) -> tuple[ort.InferenceSession, ...]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1  # sequential executor: one graph call uses intra-op threads only
    providers = [provider] if provider == CPU else [provider, CPU]
    sessions = []
    for path in (variant.encoder, variant.decoder):
        try:
            sessions.append(ort.InferenceSession(str(directory / path), options, providers=providers))
        except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise ModelLoadError(f"{directory / path}: onnxruntime cannot load it: {error}") from error
    return tuple(sessions)
