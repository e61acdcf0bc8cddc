"""The import graph of ``specgraft/`` counts every edge, the dynamic ones included, has no cycle, and runs in layers:
a module never imports a module of a higher layer.

Edges are the imports in the source (module level and inside functions; not ``if TYPE_CHECKING:`` ones, nor a
script's ``if __name__ == "__main__":`` block) plus the three dynamic kinds of import specgraft makes (the graph is
built by ``scripts/architecture_numbers.py``, which reads them from the source; :func:`test_dynamic_edges_are_counted`
checks that against the running objects):

* the registry's built-in families (:func:`specgraft.heads.registry.builtin_family_modules`),
* a package's lazily resolved names (``_EXPORTS`` of :func:`specgraft.utils.lazy.lazy_exports`),
* the CLI's subcommand modules (:data:`specgraft.cli.COMMANDS`),

and any other ``importlib.import_module`` call fails :func:`test_every_dynamic_import_is_modelled`.

Run ``python tests/test_import_graph.py`` to print the graph's edges between packages.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

import specgraft

ROOT = Path(specgraft.__file__).parent
_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "architecture_numbers.py"
_spec = importlib.util.spec_from_file_location("architecture_numbers", _SCRIPT)
numbers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = numbers
_spec.loader.exec_module(numbers)

#: The layers, lowest first: (name, module prefixes). A module belongs to the layer of its longest matching prefix.
#: The head-family contract sits below the families, the lookup (registry, config) above them, and everything that
#: looks a family up above that.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("specgraft", "specgraft.errors", "specgraft.utils", "specgraft.gguf", "specgraft.llama2c",
              "specgraft.target", "specgraft.defaults", "specgraft.packaged")),
    ("decoding", ("specgraft.decoding",)),
    ("kernels", ("specgraft.kernels",)),
    ("contract", ("specgraft.heads.family", "specgraft.heads.head", "specgraft.heads.layers",
                  "specgraft.heads.losses", "specgraft.heads.draft_vocab", "specgraft.tuning.search",
                  "specgraft.tuning.settings", "specgraft.export.layouts", "specgraft.export.engine",
                  "specgraft.export.target_info", "specgraft.export.llamacpp", "specgraft.export.llamacpp_engine",
                  "specgraft.export.options")),
    ("families", ("specgraft.heads.<family>", "specgraft.distill.tune")),
    ("lookup", ("specgraft.heads", "specgraft.heads.registry", "specgraft.heads.base", "specgraft.config")),
    ("evaluation", ("specgraft.evaluation",)),
    ("tuning", ("specgraft.tuning",)),
    ("jobs", ("specgraft.data", "specgraft.train", "specgraft.distill", "specgraft.export", "specgraft.testing")),
    ("pipeline", ("specgraft.pipeline",)),
    ("demos", ("specgraft.demos",)),
    ("commands", ("specgraft.commands", "specgraft.cli", "<any>.__main__")),
)

#: Modules that call ``importlib.import_module``, each modelled above.
DYNAMIC_IMPORTERS = {"specgraft.cli", "specgraft.utils.lazy", "specgraft.heads.registry"}

#: Known layer violations, each one (importer, imported) edge (none).
PENDING: set[tuple[str, str]] = set()


def module_files() -> dict[str, Path]:
    return numbers.module_files(ROOT)


def dynamic_edges() -> set[tuple[str, str]]:
    """The edges made by ``importlib``, read from the running objects that make them: the registry's discovery, the
    lazy packages' ``_EXPORTS`` and the CLI's command table."""
    from specgraft.cli import COMMANDS
    from specgraft.heads.registry import builtin_family_modules

    edges = {("specgraft.heads.registry", module) for module in builtin_family_modules()}
    edges |= {("specgraft.cli", module) for module, _ in COMMANDS.values()}
    for name, path in module_files().items():
        if "lazy_exports(" in path.read_text(encoding="utf-8") and name != "specgraft.utils.lazy":
            exports = importlib.import_module(name)._EXPORTS
            edges |= {(name, f"{name}.{module}") for module in set(exports.values())}
    return edges


def import_graph() -> dict[str, set[str]]:
    """Every edge: the source's imports and the dynamic ones (as scripts/architecture_numbers.py reads them)."""
    return numbers.full_graph(ROOT)


