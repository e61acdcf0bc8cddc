"""`specgraft --help` and `specgraft CMD --help` start without importing torch or transformers: every subcommand's
parser is built from a module that imports no heavy library (specgraft.commands for the heavy commands), and the
packages they live in resolve their public names lazily."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specgraft.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "accelerate", "numpy", "matplotlib")
#: Runs every command's --help in turn in one fresh interpreter and prints, per command, its exit code, the heavy
#: modules loaded so far (a heavy import shows first at the command that made it) and its help text.
RUNNER = """
import contextlib, io, json, sys
from specgraft.cli import main
report = {}
for command in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*command, "--help"])
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
    report[" ".join(command) or "specgraft"] = {"code": code, "heavy": heavy, "help": out.getvalue()}
print(json.dumps(report))
"""


def _help_of(commands: list[list[str]]) -> dict:
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(commands), json.dumps(HEAVY)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_help_of_every_subcommand_imports_no_heavy_library():
    report = _help_of([[], *([name] for name in COMMANDS)])
    assert set(report) == {"specgraft", *COMMANDS}
    for name, result in report.items():
        assert result["code"] == 0, name
        assert result["heavy"] == [], f"`{name} --help` imported {result['heavy']}"
        assert result["help"].startswith("usage: specgraft"), name
    top = report["specgraft"]["help"]
    for name, (_, description) in COMMANDS.items():
        assert name in top and description.split(" (")[0][:40] in " ".join(top.split()), name
    assert "--linear-kernel" in report["eval"]["help"] and "--min-speedup" in report["tune"]["help"]


def test_the_heavy_check_sees_a_heavy_import():
    """Negative control: the runner does report torch once something imports it."""
    runner = RUNNER.replace("from specgraft.cli import main", "from specgraft.cli import main\nimport torch")
    done = subprocess.run([sys.executable, "-c", runner, json.dumps([["recipe"]]), json.dumps(HEAVY)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert "torch" in json.loads(done.stdout)["recipe"]["heavy"]


def test_descriptions_name_every_head_family():
    from specgraft.heads.registry import family_names

    described = COMMANDS["train"][1].lower()
    names = {"medusa": "medusa", "eagle": "eagle-1", "eagle3": "eagle-3", "dflash": "dflash"}
    assert all(names.get(family, family) in described for family in family_names())


def test_lazy_package_names_resolve_to_their_modules():
    import specgraft.data
    import specgraft.distill
    import specgraft.export
    from specgraft.data.dataset import build_dataset
    from specgraft.export.exporter import export_head

    assert specgraft.data.build_dataset is build_dataset and specgraft.export.export_head is export_head
    assert specgraft.distill.DistillTrainer.__name__ == "DistillTrainer"
    assert {"build_dataset", "tokenize_text"} <= set(dir(specgraft.data))
    with pytest.raises(AttributeError, match="no_such_name"):
        specgraft.export.no_such_name  # noqa: B018
