"""``specgraft convert-llama2c``'s arguments; the command is :func:`specgraft.llama2c.run`."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft convert-llama2c``."""
    parser.add_argument("checkpoint", type=Path, help="llama2.c legacy checkpoint, e.g. stories260K.bin")
    parser.add_argument("tokenizer", type=Path, help="llama2.c tokenizer, e.g. tok512.bin")
    parser.add_argument("--out", type=Path, required=True, help="output folder (transformers format)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def run(args: argparse.Namespace) -> int:
    """The command itself, in :mod:`specgraft.llama2c` (imported only now: it loads torch)."""
    from specgraft.llama2c import run as convert

    return convert(args)
