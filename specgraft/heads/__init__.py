"""Draft heads grafted onto a frozen target, saved and loaded PEFT-style: one folder per family
(``medusa/``, ``eagle/``, ``eagle3/``, ``dflash/``) registered in :mod:`specgraft.heads.registry`."""

from specgraft.heads.base import DraftHead, HeadLoss, head_class, load_head
from specgraft.heads.registry import get_family, register_head

__all__ = ["DraftHead", "HeadLoss", "get_family", "head_class", "load_head", "register_head"]
