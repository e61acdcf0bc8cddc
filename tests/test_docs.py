"""The documentation site builds with ``mkdocs build --strict``: a broken link, a missing page or a failing generated
reference fails the suite. Skipped where the docs tools (the ``dev`` extra) are not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS_TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name.split(".")[0]) is None for name in DOCS_TOOLS),
    reason="the docs tools are not installed (pip install -e '.[dev]')",
)


def _build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # `python -m` puts cwd first on sys.path, so the hook renders the CLI of this checkout's package.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
def test_docs_site_builds_strictly_with_generated_references(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = _build(REPO / "mkdocs.yml", site, REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    recipes = (site / "reference" / "recipes" / "index.html").read_text(encoding="utf-8")
    for key in ("model.name_or_path", "data.regenerate", "training.feature_dtype", "distill.lmbda", "lora.kl_weight"):
        assert key in recipes, f"recipes reference lacks {key}"
    for family in ("medusa", "eagle", "eagle3", "dflash"):
        assert f"head.type: {family}" in recipes, f"recipes reference lacks the {family} family"

    from specgraft.cli import COMMANDS

    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in COMMANDS:
        assert f"usage: specgraft {command}" in cli, f"CLI reference lacks `specgraft {command} --help`"
    guide = (site / "adding-a-head-family" / "index.html").read_text(encoding="utf-8")
    assert "register_head" in guide and "--8&lt;--" not in guide, "CONTRIBUTING.md's guide was not included"


def test_strict_settings_fail_on_a_broken_link_and_an_unlisted_page(tmp_path: Path) -> None:
    """Negative control: the project's own strictness settings, on a two-page site with a broken link."""
    settings = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide.md).\n", encoding="utf-8")
    (docs / "guide.md").write_text("# Guide\n", encoding="utf-8")

    def build(nav: list[dict[str, str]]) -> subprocess.CompletedProcess[str]:
        config = tmp_path / "mkdocs.yml"
        config.write_text(yaml.safe_dump({"site_name": "control", "docs_dir": str(docs), "strict": settings["strict"],
                                          "validation": settings["validation"], "nav": nav}), encoding="utf-8")
        return _build(config, tmp_path / "site", tmp_path)

    assert build([{"Home": "index.md"}, {"Guide": "guide.md"}]).returncode == 0
    assert build([{"Home": "index.md"}]).returncode != 0, "a page missing from the nav passed"
    (docs / "index.md").write_text("# Home\n\nSee [the guide](gide.md).\n", encoding="utf-8")
    assert build([{"Home": "index.md"}, {"Guide": "guide.md"}]).returncode != 0, "a broken link passed"
