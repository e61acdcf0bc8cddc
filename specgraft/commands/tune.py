"""``specgraft tune``'s arguments; the command is :func:`specgraft.tuning.tune.run` (``--engine llamacpp``:
:func:`specgraft.tuning.llamacpp.run_tune`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specgraft.commands.flags import add_attention_kernel_argument, add_linear_kernel_argument
from specgraft.commands.profile import add_engine_arguments
from specgraft.tuning.settings import DEFAULT_MIN_SPEEDUP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft tune``."""
    parser.add_argument("--target", required=True, help="target model: a transformers folder or Hub id (with "
                                                        "--engine llamacpp: the target GGUF llama.cpp serves)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--head", type=Path, help="trained head folder (medusa, eagle, eagle3 or dflash)")
    which.add_argument("--draft", type=Path, help="draft model folder")
    which.add_argument("--draft-gguf", type=Path,
                       help="--engine llamacpp: a `specgraft export --format llamacpp` draft.gguf to tune as it is "
                            "(the tuned record goes to --out; with --head/--draft it also goes beside the folder and "
                            "into the export's card)")
    parser.add_argument("--prompts", nargs="*", type=Path, default=[],
                        help="calibration prompt files (the confirming evals run on them too)")
    parser.add_argument("--limit-per-domain", type=int, help="use only the first N prompts of each domain")
    parser.add_argument("--cost-profile", type=Path, help="a `specgraft profile` JSON (default: measure one now)")
    parser.add_argument("--calibration", type=Path,
                        help="an eval report of this drafter at its default setting (default: run one now)")
    parser.add_argument("--out", type=Path, help="folder for the calibration/confirming reports (default: "
                                                 "<head>/tune)")
    parser.add_argument("--kv-length", type=int, help="KV length for a profile measured now (default: the mean "
                                                      "prompt length plus half of --max-new-tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per calibration turn (default 64)")
    parser.add_argument("--no-confirm", action="store_true", help="skip the confirming evals")
    parser.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                        help="speedup over plain decoding (measured by the confirming evals, else predicted) a "
                             "drafting setting needs to be chosen; below it tuned.json says plain decoding "
                             f"(default {DEFAULT_MIN_SPEEDUP})")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tuned.json")
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="model dtype")
    parser.add_argument("--threads", type=int, help="torch CPU threads (--engine llamacpp: llama.cpp's -t, default 1)")
    add_linear_kernel_argument(parser)
    add_attention_kernel_argument(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """The command itself, in :mod:`specgraft.tuning.tune` (imported only now: it loads torch)."""
    if args.engine != "llamacpp" and args.draft_gguf is not None:
        from specgraft.errors import SpecgraftError

        raise SpecgraftError("--draft-gguf is a llama.cpp draft: add --engine llamacpp (specgraft's decoder takes "
                             "--head/--draft folders)")
    if args.engine == "llamacpp":
        from specgraft.tuning.llamacpp import run_tune

        return run_tune(args)
    from specgraft.tuning.tune import run as tune

    return tune(args)
