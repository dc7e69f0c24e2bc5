"""Write a whole model repository: weights, tokenizer, graphs of every variant, parity check,
variant quality, size budget, and the manifest with the sha256 of every file.

The repository is built in a staging folder beside the target and swapped in at the end, so
a failed export (parity, size) never leaves a half-written model where the service looks.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from export.fused_norms import fuse_skip_layer_norms
from export.fused_projections import fuse_float_projections, fuse_shared_projections
from export.kv_cache import last_source_inputs
from export.onnx_export import DECODER_FILE, ENCODER_FILE, OPSET, export_graphs
from export.parity import check_parity, parity_sources, step_agreement
from export.quality import MAX_DROP, measure_quality, within_bound
from export.step_graph import (
    STEP_DECODER_FILE,
    export_step_graph,
    random_graph_inputs,
    select_before_projection,
    share_input_shapes,
)
from export.storage import WEIGHTS_FILE as GRAPH_WEIGHTS_FILE
from export.storage import add_graphs, load_graph, save_graphs
from export.variants import PRECISIONS, convert, convert_step
from model.checkpoint import WEIGHTS_FILE, load_model, save_weights
from model.run_config import read_split
from model.tokenizer import Tokenizer, VocabFiles, VocabTokenizer, load_tokenizer
from model.transformer import Transformer
from service.repository import graph_io
from service.repository.manifest import (
    MANIFEST_FILE,
    Manifest,
    Variant,
    read_manifest,
    repository_files,
    verify_files,
    write_manifest,
)
from service.runtime import CPU, CUDA, ModelRuntime
from service.runtime.step_buffers import last_source_feed

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"
# a `VocabTokenizer`'s files in the repository, by role (kind "sentencepiece_vocab")
VOCAB_TOKENIZER_FILES = {"source": "source.spm", "target": "target.spm", "vocab": "vocab.json"}
MAX_SIZE_MB = 60.0  # per model repository, all files (MiB, as `du -sm` counts)
DROP_ORDER = ("fp16", "int8")  # variants given up first when the repository is too large
PROVIDERS = {"fp32": [CUDA, CPU], "int8": [CPU], "fp16": [CUDA]}
# Variants whose graphs sit at the repository's root and share its weights.bin, stored as
# bfloat16: the fp32 graphs cast them to float32 and the fp16 graphs to float16 when a session
# is built, so fp16 costs only its graph files.
SHARED_WEIGHTS = ("fp32", "fp16")
# Variants that get the decoder step graph (`export.step_graph`): all. fp16's keeps float16
# caches in its inputs and outputs (`export.variants.convert_step`), the type onnxruntime's CUDA
# GroupQueryAttention takes.
STEP_PRECISIONS = ("fp32", "int8", "fp16")


def variant_file(file: str, precision: str) -> str:
    """Where a graph of a variant is stored: `decoder.onnx` (fp32), `decoder.fp16.onnx`,
    `int8/decoder.onnx`."""
    if precision == "fp32":
        return file
    if precision in SHARED_WEIGHTS:
        return file.removesuffix(".onnx") + f".{precision}.onnx"
    return f"{precision}/{file}"


class RepositoryTooLarge(ValueError):
    """Even the fp32 graphs, weights and tokenizer exceed the size budget."""


def round_to_bf16(model: Transformer) -> Transformer:
    """A copy whose weights are rounded to bfloat16 (kept in float32), so the bf16
    checkpoint.safetensors and the fp32 graphs hold exactly the same numbers."""
    rounded = copy.deepcopy(model).eval()
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
    return rounded


def _check_tokenizer(tokenizer: Tokenizer | VocabTokenizer, model: Transformer) -> None:
    config = model.config
    found = (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id)
    expected = (config.vocab_size, config.pad_id, config.unk_id, config.bos_id, config.eos_id)
    if found != expected:
        raise ValueError(f"tokenizer (vocab, pad, unk, bos, eos) = {found} does not match the model's {expected}")


def _copy_tokenizer(files: str | Path | VocabFiles, staging: Path) -> dict[str, Any]:
    """Copy the tokenizer's files into `staging`; returns the manifest fields that name them."""
    if not isinstance(files, VocabFiles):
        shutil.copyfile(files, staging / TOKENIZER_FILE)
        return {"tokenizer": TOKENIZER_FILE}
    for role, path in files._asdict().items():
        shutil.copyfile(path, staging / VOCAB_TOKENIZER_FILES[role])
    return {"tokenizer": "", "tokenizer_kind": "sentencepiece_vocab", "tokenizer_files": dict(VOCAB_TOKENIZER_FILES)}


