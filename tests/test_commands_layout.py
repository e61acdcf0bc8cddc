"""CLI code lives in CLI modules: every subcommand is one module of specgraft.commands, and no library module below
it parses arguments (``add_arguments(parser)`` / ``run(args)`` with an argparse Namespace)."""

from __future__ import annotations

import ast
from pathlib import Path

import specgraft
from specgraft.cli import COMMANDS

PACKAGE = Path(specgraft.__file__).parent


def _cli_functions(path: Path) -> list[str]:
    """Top-level functions of ``path`` that take an argparse parser or Namespace."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef):
            annotations = [ast.unparse(a.annotation) for a in node.args.args if a.annotation is not None]
            if any(a.startswith("argparse.") for a in annotations):
                found.append(node.name)
    return found


def test_every_command_is_a_module_of_specgraft_commands():
    for name, (module, _) in COMMANDS.items():
        assert module.startswith("specgraft.commands."), f"{name} -> {module}"
        assert (PACKAGE / "commands" / f"{module.rsplit('.', 1)[1]}.py").is_file(), name


def test_no_library_module_parses_arguments():
    library = [p for p in PACKAGE.rglob("*.py") if "commands" not in p.relative_to(PACKAGE).parts
               and p.name != "cli.py"]
    offenders = {str(p.relative_to(PACKAGE)): names for p in library if (names := _cli_functions(p))
                 and p.relative_to(PACKAGE).as_posix() != "utils/threads.py"}  # the shared --threads flag
    assert offenders == {}


def test_the_scan_sees_a_command_module():
    # Negative control: the commands themselves are found by the same scan.
    assert {"add_arguments", "run"} <= set(_cli_functions(PACKAGE / "commands" / "tune.py"))
