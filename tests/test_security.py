"""Security basics: specgraft never unpickles files (safetensors and JSON only)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specgraft"


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_no_unpickling_in_the_package():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, name in _calls(tree):
            if name in ("pickle.load", "pickle.loads", "dill.load", "joblib.load", "numpy.load", "np.load"):
                offenders.append(f"{path.name}:{node.lineno} {name}")
            if name == "torch.load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{path.name}:{node.lineno} torch.load without weights_only=True")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n in ("pickle", "dill", "cloudpickle") for n in names):
                    offenders.append(f"{path.name}:{node.lineno} imports a pickle module")
    assert not offenders, offenders
