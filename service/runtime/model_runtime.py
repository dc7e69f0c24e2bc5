"""A model repository on onnxruntime: verified load, provider and variant choice, and single
calls of the encoder and decoder graphs. Torch-free (numpy, onnxruntime, sentencepiece).

`service.generation.search` builds the decoding loop on `encode`, `decode` and the `select` methods
of `EncoderState` / `KVCache` (`service.runtime.tensors`). Graph inputs and outputs are named in
`service.repository.graph_io`.
Only the outputs a call needs are fetched: attention weights are asked for on request only.

Two ways to call the graphs, chosen per runtime (`io_binding`, auto by default):
- numpy: `session.run` with numpy feeds; every tensor, the KV cache included, goes through host
  memory at every decoder step.
- IO binding: the encoder's cross keys/values and the decoder's present keys/values are bound as
  outputs on the session's device ("cuda" on CUDAExecutionProvider, else "cpu") and fed back as
  the next step's inputs as `onnxruntime.OrtValue`s, never copied to the host; only `logits`
  (and attention weights, when asked for) come back to numpy. Row selection (finished rows
  leaving the batch, beams following their parent) runs on the device too: a tiny Gather graph
  (`service.runtime.row_gather.RowGather`) gathers the rows of every layer's tensor in
  one call, a device-to-device copy of the rows kept -- no host round-trip, on either device.
`AUTO_IO_BINDING` holds the default per provider.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from model.tokenizer import Tokenizer, VocabFiles, VocabTokenizer, load_tokenizer
from service.repository import graph_io
from service.repository.manifest import (
    SHORTLIST_FILES,
    Manifest,
    ManifestError,
    Variant,
    read_manifest,
    verify_files,
)
from service.runtime.device_slots import (
    DeviceSlots,
    slot_graphs,
    step_dtypes,
    step_element_types,
)
from service.runtime.lone_slots import LoneSlots, fixed_dimensions, lone_session
from service.runtime.providers import (
    AUTO_IO_BINDING,
    CPU,
    CUDA,
    DEFAULT_PROVIDERS,
    STEP_CACHE_TYPES,
    STEP_GRAPH_BY_DEFAULT,
    VARIANT_PREFERENCE,
    cuda_unavailable_reason,
    execution_providers,
    prepare_cuda,
    session_options,
)
from service.runtime.row_gather import RowGather
from service.runtime.shortlist import Shortlist
from service.runtime.step_buffers import HostSlots, cross_in_place, cross_scales
from service.runtime.tensors import DecoderStep, EncoderState, Gatherer, KVCache, Tensor, to_numpy

logger = logging.getLogger(__name__)

# numpy dtypes of the graphs' float tensor types, as onnxruntime names them
_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


class ModelError(Exception):
    """Base of the runtime's errors."""


class ModelLoadError(ModelError):
    """The model repository cannot be served: bad manifest, missing, empty or altered file,
    no usable execution provider or variant, or a graph onnxruntime refuses."""


