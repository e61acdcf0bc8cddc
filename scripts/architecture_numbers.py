"""Architecture numbers of one or more specgraft source trees, side by side: lines and files per layer, head-family
names as strings outside their own folder, imports inside functions, and the import graph's edges (dynamic ones
included) and largest cycle.

    git worktree add /tmp/specgraft-before 3cfbdce
    python scripts/architecture_numbers.py /tmp/specgraft-before .

Everything is read from the source with ``ast`` (no tree is imported), so trees of different versions compare in
one run. ``tests/test_import_graph.py`` builds its graph with the same functions and checks their dynamic edges
against the running registry, lazy packages and CLI.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

#: A tree's head families and the draft model's tuning kind, each owned by one folder (relative to the package).
DRAFT_MODEL = ("draft_model", "distill")

#: Module -> layer for the table. Modules of the old ``specgraft/eval/`` package are mapped by their file name to the
#: layer they moved to; the head-family contract and lookup by their role in each version.
EVAL_LAYERS = {**dict.fromkeys(("decoder", "drafter", "drafters", "tree", "verify", "kv", "acceptance", "metrics"),
                               "decoding"),
               **dict.fromkeys(("kernels", "exact_attention", "gqa_attention", "rounding"), "kernels"),
               **dict.fromkeys(("cost", "search", "simulate", "tune"), "tuning")}
LAYER_ORDER = ("core", "decoding", "kernels", "heads: contract", "heads: families", "heads: lookup", "evaluation",
               "tuning", "data/train/distill/export", "demos/pipeline", "commands/cli")


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package`` (the ``specgraft`` folder)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and getattr(test.left, "id", None) == "__name__"
            and any(getattr(c, "value", None) == "__main__" for c in test.comparators))


def runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never executed) and under ``if
    __name__ == "__main__":`` (a script entry point, the top of the graph, never run when imported)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and (_is_main_guard(node.test) or getattr(
                node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def static_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules its source imports (``from pkg import submodule`` counts the submodule)."""
    graph: dict[str, set[str]] = {}
    root = next(iter(files)).split(".")[0]
    for name, path in files.items():
        targets: set[str] = set()
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files]
                targets.update(subs if len(subs) == len(node.names) else [node.module, *subs])
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in files)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _constant_dict(node: ast.Dict) -> dict[str, str]:
    """A dict literal of string keys and values, ``**dict.fromkeys((names...), value)`` entries expanded."""
    out: dict[str, str] = {}
    for key, value in zip(node.keys, node.values):
        if key is None and isinstance(value, ast.Call) and getattr(value.func, "attr", None) == "fromkeys":
            names, target = value.args
            out.update(dict.fromkeys((ast.literal_eval(names)), ast.literal_eval(target)))
        elif key is not None:
            out[ast.literal_eval(key)] = ast.literal_eval(value) if isinstance(value, ast.Constant) else value
    return out


def lazy_export_edges(files: dict[str, Path]) -> set[tuple[str, str]]:
    """package -> submodule, for each package whose ``_EXPORTS`` names are resolved lazily (``lazy_exports``)."""
    edges = set()
    for name, path in files.items():
        source = path.read_text(encoding="utf-8")
        if "lazy_exports(" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS"
                    and isinstance(node.value, ast.Dict)):
                edges |= {(name, f"{name}.{module}") for module in _constant_dict(node.value).values()}
    return edges


def command_edges(files: dict[str, Path]) -> set[tuple[str, str]]:
    """cli -> each subcommand's module (the ``COMMANDS`` table it imports by name)."""
    cli = next(name for name in files if name.endswith(".cli") and name.count(".") == 1)
    for node in ast.walk(ast.parse(files[cli].read_text(encoding="utf-8"))):
        target = getattr(node, "target", None) or (node.targets[0] if isinstance(node, ast.Assign) else None)
        if getattr(target, "id", None) == "COMMANDS" and isinstance(node.value, ast.Dict):
            return {(cli, ast.literal_eval(value)[0]) for value in node.value.values}
    return set()


def family_folders(package: Path) -> list[str]:
    """The head families: every sub-package of ``heads/``."""
    return sorted(p.parent.name for p in (package / "heads").glob("*/__init__.py"))


def family_edges(package: Path, files: dict[str, Path]) -> set[tuple[str, str]]:
    """registry -> each built-in family package (imported by name on the first lookup)."""
    root = package.name
    return {(f"{root}.heads.registry", f"{root}.heads.{name}") for name in family_folders(package)
            if f"{root}.heads.{name}" in files}


