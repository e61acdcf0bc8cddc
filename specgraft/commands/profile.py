"""``specgraft profile``'s arguments; the command is :func:`specgraft.tuning.cost.run` (``--engine llamacpp``:
:func:`specgraft.tuning.llamacpp.run_profile`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specgraft.commands.flags import add_attention_kernel_argument, add_linear_kernel_argument
from specgraft.tuning.settings import (
    DEFAULT_KV_LENGTH,
    DEFAULT_REPEATS,
    DEFAULT_TOKEN_COUNTS,
    LLAMACPP_MAX_DRAFT,
    LLAMACPP_NEW_TOKENS,
    LLAMACPP_ROUNDS,
)
from specgraft.utils.args import int_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft profile``."""
    parser.add_argument("--target", required=True, help="target model: a transformers folder or Hub id (with "
                                                        "--engine llamacpp: the target GGUF llama.cpp serves)")
    parser.add_argument("--head", type=Path, action="append", default=[], help="head folder to measure (repeatable)")
    parser.add_argument("--draft", action="append", default=[], help="draft model folder to measure (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    parser.add_argument("--kv-length", type=int, default=DEFAULT_KV_LENGTH,
                        help=f"tokens in the KV cache while measuring (default {DEFAULT_KV_LENGTH}; use your typical "
                             "prompt + answer length)")
    parser.add_argument("--token-counts", type=int_list, default=list(DEFAULT_TOKEN_COUNTS),
                        help="tokens verified at once to measure (default 1,2,3,4,6,8,12,16,24,32,48,64)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timing repeats; the median counts")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing profile file")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's choice); --engine llamacpp: llama.cpp's -t (1)")
    add_linear_kernel_argument(parser)
    add_attention_kernel_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--draft-gguf", type=Path,
                        help="--engine llamacpp: a `specgraft export --format llamacpp` draft.gguf to measure "
                             "(instead of --head/--draft, which are exported now)")
    parser.add_argument("--new-tokens", type=int, default=LLAMACPP_NEW_TOKENS,
                        help=f"--engine llamacpp: tokens generated per request (default {LLAMACPP_NEW_TOKENS})")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``profile`` and ``tune`` share for measuring in a serving engine."""
    parser.add_argument("--engine", choices=("specgraft", "llamacpp"), default="specgraft",
                        help="whose decoding to measure: specgraft's decoder (default), or the pinned llama.cpp "
                             "(llama-server; build it with `bash scripts/build_llamacpp.sh`)")
    parser.add_argument("--max-draft", type=int, default=LLAMACPP_MAX_DRAFT,
                        help=f"--engine llamacpp: the longest draft length measured (1..N; default "
                             f"{LLAMACPP_MAX_DRAFT})")
    parser.add_argument("--rounds", type=int, default=LLAMACPP_ROUNDS,
                        help=f"--engine llamacpp: requests per configuration when measuring costs (default "
                             f"{LLAMACPP_ROUNDS})")


def run(args: argparse.Namespace) -> int:
    """The command itself, in :mod:`specgraft.tuning.cost` (imported only now: it loads torch)."""
    if args.engine != "llamacpp" and args.draft_gguf is not None:
        from specgraft.errors import SpecgraftError

        raise SpecgraftError("--draft-gguf is a llama.cpp draft: add --engine llamacpp (specgraft's decoder takes "
                             "--head/--draft folders)")
    if args.engine == "llamacpp":
        from specgraft.tuning.llamacpp import run_profile

        return run_profile(args)
    from specgraft.tuning.cost import run as profile

    return profile(args)
