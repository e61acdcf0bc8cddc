"""A benchmark's result as data: ``benchmarks/results/<name>.json``, holding every figure with what produced it.

The file records the command line, the git commit (and whether the tree had uncommitted changes), the UTC date, the
CPU model, the torch threads, the dtype, the library versions and every figure, so ``scripts/render_benchmarks.py``
can render ``docs/benchmarks.md`` from the files alone and every number in the docs names its run.

``figures`` is a table, a list of rows (one dict of scalars per measured configuration), or several named tables
(``{"decoding": rows, "training": rows}``); ``details`` holds anything else worth keeping (settings, per-domain
breakdowns, stage timings) and is not rendered."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
#: The libraries whose versions a result records.
LIBRARIES = ("torch", "transformers", "specgraft")
Row = Mapping[str, Any]
Figures = Sequence[Row] | Mapping[str, Sequence[Row]]


def add_result_arguments(parser: argparse.ArgumentParser, default_name: str, *, default_help: str = "") -> None:
    """``--result-name`` and ``--results-dir``: where :func:`write_result` puts this run's file."""
    parser.add_argument("--result-name", default=default_name,
                        help=f"the result file's name, without .json (default {default_help or default_name})")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="folder of the result file (default benchmarks/results, what docs/benchmarks.md renders)")


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module reports."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine()


def git_commit(root: Path = ROOT) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the checkout at ``root``; empty when git or the repository is absent."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        # Other result files being rewritten by an earlier run are not changes to the measured code.
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)benchmarks/results"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": sha.stdout.strip(), "dirty": bool(status.stdout.strip())}


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command as a user would type it from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return shlex.join(["python", *argv])


def torch_threads() -> int | None:
    """torch's intra-op threads when torch is loaded (the scripts that only launch subprocesses pass theirs)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _checked_rows(rows: Sequence[Row]) -> list[dict[str, Any]]:
    out = [dict(row) for row in rows]
    for row in out:
        nested = [key for key, value in row.items() if isinstance(value, (dict, list, tuple))]
        if nested:
            raise ValueError(f"figure row {row} holds non-scalars ({', '.join(nested)}); put them in details")
    return out


def write_result(name: str, figures: Figures, *, title: str, dtype: str, threads: int | None = None,
                 details: Mapping[str, Any] | None = None, results_dir: Path = RESULTS_DIR,
                 argv: Sequence[str] | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` (replacing an earlier run of the same name) and return its path.

    ``figures``: one row per measured configuration, scalars only (or named tables of rows); ``title``: one line
    saying what was measured; ``threads``: the torch threads the measurement ran with (default: this process's, when
    torch is loaded)."""
    if isinstance(figures, Mapping):
        rows: Any = {table: _checked_rows(table_rows) for table, table_rows in figures.items()}
    else:
        rows = _checked_rows(figures)
    result = {
        "name": name,
        "title": title,
        "source": "measured",
        "command": command_line(argv),
        **git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else torch_threads(),
        "dtype": dtype,
        "versions": library_versions(),
        "figures": rows,
    }
    if details:
        result["details"] = dict(details)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    print(f"result: {path}", flush=True)
    return path


def save_png(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Write a pyplot figure to ``path`` atomically (a temporary name, then a rename; its folder made), close it and
    return ``path``."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path
