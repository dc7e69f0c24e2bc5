"""Subcommands of `attnserve` provided by `bench/`: bench."""

from __future__ import annotations

import argparse


def register(subcommands: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to the `attnserve` parser."""
