"""The import graph of ``specgraft/`` has no cycle, counting every import (module-level and inside functions,
not ``if TYPE_CHECKING:`` ones), and the eval machinery never imports a head family.

Run ``python tests/test_import_graph.py`` to print the graph's edges between packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specgraft

ROOT = Path(specgraft.__file__).parent
#: The drafter protocol and the tree / verify / KV machinery the families build on.
EVAL_CORE = ("specgraft.decoding.drafter", "specgraft.decoding.tree", "specgraft.decoding.verify",
             "specgraft.decoding.kv", "specgraft.decoding.acceptance", "specgraft.decoding.decoder",
             "specgraft.decoding.drafters", "specgraft.tuning.search")


def module_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """module -> the specgraft modules it imports (``from pkg import submodule`` counts the submodule)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specgraft"):
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files]
                targets.update(subs if len(subs) == len(node.names) else [node.module, *subs])
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in files)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    # Negative control: a planted cycle is reported.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_eval_machinery_never_imports_a_family():
    graph = import_graph()
    for module in EVAL_CORE:
        families = sorted(t for t in graph[module] if t.startswith("specgraft.heads"))
        assert families == [], f"{module} imports {families}"


def test_families_use_only_evals_public_protocol():
    graph = import_graph()
    allowed = set(EVAL_CORE)
    for module, targets in graph.items():
        if module.startswith("specgraft.heads."):
            layers = ("specgraft.decoding", "specgraft.tuning", "specgraft.evaluation")
            used = sorted(t for t in targets if t.startswith(layers) and t not in allowed)
            assert used == [], f"{module} imports eval internals {used}"


if __name__ == "__main__":
    edges = sorted({(a.rsplit(".", 1)[0] if a.count(".") > 1 else a, b.rsplit(".", 1)[0] if b.count(".") > 1 else b)
                    for a, targets in import_graph().items() for b in targets})
    for a, b in edges:
        if a != b:
            print(f"{a} -> {b}")
