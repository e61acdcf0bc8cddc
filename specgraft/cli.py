"""The ``specgraft`` command line: one entry point, a subcommand per capability.

Subcommand modules are imported only when used, and a subcommand's parser module imports no heavy library:
``specgraft --help`` and ``specgraft CMD --help`` never load torch (tests/test_cli_startup.py). Each command is one
module of :mod:`specgraft.commands` exposing ``add_arguments(parser)`` and ``run(args) -> int``, which turns the
arguments into typed calls of the library (imported only then). The one-line help is :data:`COMMANDS`'.
A :class:`~specgraft.errors.SpecgraftError` is printed as one ``error:`` line (exit 2), never a traceback. So are
the environment's errors (an ``OSError``: disk full, permission denied, a path component that is a file, a name too
long) and the errors libraries raise on input they reject (``ValueError``, ``RuntimeError``, ...): those get the
exception type and a hint to rerun with ``-v``, which adds the traceback (the case where they are a specgraft bug).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from specgraft.errors import SpecgraftError

#: subcommand -> (module, one-line help). The help is duplicated here so `--help` needs no heavy imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("specgraft.commands.train",
              "Train a draft head (Medusa-1/2, EAGLE-1/2, EAGLE-3, DFlash) from a YAML recipe."),
    "distill": ("specgraft.commands.distill", "Distill a standalone draft model on the target's outputs."),
    "eval": ("specgraft.commands.eval", "Measure tau, acceptance and speedup per domain with the lossless decoder."),
    "simulate": ("specgraft.commands.simulate", "Predict tau and speedup for another setting from closed forms."),
    "profile": ("specgraft.commands.profile", "Measure this device's cost of verifying N tokens and of each drafter."),
    "tune": ("specgraft.commands.tune", "Choose the fastest draft setting for this device and measure it."),
    "export": ("specgraft.commands.export",
               "Export a head for vLLM, SGLang, TensorRT-LLM or llama.cpp (or the native layout)."),
    "push": ("specgraft.commands.push", "Upload an exported head folder to the Hugging Face Hub."),
    "regenerate": ("specgraft.commands.regenerate",
                   "Rewrite assistant turns with the target (self-distillation data)."),
    "convert-llama2c": ("specgraft.commands.convert_llama2c",
                        "Convert a llama2.c checkpoint + tokenizer to a transformers folder."),
    "convert-gguf": ("specgraft.commands.convert_gguf", "Convert a .gguf file (dequantized) to a transformers folder."),
    "recipe": ("specgraft.commands.recipe", "Validate recipes and print the fully resolved configuration."),
    "demo": ("specgraft.commands.demo",
             "Run the end-to-end demo: train, evaluate, tune and export every drafter (CPU)."),
}


#: Errors a library raises on input it rejects (numpy/torch shape and value checks, pyarrow decoding, asserts in
#: third-party loaders). They are reported as one line; ``-v`` adds the traceback for the case they are a bug.
LIBRARY_ERRORS: tuple[type[BaseException], ...] = (ValueError, RuntimeError, AssertionError, TypeError, KeyError,
                                                   IndexError, MemoryError)

#: errno -> what the user can do about it.
OS_ERROR_HINTS: dict[int, str] = {
    errno.ENOSPC: "free disk space or write to another disk",
    errno.EDQUOT: "free space within your disk quota or write elsewhere",
    errno.EACCES: "check the file's permissions or choose a location you can write to",
    errno.EPERM: "check the file's permissions or choose a location you can write to",
    errno.EROFS: "the file system is read-only; choose a writable location",
    errno.ENOTDIR: "a component of the path is a file, not a folder; fix the path",
    errno.EISDIR: "the path is a folder; pass a file path",
    errno.ENAMETOOLONG: "shorten the path (each name at most 255 bytes)",
    errno.ENOENT: "check that the path exists",
    errno.EEXIST: "remove it or choose another path",
    errno.EMFILE: "too many open files; raise `ulimit -n` or close other programs",
    errno.ENOMEM: "not enough memory; use smaller settings",
}

#: A recipe override on the command line (``section.key=value``).
OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+=")

#: Subcommands whose runs keep checkpoints (an interrupted run continues with --resume).
RESUMABLE_COMMANDS = ("train", "distill")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the problem and where to look) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        extra = message[len(prefix):].split() if message.startswith(prefix) else []
        overrides = [arg for arg in extra if OVERRIDE.match(arg)]
        if overrides and len(overrides) == len(extra):
            # argparse takes the recipe's key=value overrides only before the first flag.
            self.exit(2, f"error: the override(s) {' '.join(overrides)} came after a flag; overrides go right after "
                         f"the recipe, before any flag: `specgraft COMMAND RECIPE {' '.join(overrides)} --flags...`\n")
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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while starting: importing the command's libraries, before its own handler
        _report("error: interrupted while starting; rerun the command")
        return 130


def _main(argv: list[str]) -> int:
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
        _report(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        _report(f"error: interrupted; {_rerun_hint(args.command, argv)}")
        return 130
    except OSError as exc:
        _report(f"error: {describe_os_error(exc)}", exc if args.verbose else None)
        return 2
    except LIBRARY_ERRORS as exc:
        _report(f"error: {describe_library_error(exc, args.verbose)}", exc if args.verbose else None)
        return 2
    except Exception as exc:  # noqa: BLE001 (only the Rust libraries' errors are reported; the rest re-raised)
        if not is_native_library_error(exc):
            raise
        _report(f"error: {describe_native_error(exc, args.verbose)}", exc if args.verbose else None)
        return 2


def is_native_library_error(exc: BaseException) -> bool:
    """An error raised by a Rust extension on its input: ``safetensors``' SafetensorError (which also carries
    I/O failures such as a full disk) or the bare ``Exception`` that ``tokenizers`` raises."""
    return type(exc) is Exception or type(exc).__module__.split(".")[0] in ("safetensors", "safetensors_rust")


def describe_native_error(exc: BaseException, verbose: bool) -> str:
    """One line for :func:`is_native_library_error`'s errors; a wrapped OS error gets the OS error's hint."""
    text = str(exc)
    for code, hint in OS_ERROR_HINTS.items():
        # safetensors formats an I/O failure as `IoError(Os { code: 28, kind: StorageFull, message: "..." })`.
        if f"code: {code}," in text:
            reason = os.strerror(code)
            return f"{reason} (while writing or reading a safetensors file: {text.splitlines()[0][:160]}); {hint}"
    return describe_library_error(exc, verbose)


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError: what failed, on which path, and what to do about it."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.filename2:
        where = f" ({exc.filename} -> {exc.filename2})"
    hint = OS_ERROR_HINTS.get(exc.errno or -1, "check the path and the disk, then rerun")
    return " ".join(f"{reason}{where}; {hint}".split())


def describe_library_error(exc: BaseException, verbose: bool) -> str:
    """One line for an error a library raised: its type and first message line, and how to get the traceback."""
    lines = str(exc).strip().splitlines()
    message = lines[0][:300] if lines else "no message"
    hint = ("the traceback is above" if verbose else
            "the input was rejected by a library; check the named input, or rerun with -v for the traceback "
            "(and report it if the input is right)")
    return f"{type(exc).__name__}: {message}; {hint}"


def _rerun_hint(command: str, argv: Sequence[str]) -> str:
    if command in RESUMABLE_COMMANDS:
        again = " ".join(["specgraft", *argv, *([] if "--resume" in argv else ["--resume"])])
        return f"continue from the last checkpoint with `{again}`"
    return "rerun the command to start again"


def _report(line: str, exc: BaseException | None = None) -> None:
    """Print ``line`` on stderr on a line of its own (an open progress bar is closed first); the traceback of
    ``exc`` before it when given (``-v``)."""
    _close_progress_bars()
    if exc is not None:
        traceback.print_exception(exc, file=sys.stderr)
    # A path that is not valid UTF-8 (kept as surrogates by Python) must not turn the message into a traceback.
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    print(line.encode(encoding, "backslashreplace").decode(encoding, "replace"), file=sys.stderr)


def _close_progress_bars() -> None:
    """Close tqdm bars left open by the failing command, so the error does not land on the bar's line."""
    tqdm_module = sys.modules.get("tqdm.std")
    if tqdm_module is None:
        return
    for bar in list(getattr(tqdm_module.tqdm, "_instances", ())):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