cycles = numbers.cycles


def family_packages() -> set[str]:
    from specgraft.heads.registry import builtin_family_modules

    return set(builtin_family_modules())


def layer_of(module: str, families: set[str]) -> int:
    """The rank of ``module``'s layer (its longest matching prefix; a built-in family's modules: ``families``)."""
    best, rank = -1, -1
    for position, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix == "<any>.__main__":  # a package's `python -m` entry point
                length = len(module) if module.endswith(".__main__") or module == "specgraft.__main__" else -1
            elif prefix == "specgraft.heads.<family>":
                matches = [f for f in families if module == f or module.startswith(f + ".")]
                length = max((len(f) for f in matches), default=-1)
            else:
                length = len(prefix) if module == prefix or module.startswith(prefix + ".") else -1
            if length > best:
                best, rank = length, position
    return rank


def layer_violations(graph: dict[str, set[str]], families: set[str]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer than the importer."""
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(b, families) > layer_of(a, families)}


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    # Negative control: a planted cycle is reported.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_dynamic_edges_are_counted():
    """The registry's edges into the built-in families, the lazy packages' and the CLI's are part of the graph, as
    the running registry, packages and CLI make them."""
    graph = import_graph()
    modules = module_files()
    made = {(a, b) for a, b in dynamic_edges() if b in modules}
    assert made and all(b in graph[a] for a, b in made), sorted((a, b) for a, b in made if b not in graph[a])
    assert family_packages() <= graph["specgraft.heads.registry"]
    assert "specgraft.heads.base" in graph["specgraft.heads"] and "specgraft.commands.tune" in graph["specgraft.cli"]


def test_every_dynamic_import_is_modelled():
    """No ``importlib.import_module`` call outside the modules whose dynamic edges :func:`dynamic_edges` reads."""
    callers = set()
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("import_module", "__import__"):
                callers.add(name)
            elif isinstance(node, ast.Name) and node.id == "__import__":
                callers.add(name)
    assert callers <= DYNAMIC_IMPORTERS, f"unmodelled dynamic imports in {sorted(callers - DYNAMIC_IMPORTERS)}"


def test_every_module_has_a_layer():
    families = family_packages()
    assert [m for m in module_files() if layer_of(m, families) < 0] == []


def test_lower_layers_never_import_upper_ones():
    found = layer_violations(import_graph(), family_packages())
    assert found - PENDING == set(), sorted(found - PENDING)
    assert PENDING - found == set(), f"fixed, drop from PENDING: {sorted(PENDING - found)}"


@pytest.mark.parametrize("edge", [("specgraft.decoding.decoder", "specgraft.kernels.exact_attention"),
                                  ("specgraft.heads.medusa.export", "specgraft.heads.registry"),
                                  ("specgraft.heads.head", "specgraft.config")])
def test_a_planted_upward_import_is_a_violation(edge):
    # Negative control: the violations fixed here are reported when planted back.
    graph = {a: set(b) for a, b in import_graph().items()}
    graph[edge[0]].add(edge[1])
    assert edge in layer_violations(graph, family_packages())


def test_families_reach_only_the_contract_below_them():
    """A family's modules import the contract, decoding, kernels, core and other families (EAGLE-3 reuses EAGLE's
    drafter): never the lookup, tuning, evaluation or the jobs, directly or not."""
    graph, families = import_graph(), family_packages()
    limit = [name for name, _ in LAYERS].index("families")
    for module in graph:
        if layer_of(module, families) != limit:
            continue
        seen, todo = set(), [module]
        while todo:
            for child in graph[todo.pop()]:
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        above = sorted(m for m in seen if layer_of(m, families) > limit)
        assert above == [], f"{module} reaches {above}"


if __name__ == "__main__":
    edges = sorted({(a.rsplit(".", 1)[0] if a.count(".") > 1 else a, b.rsplit(".", 1)[0] if b.count(".") > 1 else b)
                    for a, targets in import_graph().items() for b in targets})
    for a, b in edges:
        if a != b:
            print(f"{a} -> {b}")
