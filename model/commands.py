"""Subcommands of `attnserve` provided by `model/`: prepare-data, train, evaluate."""

from __future__ import annotations

import argparse
import logging
import time

logger = logging.getLogger(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to the `attnserve` parser."""
    _register_prepare_data(subcommands)
    _register_train(subcommands)
    _register_evaluate(subcommands)


def _register_prepare_data(subcommands: argparse._SubParsersAction) -> None:
    """`attnserve prepare-data`: DDTP files → corpora, splits and tokenizers."""
    p = subcommands.add_parser(
        "prepare-data",
        help="build the translation / summarization corpora and tokenizers from DDTP files",
        description="Build data/<task>/{train,valid,test}.{src,tgt}, stats.json and a "
        "SentencePiece tokenizer per task from Debian DDTP Translation files "
        "(plain, .xz, .gz or .lz4).",
    )
    p.add_argument("--en", required=True, help="Translation-en file")
    p.add_argument("--it", required=True, help="Translation-it file")
    p.add_argument("--out", default="data", help="output folder (default data)")
    p.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary size")
    p.add_argument("--tasks", nargs="+", default=["translate-en-it", "summarize-en"],
                   choices=["translate-en-it", "summarize-en"], help="tasks to build")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/valid/test split")
    p.add_argument("--valid-fraction", type=float, default=0.02,
                   help="share of descriptions in valid (default 0.02)")
    p.add_argument("--test-fraction", type=float, default=0.02,
                   help="share of descriptions in test (default 0.02)")
    p.set_defaults(func=_prepare_data)


def _prepare_data(args: argparse.Namespace) -> int:
    from model.data import prepare  # lazy: sentencepiece is imported only when run

    start = time.perf_counter()
    stats = prepare(args.en, args.it, out=args.out, vocab_size=args.vocab_size,
                    tasks=args.tasks, seed=args.seed, valid_fraction=args.valid_fraction,
                    test_fraction=args.test_fraction)
    for task, s in stats.items():
        sizes = ", ".join(f"{k} {v['examples']} ({v['descriptions']} descriptions)"
                          for k, v in s["splits"].items())
        logger.info("%s: %s", task, sizes)
    logger.info("prepare-data done in %.1fs", time.perf_counter() - start)
    return 0


def _register_train(subcommands: argparse._SubParsersAction) -> None:
    """`attnserve train`: train (or resume) a model from a run file."""
    p = subcommands.add_parser("train", help="train or resume a model from a YAML/TOML run file")
    p.add_argument("--config", required=True, help="run file, e.g. configs/translate-en-it.yaml")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (with a checkpoint) after this many minutes; rerun to resume")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the run file's)")
    p.add_argument("--run-dir", default=None, help="override the run file's run_dir")
    p.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="override train.precision")
    p.add_argument("--eval-every", type=int, default=None, help="override train.eval_every")
    p.add_argument("--report", default=None,
                   help="write a JSON summary (steps, target tokens/s, validation losses) here")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    import shutil
    from pathlib import Path

    import torch

    from model.run_config import load_examples, load_run_config
    from model.tokenizer import Tokenizer
    from model.training import train

    run = load_run_config(args.config)
    overrides = {name: value for name, value in (
        ("threads", args.threads), ("max_steps", args.max_steps), ("precision", args.precision),
        ("eval_every", args.eval_every)) if value is not None}
    train_config = dataclasses.replace(run.train, **overrides)
    if args.run_dir:
        run = dataclasses.replace(run, run_dir=Path(args.run_dir))
    tokenizer = Tokenizer.from_file(run.tokenizer_path)
    model_config = run.model_config(tokenizer)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run.tokenizer_path, run.run_dir / "tokenizer.model")
    train_set = load_examples(run.data_dir, "train", tokenizer, model_config)
    valid_set = load_examples(run.data_dir, "valid", tokenizer, model_config)
    logger.info("%s: %d train / %d valid examples, %d target tokens per epoch",
                run.task, len(train_set), len(valid_set), train_set.target_tokens())
    result = train(model_config, train_config, train_set, valid_set, run.run_dir, args.max_minutes)
    logger.info("stopped (%s) at step %d, epoch %d; best valid loss %.4f; %.0f target tokens/s",
                result.stopped, result.step, result.epoch, result.best_valid_loss,
                result.target_tokens_per_second)
    if args.report:
        summary = dict(dataclasses.asdict(result), task=run.task, precision=train_config.precision,
                       threads=train_config.threads or torch.get_num_threads())
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _register_evaluate(subcommands: argparse._SubParsersAction) -> None:
    """`attnserve evaluate`: BLEU/chrF or ROUGE of a checkpoint on a split."""
    p = subcommands.add_parser("evaluate", help="score a checkpoint on a split (BLEU/chrF or ROUGE)")
    p.add_argument("--checkpoint", required=True,
                   help="folder with checkpoint.safetensors (a run's best/ or last/, or models/<name>)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.model (default: beside the checkpoint, then in its parent)")
    p.add_argument("--task", required=True, choices=["translate-en-it", "summarize-en"])
    p.add_argument("--data-dir", required=True, help="prepared data folder of the task")
    p.add_argument("--split", default="test", choices=["train", "valid", "test"])
    p.add_argument("--beam", type=int, nargs="+", default=[1, 4], help="beam sizes to score (1 = greedy)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N rows")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.set_defaults(func=_evaluate)


def _evaluate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from model.checkpoint import load_model
    from model.evaluation import evaluate, write_report
    from model.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    candidates = [Path(args.tokenizer)] if args.tokenizer else [
        checkpoint / "tokenizer.model", checkpoint.parent / "tokenizer.model"]
    tokenizer_path = next((p for p in candidates if p.exists()), None)
    if tokenizer_path is None:
        raise SystemExit(f"no tokenizer found (tried {', '.join(map(str, candidates))}); pass --tokenizer")
    report = evaluate(load_model(checkpoint), Tokenizer.from_file(tokenizer_path), args.task,
                      args.data_dir, args.split, args.beam, args.limit, args.batch_size)
    report["checkpoint"] = str(checkpoint)
    if args.out:
        write_report(report, args.out)
    print(json.dumps(report["results"], indent=2))
    return 0
