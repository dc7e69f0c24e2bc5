"""The `attnserve` console command: one entry point, one subcommand per step.

Each package registers its own subcommands and imports its heavy dependencies (torch,
onnxruntime) only when the subcommand runs, so `attnserve serve` works without torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every package's subcommands registered."""
    from export import commands as export_commands
    from model import commands as model_commands
    from service import commands as service_commands

    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_commands.register(subcommands)
    export_commands.register(subcommands)
    service_commands.register(subcommands)
    try:
        from bench import commands as bench_commands
    except ImportError:  # bench/ is not installed in every deployment
        pass
    else:
        bench_commands.register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
