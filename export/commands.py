"""Subcommands of `attnserve` provided by `export/`: export, import-hf, check-parity, add-step-graph,
add-shortlist."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# CLI task -> (manifest task, source language, target language)
TASKS = {"translate-en-it": ("translate", "en", "it"), "summarize-en": ("summarize", "en", "en")}


def register(subcommands: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to the `attnserve` parser."""
    _register_export(subcommands)
    _register_import_hf(subcommands)
    _register_check_parity(subcommands)
    _register_add_step_graph(subcommands)
    _register_add_shortlist(subcommands)
    _register_update_step_graphs(subcommands)
    _register_add_int8_cache(subcommands)


def _register_export(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "export", help="export a checkpoint to an ONNX model repository (parity-checked)",
        description="Write models/<name>: manifest.json, tokenizer.model, checkpoint.safetensors (bf16), "
        "encoder.onnx + decoder.onnx (fp32, merged decoder with KV cache and attention outputs) and the "
        "int8/fp16 variants; checks parity with PyTorch and measures each variant's quality.",
    )
    p.add_argument("--checkpoint", required=True, help="folder with checkpoint.safetensors (e.g. runs/<task>/best)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.model (default: beside the checkpoint, then in its parent)")
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--out", required=True, help="model repository to write, e.g. models/translate-en-it")
    p.add_argument("--name", default=None, help="model name (default: the --out folder's name)")
    p.add_argument("--variants", nargs="+", default=["fp32", "int8", "fp16"], choices=["fp32", "int8", "fp16"],
                   help="variants to build (fp32 always); those over --max-size-mb are dropped, fp16 first")
    p.add_argument("--data-dir", default=None,
                   help="prepared data of the task: parity on its test sources and quality per variant")
    p.add_argument("--quality-rows", type=int, default=500, help="test rows scored per variant (default 500)")
    p.add_argument("--max-size-mb", type=float, default=60.0,
                   help="size budget of the repository; variants are dropped (fp16 first) to fit; 0 = none")
    p.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: default)")
    p.set_defaults(func=_export)


def _find_tokenizer(checkpoint: str, given: str | None) -> str:
    from pathlib import Path

    candidates = [Path(given)] if given else [Path(checkpoint) / "tokenizer.model",
                                              Path(checkpoint).parent / "tokenizer.model"]
    found = next((p for p in candidates if p.exists()), None)
    if found is None:
        raise SystemExit(f"no tokenizer found (tried {', '.join(map(str, candidates))}); pass --tokenizer")
    return str(found)


def _test_sources(data_dir: str, tokenizer: Any, max_source_len: int, count: int = 6) -> list[list[int]]:
    """The first `count` test sources, tokenized like the service does (ids + EOS) by `tokenizer`
    (a loaded tokenizer, or the path of a SentencePiece model)."""
    from model.run_config import read_split
    from model.tokenizer import load_tokenizer

    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    sources, _ = read_split(data_dir, "test")
    return [ids[: max_source_len - 1] + [tokenizer.eos_id] for ids in tokenizer.encode_batch(sources[:count])]


def _provenance(checkpoint: str) -> dict[str, object]:
    """Where the weights come from: the folder and, for a training run's folder, its step.
    Re-exporting a model repository (a folder with a manifest) keeps that manifest's record
    of the training run, since the graphs hold the same bf16 weights."""
    import math
    from pathlib import Path

    from service.repository.manifest import MANIFEST_FILE, sha256_file

    if (Path(checkpoint) / MANIFEST_FILE).exists():  # any format version: only its record is read
        earlier = json.loads((Path(checkpoint) / MANIFEST_FILE).read_text()).get("exporter", {}).get("source")
        if isinstance(earlier, dict) and earlier:
            return dict(earlier, re_exported_from=checkpoint)
    found: dict[str, object] = {"checkpoint": checkpoint,
                                "sha256": sha256_file(Path(checkpoint) / "checkpoint.safetensors")}
    state = Path(checkpoint) / "trainer_state.json"
    if state.exists():
        values = json.loads(state.read_text())
        found.update({k: values[k] for k in ("step", "epoch", "best_valid_loss")
                      if k in values and math.isfinite(values[k])})
    return found


