"""The ``specgraft`` command line: one entry point, a subcommand per capability.

Subcommand modules are imported only when used (``specgraft --help`` stays fast). Each module exposes
``add_arguments(parser)`` and ``run(args) -> int``; its docstring's first line is the subcommand's help.
A :class:`~specgraft.errors.SpecgraftError` is printed as one ``error:`` line (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from specgraft.errors import SpecgraftError

#: subcommand -> (module, one-line help). The help is duplicated here so `--help` needs no heavy imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("specgraft.train.cli", "Train draft heads (Medusa, EAGLE-1/2, EAGLE-3) from a YAML recipe."),
    "distill": ("specgraft.distill.cli", "Distill a standalone draft model on the target's outputs."),
    "eval": ("specgraft.eval.cli", "Measure tau, acceptance and speedup per domain with the lossless decoder."),
    "simulate": ("specgraft.eval.simulate", "Predict tau and speedup for another setting from closed forms."),
    "profile": ("specgraft.eval.cost", "Measure this device's cost of verifying N tokens and of each drafter."),
    "tune": ("specgraft.eval.tune", "Choose the fastest tree/draft length for this device and confirm it."),
    "export": ("specgraft.export.cli", "Export a head for vLLM, SGLang or TensorRT-LLM."),
    "push": ("specgraft.export.push", "Upload an exported head folder to the Hugging Face Hub."),
    "regenerate": ("specgraft.data.regenerate", "Rewrite assistant turns with the target (self-distillation data)."),
    "convert-llama2c": ("specgraft.llama2c", "Convert a llama2.c checkpoint + tokenizer to a transformers folder."),
    "recipe": ("specgraft.recipe_cli", "Validate recipes and print the fully resolved configuration."),
    "demo": ("specgraft.demo", "Run the end-to-end demo on the embedded default target (CPU, no downloads)."),
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the problem and where to look) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def available_commands() -> dict[str, tuple[str, str]]:
    """The subcommands whose module is installed (capabilities land one by one)."""
    return {name: spec for name, spec in COMMANDS.items() if importlib.util.find_spec(spec[0]) is not None}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s module is imported to add its arguments."""
    parser = _Parser(
        prog="specgraft",
        description="Graft, train, evaluate and export speculative-decoding draft heads for Hugging Face LMs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="Show debug logging.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in available_commands().items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module_name).add_arguments(sp)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``specgraft`` and ``python -m specgraft``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Reading a local JSON/text file with `datasets` otherwise pings a download counter on the internet.
    os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "false")
    command = _command_of(argv)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except SpecgraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; rerun the same command to resume where supported", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