@dataclass
class ModelRuntime:
    """An encoder and a decoder session of one variant of a verified model repository."""

    name: str
    task: str
    manifest: Manifest
    tokenizer: Tokenizer | VocabTokenizer
    provider: str  # the execution provider the sessions run on
    variant: str  # "fp32" | "int8" | "fp16"
    encoder: ort.InferenceSession
    decoder: ort.InferenceSession
    io_binding: bool = False  # keep cross keys/values and the KV cache on the device (OrtValues)
    device: str = "cpu"  # where IO binding keeps them: "cuda" | "cpu"
    device_id: int = 0
    gather: Gatherer | None = field(default=None, repr=False)  # row selection on the device (IO binding)
    # the decoder step over each row's own cache (`export.step_graph`), for continuous batching;
    # None when the variant has none or its attention has no kernel on the provider (`STEP_CACHE_TYPES`)
    step: ort.InferenceSession | None = field(default=None, repr=False)
    # the step graph with a vocabulary shortlist and its table (`service.runtime.shortlist`), used by
    # `SlotBatch` with host slots; None: every step computes the whole vocabulary
    shortlist: Shortlist | None = field(default=None, repr=False)
    # a lone row's slot with the step graph at fixed dimensions, on CUDA replayed as a CUDA graph
    # (`service.runtime.lone_slots`), used by `SlotBatch` for a greedy row alone; None: not served
    lone: LoneSlots | None = field(default=None, repr=False)

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        providers: Sequence[str] = DEFAULT_PROVIDERS,
        threads: int = 0,
        spinning: bool = True,
        memory_arena: bool = True,
        profile_prefix: str | None = None,
        variant: str | None = None,
        io_binding: bool | None = None,
        step_graph: bool | None = None,
        shortlist: bool = False,
        gpu_memory_limit_mb: int = 0,
        lone_step: bool | None = None,
    ) -> ModelRuntime:
        """Read the manifest, verify every file's sha256, pick provider and variant, build sessions.

        `threads` sets each session's intra-op threads (0: onnxruntime's default, one per core);
        `spinning` False lets idle intra-op threads sleep rather than spin between calls (a
        server's event loop needs those cycles: bench/results/levers measures both);
        `memory_arena` False gives onnxruntime's CPU buffers back after each call instead of
        keeping the largest batch's for good (lower peak RSS, a few % slower); `profile_prefix`
        turns on onnxruntime's profiler (`bench.decoder_profile`);
        `variant` forces a variant (even one not marked servable); by default the first servable
        one of `VARIANT_PREFERENCE` for the provider in use. `io_binding` keeps the KV cache on
        the session's device between decoder steps; None: `AUTO_IO_BINDING` of the provider.
        `step_graph` False serves without the variant's step graph, True with it on any
        provider; None: with it when its cache type is one of `STEP_CACHE_TYPES` of the provider.
        `shortlist` loads the variant's vocabulary shortlist (`service.runtime.shortlist`) when it
        has one and its step graph serves on the CPU (`SlotBatch` uses it with host slots only).
        `gpu_memory_limit_mb` caps each CUDA session's memory arena (`execution_providers`).
        `lone_step` True builds `lone` (a lone row's slot, `service.runtime.lone_slots`) wherever
        the step graph serves with IO binding, False never; None: on CUDA (replayed as a CUDA graph).
        """
        started = time.perf_counter()
        directory = Path(model_dir)
        try:
            manifest = read_manifest(directory)
            verify_files(directory, manifest)
        except ManifestError as error:
            raise ModelLoadError(f"{directory}: {error}") from error
        if CUDA in providers:
            prepare_cuda()
            reason = cuda_unavailable_reason()
            if reason is not None and CPU in providers:  # a warning when the CUDA build is there but fails
                level = logging.WARNING if CUDA in ort.get_available_providers() else logging.INFO
                logger.log(level, "%s: CUDAExecutionProvider unavailable, serving on the CPU: %s", manifest.name, reason)
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
            try:
                encoder, decoder, step = _sessions(directory, manifest.variants[chosen], provider, threads, spinning,
                                                   memory_arena, profile_prefix, fold_dequantize=chosen == "int8",
                                                   gpu_memory_limit_mb=gpu_memory_limit_mb)
            except ModelLoadError as error:
                if provider == usable[-1]:
                    raise
                logger.warning("%s: %s failed to start (%s); trying %s", manifest.name, provider, error,
                               usable[usable.index(provider) + 1])
                continue
            if encoder.get_providers()[0] != provider:  # onnxruntime fell back: CUDA libraries missing
                logger.warning("%s: %s did not start (%s); trying the next provider", manifest.name, provider,
                               cuda_unavailable_reason() or "see onnxruntime's log above")
                continue
            step = _usable_step(manifest.name, step, provider, step_graph)
            bind = AUTO_IO_BINDING.get(provider, False) if io_binding is None else io_binding
            device, device_id = _device(decoder, provider)
            gather = RowGather(provider, device, device_id, threads) if bind else None
            runtime = cls(manifest.name, manifest.task, manifest, tokenizer, provider, chosen, encoder, decoder,
                          bind, device, device_id, gather, step)
            runtime._check_cache_dtype()
            if step is not None and bind and (provider == CUDA if lone_step is None else lone_step):
                runtime.lone = _lone_slots(directory / manifest.variants[chosen].step_decoder, runtime, threads,
                                           gpu_memory_limit_mb, directory / manifest.variants[chosen].encoder)
            if shortlist and step is not None and provider == CPU and manifest.variants[chosen].shortlist:
                runtime.shortlist = _load_shortlist(directory, manifest.variants[chosen], manifest.config.vocab_size,
                                                    threads, spinning, memory_arena)
            logger.info("loaded %s (%s, variant %s, %s, %s) in %.2fs", manifest.name, manifest.task, chosen,
                        provider, f"IO binding on {device}" if bind else "numpy I/O",
                        time.perf_counter() - started)
            return runtime
        raise ModelLoadError(f"{directory}: no variant of {sorted(manifest.variants)} can run on {usable}"
                             + (f" (asked for {variant!r})" if variant else ""))

    # -- configuration: the manifest's typed model config, read once ---------------------------

    @property
    def pad_id(self) -> int:
        return self.manifest.config.pad_id

    @property
    def bos_id(self) -> int:
        return self.manifest.config.bos_id

    @property
    def decoder_start_id(self) -> int:
        """The decoder's first input token (bos, or the model's own start token, e.g. Marian's pad)."""
        return self.manifest.config.start_id

    @property
    def eos_id(self) -> int:
        return self.manifest.config.eos_id

    @property
    def unk_id(self) -> int:
        return self.manifest.config.unk_id

    @property
    def max_source_len(self) -> int:
        return self.manifest.max_source_len

    @property
    def max_target_len(self) -> int:
        return self.manifest.max_target_len

    @property
    def vocab_size(self) -> int:
        return self.manifest.config.vocab_size

    @property
    def n_encoder_layers(self) -> int:
        return self.manifest.config.n_encoder_layers

    @property
    def n_decoder_layers(self) -> int:
        return self.manifest.config.n_decoder_layers

    @property
    def n_heads(self) -> int:
        return self.manifest.config.n_heads

    @property
    def head_dim(self) -> int:
        return self.manifest.config.head_dim

    @property
    def cache_dtype(self) -> np.dtype:
        """The dtype of the decoder's past keys/values, from the session (float32 unless a
        variant was converted without keeping float32 I/O)."""
        types = {i.name: i.type for i in self.decoder.get_inputs()}
        return np.dtype(_NUMPY_DTYPES.get(types.get("past_key.0", "tensor(float)"), np.float32))

    def _check_cache_dtype(self) -> None:
        types = {i.name: i.type for i in self.decoder.get_inputs()}
        kind = types.get("past_key.0", "tensor(float)")
        if kind not in _NUMPY_DTYPES:
            raise ModelLoadError(f"{self.name}: unsupported KV cache type {kind}")

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
        outputs: dict[str, Tensor]
        if self.io_binding:  # cross keys/values stay on the device, attention weights come to the host
            outputs = self._run_bound(self.encoder, feeds, names, on_device=set(graph_io.cross_names(layers)))
        else:
            outputs = dict(zip(names, self.encoder.run(names, feeds), strict=True))
        return EncoderState(
            source_mask=np.asarray(input_ids) != self.pad_id,
            cross_keys=[outputs[f"cross_key.{i}"] for i in range(layers)],
            cross_values=[outputs[f"cross_value.{i}"] for i in range(layers)],
            attentions=[outputs[n] for n in graph_io.encoder_attention_outputs(self.n_encoder_layers)]  # type: ignore[misc]
            if need_attention else None,
            gather=self.gather,
        )

    def empty_cache(self, batch: int) -> KVCache:
        """A cache with past length 0 (host arrays of the session's cache dtype: with IO binding
        onnxruntime copies their zero bytes to the device)."""
        empty = np.zeros((batch, self.n_heads, 0, self.head_dim), dtype=self.cache_dtype)
        return KVCache([empty] * self.n_decoder_layers, [empty] * self.n_decoder_layers, self.gather)

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
        feeds: dict[str, Tensor] = {
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
        out: dict[str, Tensor]
        if self.io_binding:  # presents stay on the device; logits and attention weights come to the host
            out = self._run_bound(self.decoder, feeds, names, on_device=set(graph_io.present_names(layers)))
        else:
            host = {k: to_numpy(v) for k, v in feeds.items()}  # OrtValues only if handed over from IO binding
            out = dict(zip(names, self.decoder.run(names, host), strict=True))
        return DecoderStep(
            logits=out["logits"],  # type: ignore[arg-type]
            cache=KVCache([out[f"present_key.{i}"] for i in range(layers)],
                          [out[f"present_value.{i}"] for i in range(layers)], self.gather),
            self_attentions=[out[f"self_attention.{i}"] for i in range(layers)]  # type: ignore[misc]
            if need_attention else None,
            cross_attentions=[out[f"cross_attention.{i}"] for i in range(layers)]  # type: ignore[misc]
            if need_attention else None,
        )

    def _run_bound(self, session: ort.InferenceSession, feeds: dict[str, Tensor], names: list[str],
                   on_device: set[str]) -> dict[str, Tensor]:
        """One call with IO binding: OrtValue feeds are bound where they are (no copy), numpy
        feeds from host memory; outputs in `on_device` stay on the device as OrtValues, the
        others are copied to the host and returned as numpy arrays."""
        binding = session.io_binding()  # one per call: sessions are shared by worker threads
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in names:
            if name in on_device:
                binding.bind_output(name, self.device, self.device_id)
            else:
                binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        values = binding.get_outputs()  # in the order bound
        return {name: value if name in on_device else value.numpy()
                for name, value in zip(names, values, strict=True)}

    @staticmethod
    def select(state: EncoderState | KVCache, rows: Sequence[int] | np.ndarray) -> EncoderState | KVCache:
        """Keep, reorder or repeat the batch rows of an encoder state or a cache."""
        return state.select(np.asarray(rows, dtype=np.int64))

    def warmup(self) -> None:
        """One encoder call and two decoder steps on a 2-row batch (allocations, first-run
        costs), and two steps of the step graph when there is one."""
        source = self.pad([[self.unk_id, self.eos_id], [self.eos_id]])
        state = self.encode(source, need_attention=True)
        step = self.decode(np.full((2, 1), self.decoder_start_id, dtype=np.int64), state, need_attention=True)
        self.decode(np.full((2, 1), self.eos_id, dtype=np.int64), state, step.cache)
        if self.step is not None:  # in the slot buffers continuous batching uses here (`SlotBatch`)
            cross = [t for pair in zip(state.cross_keys, state.cross_values, strict=True) for t in pair]
            width = state.source_mask.shape[1]
            slots: HostSlots | DeviceSlots
            if self.io_binding and self.device != "cpu":  # the tiny graphs' sessions are built here too
                cache_type, cross_type = step_element_types(self.step)
                slots = DeviceSlots(slot_graphs(self.provider, self.device, self.device_id), self.n_decoder_layers,
                                    2, self.n_heads, 4, self.head_dim, width, cache_type, cross_type)
            else:
                slots = HostSlots(self.n_decoder_layers, 2, self.n_heads, 4, self.head_dim, width,
                                  *step_dtypes(self.step), cross_scales(self.step))
            slots.write(0, cross)
            slots.move_rows(np.array([1]), np.array([0]), 1)
            for position in (0, 1):
                slots.step(self.step, np.full((2, 1), self.decoder_start_id, dtype=np.int64),
                           np.full((2, 1), position, dtype=np.int64), state.source_mask)


def _lone_slots(path: Path, runtime: ModelRuntime, threads: int, gpu_memory_limit_mb: int = 0,
                encoder: Path | None = None) -> LoneSlots | None:
    """The runtime's lone slot (`service.runtime.lone_slots`): its step graph at fixed dimensions,
    replayed as a CUDA graph on CUDA, stepped three times at load (the capture), and the
    `encoder` graph at one row and the source width attached (`_lone_encoder`); None, with a
    warning naming onnxruntime's reason, when the step's session cannot be made or run, or the
    step graph quantizes its cache (device slots hold float caches)."""
    assert runtime.step is not None
    if cross_scales(runtime.step) is not None:
        return None
    try:
        session = lone_session(path, runtime.provider, fixed_dimensions(runtime.max_target_len, runtime.max_source_len),
                               cuda_graph=runtime.provider == CUDA, threads=threads, device_id=runtime.device_id,
                               fold_dequantize=runtime.variant == "int8", gpu_memory_limit_mb=gpu_memory_limit_mb)
        slots = LoneSlots.of(runtime, session)
        mask = np.zeros((1, slots.width), dtype=bool)
        mask[0, 0] = True
        for position in range(3):  # on zeros: onnxruntime runs, captures and replays the CUDA graph here
            slots.step(session, np.full((1, 1), runtime.decoder_start_id, dtype=np.int64),
                       np.full((1, 1), position, dtype=np.int64), mask)
    except Exception as error:  # noqa: BLE001 - onnxruntime's refusal (a node with no kernel there) is logged
        logger.warning("%s: no lone-row step graph (%s: %s); a lone request steps with the batch's", runtime.name,
                       type(error).__name__, error)
        return None
    if encoder is not None:
        _lone_encoder(encoder, runtime, slots, threads, gpu_memory_limit_mb)
    return slots


def _lone_encoder(path: Path, runtime: ModelRuntime, slots: LoneSlots, threads: int, gpu_memory_limit_mb: int) -> None:
    """Attach the encoder graph at `path`, at one row and the slot's source width (a CUDA graph
    on CUDA), to the lone slot, run three times at load on an empty source (the capture); left
    out, with a warning naming the reason, when it cannot be made, bound or run (a lone row's
    source is then encoded as a batch's and copied into the slot)."""
    try:
        session = lone_session(path, runtime.provider, {"batch": 1, "source_len": slots.width},
                               cuda_graph=runtime.provider == CUDA, threads=threads, device_id=runtime.device_id,
                               fold_dequantize=runtime.variant == "int8", gpu_memory_limit_mb=gpu_memory_limit_mb)
        slots.attach_encoder(session, runtime.pad_id)
        for _ in range(3):
            slots.encode([[runtime.eos_id]])
    except Exception as error:  # noqa: BLE001 - onnxruntime's refusal or a type the slot does not hold is logged
        slots.encoder = None
        logger.warning("%s: no lone-row encoder (%s: %s); a lone request's source is encoded as a batch's",
                       runtime.name, type(error).__name__, error)


def _load_tokenizer(directory: Path, manifest: Manifest) -> Tokenizer | VocabTokenizer:
    """The manifest's tokenizer: its SentencePiece model, or (kind "sentencepiece_vocab") its
    source and target SentencePiece models and vocabulary; its special ids must be the manifest's."""
    if manifest.tokenizer_kind == "sentencepiece":
        files: Path | VocabFiles = directory / manifest.tokenizer
    else:
        files = VocabFiles(*(directory / manifest.tokenizer_files[role] for role in VocabFiles._fields))
    try:
        tokenizer = load_tokenizer(files)
    except (OSError, RuntimeError, ValueError) as error:
        raise ModelLoadError(f"{directory}: cannot load {', '.join(manifest.tokenizer_paths())}: "
                             f"{error}") from error
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


def _sessions(directory: Path, variant: Variant, provider: str, threads: int,
              spinning: bool = True, memory_arena: bool = True, profile_prefix: str | None = None,
              fold_dequantize: bool = False, gpu_memory_limit_mb: int = 0
              ) -> tuple[ort.InferenceSession, ort.InferenceSession, ort.InferenceSession | None]:
    """Encoder, decoder and (when the variant has one) step-graph sessions; a step graph that
    cannot load on a provider other than the CPU is left out (None), not an error."""
    options = session_options(threads, spinning, memory_arena, fold_dequantize, profile_prefix)
    providers = execution_providers(provider, gpu_memory_limit_mb)
    paths = [variant.encoder, variant.decoder]
    if variant.step_decoder:
        paths.append(variant.step_decoder)
    sessions = []
    for path in paths:
        try:
            sessions.append(ort.InferenceSession(str(directory / path), options, providers=providers))
        except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph/... types
            if path == variant.step_decoder and provider != CPU:  # the merged decoder still serves
                logger.warning("%s: onnxruntime cannot load it on %s (%s): batching on the merged decoder",
                               directory / path, provider, error)
                continue
            raise ModelLoadError(f"{directory / path}: onnxruntime cannot load it: {error}") from error
    return sessions[0], sessions[1], sessions[2] if len(sessions) > 2 else None


def _load_shortlist(directory: Path, variant: Variant, vocab_size: int, threads: int, spinning: bool,
                    memory_arena: bool) -> Shortlist:
    """The variant's shortlist graphs (CPU sessions, as the other int8 sessions) and table."""
    assert variant.shortlist is not None
    graph, projection, table = (directory / variant.shortlist[key] for key in SHORTLIST_FILES)
    try:
        loaded = Shortlist.load(graph, projection, table, threads, spinning, memory_arena)
    except Exception as error:  # onnxruntime's own types, or the table's ValueError
        raise ModelLoadError(f"{graph}: the vocabulary shortlist cannot load: {error}") from error
    if loaded.table.vocab_size != vocab_size:
        raise ModelLoadError(f"{table}: a table of {loaded.table.vocab_size} pieces for a vocabulary of {vocab_size}")
    return loaded


def _usable_step(name: str, step: ort.InferenceSession | None, provider: str,
                 wanted: bool | None) -> ort.InferenceSession | None:
    """The step session to serve with: None when `wanted` is False, or None and the type of its
    cache (and, when its cross-attention is `GroupQueryAttention` too, i.e. it has the
    `present_cross_*` outputs, of its cross keys/values) is not one of `STEP_CACHE_TYPES` of the
    provider (its attention would leave the device) or the provider serves none by default
    (`STEP_GRAPH_BY_DEFAULT`)."""
    if step is None or wanted is False:
        return None
    types = {i.name: i.type for i in step.get_inputs()}
    attended = ["past_key.0"]
    if cross_in_place(step):
        attended.append("cross_key.0")
    kinds = [types.get(input_name, "") for input_name in attended]
    if wanted is None and any(kind not in STEP_CACHE_TYPES.get(provider, ()) for kind in kinds):
        logger.info("%s: the step graph's attention (%s) has no %s kernel: continuous batching on "
                    "the merged decoder", name, ", ".join(f"{n} {k}" for n, k in zip(attended, kinds, strict=True)),
                    provider)
        return None
    if wanted is None and not STEP_GRAPH_BY_DEFAULT.get(provider, True):
        logger.info("%s: the step graph is not served on %s by default: continuous batching on the merged "
                    "decoder", name, provider)
        return None
    return step


def _device(session: ort.InferenceSession, provider: str) -> tuple[str, int]:
    """The device IO binding keeps tensors on: ("cuda", its id) on CUDA, else ("cpu", 0)."""
    if provider != CUDA:
        return "cpu", 0
    options = session.get_provider_options().get(CUDA, {})
    return "cuda", int(options.get("device_id", 0))
