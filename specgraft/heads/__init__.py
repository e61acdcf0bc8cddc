"""Draft heads grafted onto a frozen target, saved and loaded PEFT-style: one folder per family (``medusa/``,
``eagle/``, ``eagle3/``, ``dflash/``), each declaring a :class:`~specgraft.heads.family.HeadFamily` (the contract,
:mod:`specgraft.heads.family`) that the registry (:mod:`specgraft.heads.registry`) finds.

Importing this package runs nothing (its names resolve on first use), so a family module importing the contract
never pulls in the registry above it.
"""

from specgraft.utils.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("DraftHead", "HeadLoss"), "head"),
    **dict.fromkeys(("head_class", "load_head"), "base"),
    **dict.fromkeys(("get_family", "register_head"), "registry"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["DraftHead", "HeadLoss", "get_family", "head_class", "load_head", "register_head"]
