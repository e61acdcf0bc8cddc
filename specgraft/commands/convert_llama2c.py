"""``specgraft convert-llama2c``: its arguments, and the command as a call of
:func:`specgraft.llama2c.convert_llama2c`."""

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
    """Convert, then print the output folder and the parameter count."""
    from specgraft.llama2c import convert_llama2c, read_llama2c_header

    out = convert_llama2c(args.checkpoint, args.tokenizer, args.out, overwrite=args.overwrite)
    n_params = read_llama2c_header(args.checkpoint).n_params
    print(out)
    print(f"parameters: {n_params:,}")
    return 0
