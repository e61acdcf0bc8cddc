"""Draft heads grafted onto a frozen target (Medusa, EAGLE-1/2, EAGLE-3), saved and loaded PEFT-style."""

from specgraft.heads.base import DraftHead, HeadLoss, head_class, load_head, register_head

__all__ = ["DraftHead", "HeadLoss", "head_class", "load_head", "register_head"]