def full_graph(package: Path) -> dict[str, set[str]]:
    """The static graph plus every dynamic edge."""
    files = module_files(package)
    graph = static_graph(files)
    for importer, imported in lazy_export_edges(files) | command_edges(files) | family_edges(package, files):
        if imported in files:
            graph[importer].add(imported)
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


def layer(module: str, package: Path) -> str:
    """The table's layer of a module of either version."""
    parts = module.split(".")[1:]
    families = family_folders(package)
    top = parts[0] if parts else ""
    if top == "eval":
        return EVAL_LAYERS.get(parts[-1], "evaluation") if len(parts) > 1 else "evaluation"
    if top == "heads":
        if len(parts) > 1 and parts[1] in families:
            return "heads: families"
        has_contract_module = (package / "heads" / "family.py").exists()
        lookup = {"registry", "base"} if has_contract_module else {"registry"}
        return "heads: lookup" if len(parts) == 1 or parts[1] in lookup else "heads: contract"
    if module.endswith("distill.tune"):
        return "heads: families"  # the draft model's search, looked up as a family's is
    if top in ("decoding", "kernels", "tuning", "evaluation"):
        return top
    if top in ("commands", "cli", "__main__") or (parts and parts[-1] == "__main__"):
        return "commands/cli"
    if top in ("data", "train", "distill", "export", "testing"):
        return "data/train/distill/export"
    if top in ("demo", "demo_steps", "demo_smollm2", "recipe_cli", "demos", "pipeline"):
        return "demos/pipeline"
    return "heads: lookup" if top == "config" else "core"


def family_literals(package: Path) -> Counter:
    """file -> string constants equal to a family's name (or the draft model's kind) outside its own folder."""
    owners = {name: package / "heads" / name for name in family_folders(package)}
    owners[DRAFT_MODEL[0]] = package / DRAFT_MODEL[1]
    found: Counter = Counter()
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owners:
                if owners[node.value] not in path.parents:
                    found[path.relative_to(package.parent).as_posix()] += 1
    return found


def imports_in_functions(package: Path) -> tuple[int, int]:
    """(imports inside function bodies, those of the package's own modules)."""
    total = own = 0
    for path in package.rglob("*.py"):
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node is not func:
                    total += 1
                    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    own += bool(module and module.split(".")[0] == package.name)
    return total, own


def numbers(root: Path) -> dict[str, object]:
    package = root / "specgraft"
    files = module_files(package)
    per_layer: dict[str, list[int]] = {name: [0, 0] for name in LAYER_ORDER}
    for module, path in files.items():
        counts = per_layer[layer(module, package)]
        counts[0] += 1
        counts[1] += len(path.read_text(encoding="utf-8").splitlines())
    graph = full_graph(package)
    static = static_graph(files)
    found = cycles(graph)
    total, own = imports_in_functions(package)
    literals = family_literals(package)
    return {"layers": per_layer, "literals": sum(literals.values()), "literal_files": dict(literals),
            "imports_in_functions": total, "own_imports_in_functions": own,
            "edges": sum(len(t) for t in graph.values()), "static_edges": sum(len(t) for t in static.values()),
            "largest_cycle": max((len(c) for c in found), default=0), "cycles": len(found)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path, help="repository roots (each holding specgraft/)")
    parser.add_argument("--literal-files", action="store_true", help="also list the files holding family names")
    args = parser.parse_args()
    results = [numbers(root) for root in args.roots]
    width = max(28, *(len(str(r)) + 2 for r in args.roots))
    print(f"{'':40}" + "".join(f"{str(r):>{width}}" for r in args.roots))
    for name in LAYER_ORDER:
        print(f"{'files / lines: ' + name:40}"
              + "".join(f"{f'{n[name][0]} / {n[name][1]}':>{width}}" for n in (r['layers'] for r in results)))
    rows = (("family-name literals outside", "literals"), ("imports inside functions", "imports_in_functions"),
            ("  of specgraft modules", "own_imports_in_functions"), ("import edges (with dynamic)", "edges"),
            ("import edges (source only)", "static_edges"), ("cycles (with dynamic)", "cycles"),
            ("largest cycle (modules)", "largest_cycle"))
    for label, key in rows:
        print(f"{label:40}" + "".join(f"{r[key]:>{width}}" for r in results))
    if args.literal_files:
        for root, r in zip(args.roots, results):
            print(f"\n{root}: " + ", ".join(f"{f} ({n})" for f, n in sorted(r["literal_files"].items())))


if __name__ == "__main__":
    main()