def _export(args: argparse.Namespace) -> int:
    import time

    import torch

    from export.repository import write_repository
    from model.checkpoint import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer = _find_tokenizer(args.checkpoint, args.tokenizer)
    model = load_model(args.checkpoint)
    task, source_language, target_language = TASKS[args.task]
    sources = _test_sources(args.data_dir, tokenizer, model.config.max_source_len) if args.data_dir else None
    manifest = write_repository(
        model, tokenizer, args.out, task=task, source_language=source_language,
        target_language=target_language, name=args.name, variants=["fp32", *[v for v in args.variants if v != "fp32"]],
        data_dir=args.data_dir, quality_rows=args.quality_rows, sources=sources,
        max_size_mb=args.max_size_mb or None, threads=args.threads, provenance=_provenance(args.checkpoint),
    )
    summary = {name: {"servable": v.servable, "quality": v.quality} for name, v in manifest.variants.items()}
    print(json.dumps({"model": manifest.name, "size_mb": manifest.exporter.get("size_mb"), "variants": summary,
                      "dropped": manifest.exporter.get("dropped_variants", {})}, indent=2))
    logger.info("export done in %.0fs", time.perf_counter() - started)
    return 0


def _register_import_hf(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "import-hf", help="convert a local Hugging Face Marian or BART model folder into a model repository",
        description="Read a MarianMTModel or BartForConditionalGeneration folder (config.json, weights and a "
        "SentencePiece tokenizer; never downloads), convert it, check it against transformers, and write a model "
        "repository like `export` does (graphs with attention outputs, step graph, tokenizer, manifest, parity "
        "check). Marian: source.spm, target.spm and vocab.json (OPUS-MT's two models and joint vocabulary are "
        "served as transformers' MarianTokenizer tokenizes). BART: the "
        "tokenizer must be a SentencePiece model saved as sentencepiece.bpe.model (byte-level BPE folders are "
        "refused).",
    )
    p.add_argument("--model-dir", required=True, help="the Hugging Face model folder")
    p.add_argument("--task", required=True, help="translate-<src>-<tgt> (e.g. translate-en-de) or summarize-<lang>")
    p.add_argument("--out", required=True, help="model repository to write, e.g. models/translate-en-de")
    p.add_argument("--name", default=None, help="model name (default: the --out folder's name)")
    p.add_argument("--variants", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8", "fp16"],
                   help="variants to build (fp32 always; the others are not servable without a quality measure)")
    p.add_argument("--max-source-len", type=int, default=256, help="source tokens including EOS (default 256)")
    p.add_argument("--max-target-len", type=int, default=128, help="generated tokens including EOS (default 128)")
    p.add_argument("--max-size-mb", type=float, default=0.0, help="size budget of the repository; 0 = none")
    p.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: default)")
    p.set_defaults(func=_import_hf)


def _import_hf(args: argparse.Namespace) -> int:
    import torch

    from export.hf_import import UnsupportedModel, import_hf
    from export.parity import ParityError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        manifest = import_hf(
            args.model_dir, args.out, task=args.task, name=args.name,
            variants=["fp32", *[v for v in args.variants if v != "fp32"]], max_source_len=args.max_source_len,
            max_target_len=args.max_target_len, max_size_mb=args.max_size_mb or None, threads=args.threads,
        )
    except (UnsupportedModel, ValueError) as error:
        logger.error("cannot import %s: %s", args.model_dir, error)
        return 2
    except ParityError as error:
        logger.error("the imported model disagrees: %s", error)
        return 1
    print(json.dumps({"model": manifest.name, "size_mb": manifest.exporter.get("size_mb"),
                      "variants": {name: v.servable for name, v in manifest.variants.items()},
                      "transformers_parity": manifest.exporter["source"]["transformers_parity"]}, indent=2))
    return 0


def _register_check_parity(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "check-parity", help="compare a model repository's ONNX graphs with its PyTorch checkpoint",
        description="Verify the manifest hashes, then compare encoder outputs, step logits, attention "
        "weights and greedy tokens of onnxruntime with PyTorch; exits 1 with the difference if they "
        "disagree, 2 if the repository fails to load.",
    )
    p.add_argument("--model-dir", required=True, help="model repository, e.g. models/translate-en-it")
    p.add_argument("--checkpoint", default=None,
                   help="PyTorch checkpoint folder (default: the repository's own checkpoint.safetensors)")
    p.add_argument("--variant", default="fp32", help="variant to check (tolerances are fp32's; default fp32)")
    p.add_argument("--data-dir", default=None, help="use the task's first test sources instead of synthetic ones")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=_check_parity)