def repository_size_mb(directory: Path) -> float:
    return sum((directory / f).stat().st_size for f in repository_files(directory)) / 2**20


def write_repository(
    model: Transformer,
    tokenizer_path: str | Path | VocabFiles,
    out_dir: str | Path,
    *,
    task: str,
    source_language: str,
    target_language: str,
    name: str | None = None,
    variants: Sequence[str] = ("fp32", "int8"),
    data_dir: str | Path | None = None,
    quality_rows: int = 500,
    sources: list[list[int]] | None = None,
    max_size_mb: float | None = MAX_SIZE_MB,
    threads: int = 0,
    provenance: dict[str, Any] | None = None,
) -> Manifest:
    """Export `model` into the repository `out_dir` (replaced if it exists) and return its manifest.

    `sources` (ids ending with EOS) feed the parity check (synthetic ones by default); with
    `data_dir`, every variant's quality is measured on `quality_rows` test rows and a variant
    more than `MAX_DROP` points below fp32 is not servable (without, only fp32 is).
    `provenance` (e.g. the checkpoint's path and training step) is recorded in the manifest.
    `tokenizer_path` is a SentencePiece model, or the `VocabFiles` of an imported Marian tokenizer.
    """
    if "fp32" not in variants or set(variants) - set(PRECISIONS):
        raise ValueError(f"variants must include fp32 and be among {PRECISIONS}, got {list(variants)}")
    out_dir = Path(out_dir)
    name = name or out_dir.name
    tokenizer = load_tokenizer(tokenizer_path)
    _check_tokenizer(tokenizer, model)
    model = round_to_bf16(model)
    staging = out_dir.parent / f".{out_dir.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        manifest = _build(staging, model, tokenizer_path, name, task, source_language, target_language, variants,
                          data_dir, quality_rows, sources, max_size_mb, threads, provenance or {})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-made model where the service looks
        raise

    # swap in: the old repository (if any) is replaced in two renames
    previous = out_dir.parent / f".{out_dir.name}.previous"
    shutil.rmtree(previous, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(previous)
    staging.rename(out_dir)
    shutil.rmtree(previous, ignore_errors=True)
    log.info("wrote %s (%.1f MB): variants %s", out_dir, manifest.exporter["size_mb"],
             {k: v.servable for k, v in manifest.variants.items()})
    return manifest


def _build(
    staging: Path, model: Transformer, tokenizer_path: str | Path | VocabFiles, name: str, task: str, source_language: str,
    target_language: str, variants: Sequence[str], data_dir: str | Path | None, quality_rows: int,
    sources: list[list[int]] | None, max_size_mb: float | None, threads: int, provenance: dict[str, Any],
) -> Manifest:
    config = model.config

    # 1. weights, tokenizer, graphs
    save_weights(model, staging, dtype=torch.bfloat16)
    tokenizer_fields = _copy_tokenizer(tokenizer_path, staging)
    graphs = export_graphs(model)
    graphs[STEP_DECODER_FILE] = export_step_graph(model)  # last: the others' weights keep their offsets
    entries: dict[str, Variant] = {}
    root: dict[str, onnx.ModelProto] = {}  # fp32 and fp16 graphs: one weights.bin, bfloat16 numbers
    for precision in variants:
        converted = {file: (convert_step if file == STEP_DECODER_FILE else convert)(graph, precision)
                     for file, graph in graphs.items() if file != STEP_DECODER_FILE or precision in STEP_PRECISIONS}
        names = {file: variant_file(file, precision) for file in converted}
        if precision in SHARED_WEIGHTS:
            root.update({names[file]: graph for file, graph in converted.items()})
        else:
            save_graphs(staging / precision, converted)
        entries[precision] = Variant(
            encoder=names[ENCODER_FILE], decoder=names[DECODER_FILE], precision=precision,
            providers=PROVIDERS[precision], servable=precision == "fp32", quality=None,
            note="" if precision == "fp32" or data_dir is not None else "quality not measured (no --data-dir)",
            step_decoder=names.get(STEP_DECODER_FILE, ""),
        )
    shared = {variant_file(file, precision): file for precision in variants if precision in SHARED_WEIGHTS
              for file in graphs}
    save_graphs(staging, root, bfloat16_weights=True, converted_from=shared)
    manifest = Manifest(
        name=name, task=task, source_language=source_language, target_language=target_language,
        model_config=config.to_dict(),
        special_ids={"pad": config.pad_id, "unk": config.unk_id, "bos": config.bos_id, "eos": config.eos_id},
        max_source_len=config.max_source_len, max_target_len=config.max_target_len, opset=OPSET,
        io=graph_io.io_section(config.n_encoder_layers, config.n_decoder_layers), variants=entries,
        checkpoint=WEIGHTS_FILE, **tokenizer_fields,
        exporter=dict(_exporter_info(), source=provenance),
    )
    write_manifest(staging, manifest)

    # 2. parity of the fp32 graphs with the checkpoint as written
    runtime = ModelRuntime.load(staging, [CPU], threads=threads, variant="fp32")
    sources = sources or parity_sources(config.vocab_size, config.eos_id)
    report = check_parity(load_model(staging), runtime, sources, max_new_tokens=min(32, config.max_target_len))
    manifest.exporter["parity"] = report.to_dict()
    # ... and the other variants' step graphs' tokens with the fp32 step graph's
    for precision, entry in entries.items():
        if precision != "fp32" and entry.step_decoder:
            variant_runtime = ModelRuntime.load(staging, [CPU], threads=threads, variant=precision, step_graph=True)
            manifest.exporter.setdefault("step_graph_agreement", {})[precision] = step_agreement(
                runtime, variant_runtime, sources, min(32, config.max_target_len), "the parity check's")

    # 3. quality of every variant through onnxruntime
    if data_dir is not None:
        manifest.quality = measure_quality(runtime, data_dir, quality_rows, progress=True)
        entries["fp32"].quality = manifest.quality
        for precision in variants:
            if precision == "fp32":
                continue
            variant_runtime = ModelRuntime.load(staging, [CPU], threads=threads, variant=precision)
            quality = measure_quality(variant_runtime, data_dir, quality_rows, progress=True)
            entry = entries[precision]
            entry.quality, entry.servable = quality, within_bound(task, manifest.quality, quality)
            entry.note = (f"within {MAX_DROP:g} point of fp32" if entry.servable
                          else f"more than {MAX_DROP:g} point below fp32: not servable")
            if precision == "fp16":
                entry.note += "; quality measured on CPUExecutionProvider"
    if data_dir is not None and quality_rows < 500:
        manifest.exporter["quality_note"] = f"quality on {quality_rows} test rows only (fewer than 500)"

    # 4. size budget: give up variants (fp16 first), never fp32
    if max_size_mb is not None:
        _fit(staging, manifest, max_size_mb)
    manifest.exporter["size_mb"] = round(repository_size_mb(staging), 1)
    write_manifest(staging, manifest)
    return manifest


def _fit(directory: Path, manifest: Manifest, max_size_mb: float) -> None:
    for precision in DROP_ORDER:
        size = repository_size_mb(directory)
        if size <= max_size_mb:
            return
        if precision in manifest.variants:
            variant = manifest.variants.pop(precision)
            files = [directory / f for f in (variant.encoder, variant.decoder, variant.step_decoder) if f]
            if (directory / precision).is_dir():
                files += [f for f in (directory / precision).iterdir() if f not in files]
            variant_mb = sum(f.stat().st_size for f in files) / 2**20
            for file in files:
                file.unlink()
            if (directory / precision).is_dir():
                (directory / precision).rmdir()
            manifest.exporter.get("step_graph_agreement", {}).pop(precision, None)
            log.warning("%s: %.1f MB > %.0f MB, dropped the %s variant (%.1f MB)",
                        manifest.name, size, max_size_mb, precision, variant_mb)
            manifest.exporter.setdefault("dropped_variants", {})[precision] = {
                "reason": f"repository over {max_size_mb:g} MB", "size_mb": round(variant_mb, 1),
                "quality": variant.quality, "would_be_servable": variant.servable,
            }
    size = repository_size_mb(directory)
    if size > max_size_mb:
        raise RepositoryTooLarge(f"{directory}: {size:.1f} MB with fp32 only, over {max_size_mb:g} MB")


def add_step_graph(
    directory: str | Path, precision: str = "fp16", *, data_dir: str | Path | None = None, rows: int = 64,
    max_new_tokens: int = 32, max_size_mb: float | None = MAX_SIZE_MB, threads: int = 0,
) -> Manifest:
    """Give the `precision` variant of the repository `directory` the step graph it lacks, as an
    export makes it, and leave every other file as it is: the fp32 step graph converted
    (`convert_step`) and stored beside it, its weights read from the shared `weights.bin` (only a
    weight not found there is appended); its greedy tokens checked against the fp32 step graph's
    (`step_agreement`) on the first `rows` test sources of `data_dir`, tokenized by the
    repository's tokenizer (synthetic sources without it); the manifest then names it as the
    variant's `step_decoder`, records the agreement and lists the new file's sha256. Only a
    variant whose graphs share the root weights (`SHARED_WEIGHTS`, not fp32) can be given one.
    On any failure (a disagreeing graph, a repository over `max_size_mb`) the repository is left
    as it was. Returns the new manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    if precision == "fp32" or precision not in SHARED_WEIGHTS:
        raise ValueError(f"only a variant whose graphs share the fp32 weights can be given a step graph here, "
                         f"not {precision!r}")
    variant, fp32 = manifest.variant(precision), manifest.variant("fp32")
    if variant.step_decoder:
        raise ValueError(f"{directory}: the {precision} variant has a step graph already ({variant.step_decoder})")
    if not fp32.step_decoder:
        raise ValueError(f"{directory}: no fp32 step graph to convert (re-export the repository)")
    name = variant_file(STEP_DECODER_FILE, precision)
    manifest_text = (directory / MANIFEST_FILE).read_bytes()
    weights = directory / GRAPH_WEIGHTS_FILE
    weights_size = weights.stat().st_size
    graph = load_graph(directory / fp32.step_decoder)
    try:
        add_graphs(directory, {name: convert_step(graph, precision)}, bfloat16_weights=True,
                   converted_from={name: graph})
        variant.step_decoder = name
        write_manifest(directory, manifest)
        reference = ModelRuntime.load(directory, [CPU], threads=threads, variant="fp32")
        runtime = ModelRuntime.load(directory, [CPU], threads=threads, variant=precision, step_graph=True)
        config = manifest.config
        if data_dir is not None:
            texts, _ = read_split(data_dir, "test")
            keep = manifest.max_source_len - 1
            sources = [ids[:keep] + [config.eos_id] for ids in reference.tokenizer.encode_batch(texts[:rows])]
            label = f"test split, first {len(sources)} rows"
        else:
            sources, label = parity_sources(config.vocab_size, config.eos_id), "synthetic"
        manifest.exporter.setdefault("step_graph_agreement", {})[precision] = step_agreement(
            reference, runtime, sources, min(max_new_tokens, config.max_target_len), label)
        size = repository_size_mb(directory)
        if max_size_mb is not None and size > max_size_mb:
            raise RepositoryTooLarge(f"{directory}: {size:.1f} MB with the {precision} step graph, "
                                     f"over {max_size_mb:g} MB")
        manifest.exporter["size_mb"] = round(size, 1)
        write_manifest(directory, manifest)
    except BaseException:
        (directory / name).unlink(missing_ok=True)
        with weights.open("r+b") as file:
            file.truncate(weights_size)
        (directory / MANIFEST_FILE).write_bytes(manifest_text)
        raise
    log.info("%s: added %s (%d bytes)", directory, name, (directory / name).stat().st_size)
    return manifest


def step_graph_files(manifest: Manifest) -> list[str]:
    """The step graphs a repository ships: each variant's and its shortlist's, once each."""
    files = [variant.step_decoder for variant in manifest.variants.values() if variant.step_decoder]
    files += [variant.shortlist["step_decoder"] for variant in manifest.variants.values() if variant.shortlist]
    return list(dict.fromkeys(files))


@contextlib.contextmanager
def restored_on_failure(directory: Path, names: Iterable[str]) -> Iterator[None]:
    """On any failure inside, the files `names` of the repository `directory` and its manifest
    get back the bytes they had on entry."""
    saved = {name: (directory / name).read_bytes() for name in [*names, MANIFEST_FILE]}
    try:
        yield
    except BaseException:
        for name, data in saved.items():
            (directory / name).write_bytes(data)
        raise


def update_step_graphs(directory: str | Path, float_projections: bool = False, layer_norms: bool = False) -> list[str]:
    """Give the step graphs of the repository `directory` (`step_graph_files`) this exporter's
    graph passes (`share_input_shapes`, `select_before_projection`, for an int8 cache
    `kv_cache.last_source_inputs`, and for int8 graphs `fused_projections.fuse_shared_projections`;
    for the float graphs, passes the export does not apply, with `float_projections`
    `fused_projections.fuse_float_projections` and with `layer_norms`
    `fused_norms.fuse_skip_layer_norms`), in place: the graphs' nodes (and inputs) change; a
    fused int8 weight is appended to the graph's `weights.bin`, whose other weights stay where
    they are. Each changed graph must give the old one's outputs exactly on random inputs
    (`_same_outputs`), or, with fused layer norms, within `NORM_TOLERANCE` of the largest and the
    same next token on every row; the manifest then lists the new sha256s. Returns the graph
    files changed (none when they have the passes already); on any failure the repository is
    left as it was."""
    from onnx.external_data_helper import load_external_data_for_model

    directory = Path(directory)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    files = step_graph_files(manifest)
    weights = [name for name in dict.fromkeys((Path(f).parent / GRAPH_WEIGHTS_FILE).as_posix() for f in files)
               if (directory / name).exists()]
    originals: dict[str, bytes] = {}
    with restored_on_failure(directory, [*files, *weights]):
        for name in files:
            path = directory / name
            graph = onnx.load_model(str(path), load_external_data=False)
            changed = share_input_shapes(graph) + select_before_projection(graph) + last_source_inputs(graph)
            fused = normed = 0
            integer = any(node.op_type == "MatMulInteger" for node in graph.graph.node)
            if integer:  # int8: its weights are read
                with_weights = onnx.ModelProto()
                with_weights.CopyFrom(graph)
                load_external_data_for_model(with_weights, str(path.parent))
                fused = fuse_shared_projections(with_weights)
            else:  # the float graphs, as asked: the graph alone changes, no weight is written
                normed = fuse_skip_layer_norms(graph) if layer_norms else 0
                fused = normed + (fuse_float_projections(graph) if float_projections else 0)
            if not changed + fused:
                continue
            originals[name] = path.read_bytes()
            if fused and integer:
                add_graphs(path.parent, {path.name: with_weights})
            else:
                onnx.save_model(graph, str(path))
            _same_outputs(path, originals[name], manifest.config.vocab_size, manifest.config.n_decoder_layers,
                          tolerance=_norm_tolerance(graph) if normed else 0.0)
        if originals:
            write_manifest(directory, manifest)
            verify_files(directory, read_manifest(directory))
    for name in originals:
        log.info("%s: %s updated", directory, name)
    return list(originals)


# fused layer norms: each output within this share of its largest value, fp32 and fp16 graphs
NORM_TOLERANCE = {onnx.TensorProto.FLOAT: 1e-5, onnx.TensorProto.FLOAT16: 1e-3}


def _norm_tolerance(graph: onnx.ModelProto) -> float:
    """`NORM_TOLERANCE` of the step graph's cache type."""
    cache = next(value for value in graph.graph.input if value.name == graph_io.past_names(1)[0])
    return NORM_TOLERANCE[cache.type.tensor_type.elem_type]


def _same_outputs(path: Path, original: bytes, vocab_size: int, layers: int, seed: int = 0,
                  tolerance: float = 0.0) -> None:
    """The step graph at `path` gives exactly the outputs of the graph `original` (serialized,
    its weights beside `path`) on `random_graph_inputs` (the new graph's last source positions, if
    only it takes them, worked out from the same source mask and cross keys/values:
    `step_buffers.last_source_feed`); with a `tolerance`, each output within that share of its
    largest magnitude and the logits' largest on the same piece of every row."""
    import numpy as np
    import onnxruntime as ort

    scratch = path.with_name(f".{path.name}.original")
    scratch.write_bytes(original)
    try:
        sessions = [ort.InferenceSession(str(p), providers=[CPU]) for p in (path, scratch)]
    except Exception as error:  # onnxruntime's own types
        raise RuntimeError(f"{path}: onnxruntime cannot load the graph: {error}") from error
    finally:
        scratch.unlink()
    feed = random_graph_inputs(sessions[1], vocab_size, seed)
    new_feed = dict(feed)
    if graph_io.SOURCE_LAST not in feed:  # the pass gave the new graph these inputs
        cross = [feed[name] for name in graph_io.cross_names(layers)]
        new_feed.update(last_source_feed(sessions[0], cross, feed["source_mask"]))
    new_feed = {value.name: new_feed[value.name] for value in sessions[0].get_inputs()}
    try:
        new, old = (session.run(None, f) for session, f in zip(sessions, (new_feed, feed), strict=True))
    except Exception as error:  # onnxruntime's own types
        raise RuntimeError(f"{path}: the graph fails on random inputs: {error}") from error
    for output, a, b in zip(sessions[1].get_outputs(), new, old, strict=True):
        if not tolerance and not np.array_equal(a, b):
            raise RuntimeError(f"{path}: output {output.name} changed with the graph passes")
        scale = max(1.0, float(np.abs(b.astype(np.float32)).max(initial=0.0)))
        if tolerance and float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max(initial=0.0)) > tolerance * scale:
            raise RuntimeError(f"{path}: output {output.name} moved by more than {tolerance} of its largest value")
        if tolerance and output.name == "logits" and not np.array_equal(a.argmax(axis=-1), b.argmax(axis=-1)):
            raise RuntimeError(f"{path}: the fused graph chooses another next token")


def _exporter_info() -> dict[str, Any]:
    import onnx
    import onnxruntime

    return {
        "exporter": "torch.onnx.export(dynamo=True)",
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "weights": "rounded to bfloat16: the graphs hold the numbers of checkpoint.safetensors",
        "decoder": "merged: one graph for the first step (past_len 0) and the steps with a cache",
        "decoder_step": "continuous batching's step: GroupQueryAttention over each row's own cache, in place",
    }
