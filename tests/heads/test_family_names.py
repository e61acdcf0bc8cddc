"""No head-family name as a string outside the family's own folder: everything else reads the name from the family
object (``HeadFamily.name``, its search's ``kind``), so a family is renamed, added or removed in one folder.

The distilled draft model is tuned like a family, so its kind (``tuned.json``'s and ``report.json``'s
``draft_model``) may appear as a string only in its own folder, ``specgraft/distill/``.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import specgraft
from specgraft.heads.registry import draft_model_search, family_names, get_family

ROOT = Path(specgraft.__file__).parent

#: Known exceptions, path -> how many (none: the test fails both when one is added and when one listed is fixed).
PENDING: dict[str, int] = {}


def owned_names() -> dict[str, Path]:
    """Every name a folder owns -> that folder: each registered family's (built-in ones live in
    ``specgraft/heads/<name>/``) and the draft model's kind (``specgraft/distill/``)."""
    owners = {name: Path(get_family(name).head.__module__.replace(".", "/")).parent for name in family_names()}
    owners[draft_model_search().kind] = Path(type(draft_model_search()).__module__.replace(".", "/")).parent
    return owners


def stray_literals(root: Path, owners: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(file, line, name) of every string constant equal to an owned name in a file outside its owner's folder
    (docstrings and comments hold prose, not constants equal to a bare name)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = Path(root.name) / path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owners:
                folder = owners[node.value]
                if folder not in relative.parents:
                    found.append((relative.as_posix(), node.lineno, node.value))
    return found


def test_no_family_name_outside_its_folder():
    counts = Counter(file for file, _, _ in stray_literals(ROOT, owned_names()))
    assert dict(counts) == PENDING, {file: [(line, name) for f, line, name in stray_literals(ROOT, owned_names())
                                            if f == file] for file in set(counts) | set(PENDING)}


def test_a_planted_family_name_is_found(tmp_path):
    """Negative control: a name in another folder is reported, the same name in its own folder is not."""
    root = tmp_path / "specgraft"
    (root / "heads" / "medusa").mkdir(parents=True)
    (root / "tuning").mkdir()
    (root / "heads" / "medusa" / "tune.py").write_text('KIND = "medusa"\n')
    (root / "tuning" / "tune.py").write_text('"""Docstrings name medusa."""\nif kind == "medusa":\n    pass\n')
    owners = {"medusa": Path("specgraft/heads/medusa")}
    assert stray_literals(root, owners) == [("specgraft/tuning/tune.py", 2, "medusa")]


def test_owners_are_the_family_folders():
    owners = owned_names()
    assert owners["medusa"] == Path("specgraft/heads/medusa") and owners["eagle3"] == Path("specgraft/heads/eagle3")
    assert owners[draft_model_search().kind] == Path("specgraft/distill")