def _check_parity(args: argparse.Namespace) -> int:
    import torch

    from export.parity import ParityError, check_parity, parity_sources
    from model.checkpoint import load_model
    from service.runtime import CPU, ModelLoadError, ModelRuntime

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        runtime = ModelRuntime.load(args.model_dir, [CPU], threads=args.threads, variant=args.variant)
    except ModelLoadError as error:
        logger.error("cannot load the model: %s", error)
        return 2
    model = load_model(args.checkpoint or args.model_dir)
    config = model.config
    if args.data_dir:
        sources = _test_sources(args.data_dir, runtime.tokenizer, config.max_source_len)
    else:
        sources = parity_sources(config.vocab_size, config.eos_id)
    try:
        report = check_parity(model, runtime, sources, args.max_new_tokens)
    except ParityError as error:
        logger.error("parity check failed: %s", error)
        return 1
    print(json.dumps(report.to_dict(), indent=2))
    return 0


def _register_add_step_graph(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "add-step-graph", help="give a model repository's fp16 variant the step graph it lacks",
        description="Convert the repository's fp32 step graph (decoder_step.onnx) to the fp16 variant's "
        "decoder_step.fp16.onnx (float16 caches, for CUDA's GroupQueryAttention), its weights shared with "
        "weights.bin; check that it decodes the fp32 step graph's greedy tokens on most rows (CPU) and record "
        "it in the manifest. Every other file stays as it is; on failure the repository is left unchanged.",
    )
    p.add_argument("--model-dir", required=True, help="model repository, e.g. models/translate-en-it")
    p.add_argument("--data-dir", default=None, help="check on the task's first test sources instead of synthetic ones")
    p.add_argument("--rows", type=int, default=64, help="test sources checked with --data-dir (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-size-mb", type=float, default=60.0, help="size budget of the repository; 0 = none")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0: default)")
    p.set_defaults(func=_add_step_graph)


def _add_step_graph(args: argparse.Namespace) -> int:
    from export.parity import StepDisagreement
    from export.repository import add_step_graph
    from service.repository.manifest import ManifestError
    from service.runtime import ModelLoadError

    try:
        manifest = add_step_graph(args.model_dir, "fp16", data_dir=args.data_dir, rows=args.rows,
                                  max_new_tokens=args.max_new_tokens, max_size_mb=args.max_size_mb or None,
                                  threads=args.threads)
    except (ManifestError, ModelLoadError, ValueError) as error:
        logger.error("cannot add a step graph to %s: %s", args.model_dir, error)
        return 2
    except StepDisagreement as error:
        logger.error("the new step graph disagrees: %s", error)
        return 1
    print(json.dumps({"model": manifest.name, "step_decoder": manifest.variants["fp16"].step_decoder,
                      "size_mb": manifest.exporter.get("size_mb"),
                      "step_graph_agreement": manifest.exporter["step_graph_agreement"]["fp16"]}, indent=2))
    return 0


def _register_update_step_graphs(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "update-step-graphs", help="give a model repository's step graphs this exporter's graph passes",
        description="Rewrite the step graphs a repository ships (each variant's decoder_step and its "
        "shortlist's) with the graph passes a new export applies (every layer reads its cache's shape from "
        "one input, so onnxruntime computes the per-layer index arithmetic once per step; each row's position "
        "is taken before the output projection, so no copy of the logits follows it; an int8 self-attention "
        "takes its query, key and value from one product); check that each gives the old graph's outputs "
        "exactly and record the new sha256s. Every other file stays as it is (a fused weight is appended to "
        "the graph's weights.bin); on failure the repository is left unchanged.",
    )
    p.add_argument("--model-dir", required=True, help="model repository, e.g. models/translate-en-it")
    p.add_argument("--pack-float-projections", action="store_true",
                   help="also give the fp32 and fp16 step graphs each self-attention's query, key and value as "
                   "one packed product (the graph alone; not applied by the export: bench.static_step measures "
                   "it on a GPU)")
    p.add_argument("--fuse-layer-norms", action="store_true",
                   help="also give the fp32 and fp16 step graphs each residual Add and its LayerNormalization as "
                   "one SkipLayerNormalization (the graph alone; checked within a tolerance, not to the last bit; "
                   "not applied by the export: bench.static_step measures it on a GPU)")
    p.set_defaults(func=_update_step_graphs)


def _update_step_graphs(args: argparse.Namespace) -> int:
    from export.repository import update_step_graphs
    from service.repository.manifest import ManifestError

    try:
        changed = update_step_graphs(args.model_dir, float_projections=args.pack_float_projections,
                                     layer_norms=args.fuse_layer_norms)
    except (ManifestError, RuntimeError, OSError) as error:
        logger.error("cannot update the step graphs of %s: %s", args.model_dir, error)
        return 2
    print(json.dumps({"model_dir": args.model_dir, "updated": changed}, indent=2))
    return 0


