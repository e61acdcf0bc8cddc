"""The head-family registry: the one place the CLI, trainer, eval, tune, card, convert and export look families up.

A family is one folder ``specgraft/heads/<name>/`` whose ``__init__.py`` binds a
:class:`~specgraft.heads.family.HeadFamily` to ``FAMILY`` (the contract: :mod:`specgraft.heads.family`). The
built-in families are found by listing the sub-packages of ``specgraft/heads`` (:func:`builtin_family_modules`,
no list of names) and importing them on the first lookup; nothing happens at import of this module. A third-party
family (a plug-in package, a test's toy family) calls :func:`register_head`. Names are unique: registering a taken
name is refused, so a plug-in cannot silently replace a built-in.

Families import the contract, never this module, so the only edges into the families are this module's imports
(which ``tests/test_import_graph.py`` adds from :func:`builtin_family_modules`): no cycle.

The standalone draft model (``specgraft distill``) is tuned like a family: :func:`tuning_search` finds its
search (:mod:`specgraft.distill.tune`) by its kind as it finds a family's.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from specgraft.distill.tune import DRAFT_MODEL_SEARCH
from specgraft.errors import SpecgraftError
from specgraft.heads.family import CardText, EngineExporter, HeadFamily, TuningSearch

__all__ = ["CardText", "EngineExporter", "HeadFamily", "TuningSearch", "builtin_family_modules", "default_family",
           "draft_model_search", "family_names", "family_of", "find_tuning_search", "get_family", "register_head",
           "search_for_drafter", "tuning_search", "unregister_head"]

#: The attribute of a family folder's ``__init__`` that holds its :class:`HeadFamily`.
FAMILY_ATTRIBUTE = "FAMILY"

_FAMILIES: dict[str, HeadFamily] = {}
_builtins_loaded = False


def builtin_family_modules() -> tuple[str, ...]:
    """The built-in family packages: every sub-package of ``specgraft/heads`` (a folder with an ``__init__.py``),
    by name, found without importing them."""
    root = Path(__file__).parent
    return tuple(f"{__package__}.{folder.name}" for folder in sorted(root.iterdir())
                 if (folder / "__init__.py").is_file() and not folder.name.startswith("_"))


def register_head(family: HeadFamily) -> HeadFamily:
    """Register ``family`` (refused when its name is taken, built-ins included); returns it."""
    _load_builtins()  # a plug-in must not take a built-in's name
    _add(family)
    return family


def _add(family: HeadFamily) -> None:
    name = family.name
    if not name or not name.replace("_", "").isalnum() or not name.islower():
        raise ValueError(f"head family name {name!r} must be lower-case letters, digits and '_'")
    if name in _FAMILIES:
        raise SpecgraftError(f"a head family named {name!r} is already registered "
                             f"({_FAMILIES[name].head.__module__}); choose another name")
    if getattr(family.head, "head_type", None) != name:
        raise ValueError(f"{family.head.__name__}.head_type is {getattr(family.head, 'head_type', None)!r}, "
                         f"not {name!r}")
    if "native" in family.exporters:
        raise ValueError("the native format holds every family; do not register an exporter for it")
    if family.search is not None and family.search.kind == DRAFT_MODEL_SEARCH.kind:
        raise ValueError(f"the tuning kind {family.search.kind!r} is the draft model's; name the search otherwise")
    _FAMILIES[name] = family


def unregister_head(name: str) -> None:
    """Remove a family (for tests that register a toy family)."""
    _FAMILIES.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in builtin_family_modules():
        family = getattr(importlib.import_module(module), FAMILY_ATTRIBUTE, None)
        if isinstance(family, HeadFamily):
            _add(family)
    defaults = [f.name for f in _FAMILIES.values() if f.default]
    if len(defaults) > 1:
        raise ValueError(f"head families {defaults} all claim to be the default; exactly one may")


def get_family(name: str) -> HeadFamily:
    """The registered family ``name`` (built-ins are imported on first use)."""
    _load_builtins()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise SpecgraftError(f"unknown head type {name!r}; known types: {', '.join(family_names()) or 'none'}") \
            from None


def family_names() -> tuple[str, ...]:
    """Every registered family, in each family's ``listing_order`` (then by name)."""
    _load_builtins()
    return tuple(sorted(_FAMILIES, key=lambda n: (_FAMILIES[n].listing_order, n)))


def family_of(head: Any) -> HeadFamily:
    """The family of a built head."""
    return get_family(head.head_type)


def default_family() -> HeadFamily:
    """The family of a recipe whose ``head:`` section names no type."""
    _load_builtins()
    for family in _FAMILIES.values():
        if family.default:
            return family
    raise SpecgraftError("no head family is the default; name head.type in the recipe")


def draft_model_search() -> TuningSearch:
    """The standalone draft model's search (:mod:`specgraft.distill.tune`)."""
    return DRAFT_MODEL_SEARCH


def find_tuning_search(kind: str) -> TuningSearch | None:
    """The search whose ``tuned.json`` kind is ``kind`` (a family's or the draft model's), or None."""
    if kind == DRAFT_MODEL_SEARCH.kind:
        return DRAFT_MODEL_SEARCH
    for name in family_names():
        search = _FAMILIES[name].search
        if search is not None and search.kind == kind:
            return search
    return None


def tuning_search(kind: str) -> TuningSearch:
    """:func:`find_tuning_search`, refusing a kind no search has (one error line)."""
    search = find_tuning_search(kind)
    if search is None:
        raise SpecgraftError(f"no head family searches the tuning kind {kind!r}; re-run `specgraft tune` with this "
                             "version")
    return search


def search_for_drafter(drafter_type: str) -> TuningSearch:
    """The search of a drafter type as ``report.json`` names it: a head family's, or the draft model's (refused in
    one line for a family that is not tunable)."""
    if drafter_type == DRAFT_MODEL_SEARCH.kind:
        return DRAFT_MODEL_SEARCH
    search = get_family(drafter_type).search
    if search is None:
        raise SpecgraftError(f"{drafter_type} heads have no tunable drafting settings; evaluate them with "
                             "`specgraft eval` at their defaults or with setting flags")
    return search
