"""The `attnserve` console command: one entry point, one subcommand per step.

The root knows each subcommand by name, the module that defines it and the extras it needs,
and imports only the module of the subcommand that runs: `attnserve serve` needs the `serve`
extra alone (no torch, no benchmark clients). A subcommand whose extra is missing exits with
status 2 and one line naming the extra to install, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from service.observability import logs
from service.observability.logs import FORMAT_VARIABLE as LOG_FORMAT_VARIABLE
from service.observability.logs import FORMATS as LOG_FORMATS

DISTRIBUTION = "attnserve"


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its name, help line, defining module (with a `register(subparsers)`
    function) and the extras of the distribution it needs."""

    name: str
    help: str
    module: str
    extras: tuple[str, ...]


SUBCOMMANDS = (
    Subcommand("prepare-data", "build the translation / summarization corpora and tokenizers from DDTP files",
               "model.commands", ("train",)),
    Subcommand("train", "train or resume a model from a YAML/TOML run file", "model.commands", ("train",)),
    Subcommand("evaluate", "score a checkpoint on a split (BLEU/chrF or ROUGE)", "model.commands", ("train",)),
    Subcommand("export", "export a checkpoint to an ONNX model repository (parity-checked)",
               "export.commands", ("train", "serve")),
    Subcommand("import-hf", "convert a local Hugging Face Marian model folder into a model repository",
               "export.commands", ("train", "serve")),
    Subcommand("check-parity", "check a model repository's ONNX graphs against its PyTorch weights",
               "export.commands", ("train", "serve")),
    Subcommand("add-step-graph", "give a model repository's fp16 variant the step graph it lacks",
               "export.commands", ("train", "serve")),
    Subcommand("add-shortlist", "give a model repository's int8 variant a vocabulary shortlist",
               "export.commands", ("train", "serve")),
    Subcommand("update-step-graphs", "give a model repository's step graphs this exporter's graph passes",
               "export.commands", ("train", "serve")),
    Subcommand("add-int8-cache", "give a model repository's int8 step graphs an int8 cache",
               "export.commands", ("train", "serve")),
    Subcommand("serve", "serve the models of a model repository over HTTP", "service.process.commands", ("serve",)),
    Subcommand("generate", "translate (or summarize) a text file in-process, one output line per input line",
               "service.process.commands", ("serve",)),
    Subcommand("bench", "benchmark the service against in-process ONNX, naive PyTorch and CTranslate2",
               "bench.commands", ("serve", "train", "bench")),
)
_BY_NAME = {s.name: s for s in SUBCOMMANDS}


class MissingExtra(Exception):
    """A subcommand's extra is not installed; the message is the one line to print."""


def install_hint(extras: Sequence[str]) -> str:
    """The pip command that installs `extras` of this distribution."""
    hint = f"pip install '{DISTRIBUTION}[{','.join(extras)}]'"
    if "serve" in extras:
        gpu = ",".join("gpu" if e == "serve" else e for e in extras)
        hint += f" (on a CUDA machine '{DISTRIBUTION}[{gpu}]')"
    return hint


def missing_requirements(extras: Sequence[str]) -> list[str]:
    """Distributions that `extras` require (per the installed package's metadata) and that are
    not installed. The `serve` extra counts as installed with either build of onnxruntime (its
    CPU build or the `gpu` extra's CUDA build) beside the `server` extra. Empty when attnserve
    itself is not installed (run from a source tree)."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    if "serve" in extras:
        extras = [*extras, "server"]
        if importlib.util.find_spec("onnxruntime") is None:
            missing.append("onnxruntime")
    extras = [e for e in extras if e != "serve"]
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        found = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if not found or found.group(1) not in extras:
            continue
        distribution = re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0)  # type: ignore[union-attr]
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            if distribution not in missing:
                missing.append(distribution)
    return missing


def _root_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get(LOG_FORMAT_VARIABLE, "text"),
                        help="log lines as text or one JSON object per line (default text, or "
                        f"${LOG_FORMAT_VARIABLE})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, subparsers


def _load(subcommand: Subcommand, subparsers: argparse._SubParsersAction) -> None:
    """Import `subcommand`'s module and let it register its subcommands; raises MissingExtra
    when one of its extras is not installed."""
    missing = missing_requirements(subcommand.extras)
    if missing:
        raise MissingExtra(f"attnserve {subcommand.name}: {', '.join(missing)} not installed; "
                           f"install its extras with: {install_hint(subcommand.extras)}")
    try:
        importlib.import_module(subcommand.module).register(subparsers)
    except ModuleNotFoundError as error:
        raise MissingExtra(f"attnserve {subcommand.name}: no module named {error.name!r}; "
                           f"install its extras with: {install_hint(subcommand.extras)}") from None


def build_parser(command: str | None = None, *, load_all: bool = True) -> argparse.ArgumentParser:
    """The argument parser. Imports the module of `command` (or, with `load_all` and no command,
    of every subcommand); the others are listed by name and help only."""
    parser, subparsers = _root_parser()
    loaded: set[str] = set()
    for subcommand in SUBCOMMANDS:
        if subcommand.module in loaded:
            continue
        chosen = subcommand.name == command or (command is None and load_all)
        if chosen or (command in _BY_NAME and _BY_NAME[command].module == subcommand.module):
            _load(subcommand, subparsers)
            loaded.add(subcommand.module)
        else:
            subparsers.add_parser(subcommand.name, help=subcommand.help)
    return parser


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line, if any, without importing anything."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--log-level")
    parser.add_argument("--log-format")
    parser.add_argument("command", nargs="?")
    known, _ = parser.parse_known_args(argv)
    return known.command if known.command in _BY_NAME else None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(_chosen_command(argv), load_all=False)
    except MissingExtra as error:
        print(error, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):  # a subcommand listed by name only: never chosen above
        parser.error(f"unknown command {args.command!r}")
    logs.configure(args.log_level, args.log_format)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
