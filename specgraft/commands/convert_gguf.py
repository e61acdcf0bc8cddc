"""``specgraft convert-gguf``: its arguments, and the command as a call of :func:`specgraft.gguf.convert_gguf`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft convert-gguf``."""
    parser.add_argument("file", type=Path, help="a .gguf file, e.g. SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", type=Path, required=True, help="output folder (transformers format)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the saved weights (default float32: dequantized values are exact)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def run(args: argparse.Namespace) -> int:
    """Convert, then print the output folder, the source hash and the parameter count."""
    from specgraft.gguf import convert_gguf, read_source

    start = time.perf_counter()
    out = convert_gguf(args.file, args.out, dtype=args.dtype, overwrite=args.overwrite)
    source = read_source(out)
    n_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(out)
    if source is not None:
        print(f"source: {source.describe()} ({source.model_type})")
    print(f"size: {n_bytes / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s")
    return 0