def _register_add_int8_cache(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "add-int8-cache", help="give a model repository's int8 step graphs an int8 cache",
        description="Rewrite the step graphs of a variant (its decoder_step and its shortlist's) so that "
        "their self-attention cache and cross keys/values are int8 with one fixed scale per tensor and layer "
        "(onnxruntime's GroupQueryAttention quantizes new positions and dequantizes as it reads), the scales "
        "calibrated on the valid split; decode the test split in a running batch before and after and record "
        "both scores (BLEU and chrF, or ROUGE-1/2/L) and the scales in the manifest. Refused, the repository "
        "left unchanged, when a score drops more than --max-drop points.",
    )
    p.add_argument("--model-dir", required=True, help="model repository, e.g. models/translate-en-it")
    p.add_argument("--data-dir", required=True, help="the task's data folder ({valid,test}.{src,tgt})")
    p.add_argument("--variant", default="int8")
    p.add_argument("--calibration-rows", type=int, default=500, help="valid sentences to calibrate on")
    p.add_argument("--test-rows", type=int, help="test sentences to measure quality on (default: all)")
    p.add_argument("--max-drop", type=float, default=0.1, help="largest drop of any score allowed (default 0.1)")
    p.set_defaults(func=_add_int8_cache)


def _add_int8_cache(args: argparse.Namespace) -> int:
    from export.kv_cache import QualityDrop, add_int8_cache
    from service.repository.manifest import ManifestError

    try:
        record = add_int8_cache(args.model_dir, args.data_dir, args.variant, args.calibration_rows,
                                args.test_rows, args.max_drop)
    except QualityDrop as error:
        logger.error("the int8 cache costs too much: %s", error)
        return 1
    except (ManifestError, ValueError, RuntimeError, OSError) as error:
        logger.error("cannot add an int8 cache to %s: %s", args.model_dir, error)
        return 2
    print(json.dumps({"model_dir": args.model_dir, "int8_cache": record or "present already"}, indent=2))
    return 0


def _register_add_shortlist(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser(
        "add-shortlist", help="give a model repository's int8 variant a vocabulary shortlist",
        description="Build the lexical table (per source piece its K target pieces of highest association "
        "over the training pairs, plus the N most frequent target pieces) and the step graph whose output "
        "projection computes only a batch's shortlist, its weights shared with the variant's weights.bin; "
        "measure its cost on the test split, each sentence decoded alone, and record both in the manifest. "
        "Continuous batching then uses it for steps of at most ATTNSERVE_SHORTLIST_ROWS rows. Refused, the "
        "repository left unchanged, when a quality metric drops more than --max-drop points.",
    )
    p.add_argument("--model-dir", required=True, help="model repository, e.g. models/translate-en-it")
    p.add_argument("--data-dir", required=True, help="the task's data folder ({train,test}.{src,tgt})")
    p.add_argument("-k", type=int, default=20, help="candidates per source piece (default 20)")
    p.add_argument("-n", type=int, default=500, help="most frequent target pieces in every shortlist (default 500)")
    p.add_argument("--score", choices=("dice", "lift"), default="dice")
    p.add_argument("--rows", type=int, default=None, help="test rows the cost is measured on (default: all)")
    p.add_argument("--max-drop", type=float, default=0.1, help="largest drop of a quality metric, points")
    p.add_argument("--max-size-mb", type=float, default=60.0, help="size budget of the repository; 0 = none")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0: default)")
    p.set_defaults(func=_add_shortlist)


def _add_shortlist(args: argparse.Namespace) -> int:
    from export.shortlist import ShortlistTooCostly, add_shortlist
    from service.repository.manifest import ManifestError
    from service.runtime import ModelLoadError

    try:
        entry = add_shortlist(args.model_dir, args.data_dir, k=args.k, frequent=args.n, score=args.score,
                              rows=args.rows, max_drop=args.max_drop, max_size_mb=args.max_size_mb or None,
                              threads=args.threads)
    except ShortlistTooCostly as error:
        logger.error("the shortlist is not added: %s", error)
        return 1
    except (ManifestError, ModelLoadError, ValueError, FileNotFoundError) as error:
        logger.error("cannot add a shortlist to %s: %s", args.model_dir, error)
        return 2
    print(json.dumps(entry, indent=2))
    return 0
