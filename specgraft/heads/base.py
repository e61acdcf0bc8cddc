"""Saved heads loaded by their type: the registry lookup on top of :mod:`specgraft.heads.head`.

:mod:`specgraft.heads.head` holds the head base class and everything about a saved head folder that needs no
family lookup (a family's ``model.py`` builds on it); this module adds what resolves a head type through the
registry (:func:`head_class`, :func:`load_head`, :func:`rebuild_head`) and re-exports the rest, so callers keep one
import for saved heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specgraft.heads.head import (  # noqa: F401 (re-exported: saved heads are read through this module)
    ADAPTER_DIR,
    ADAPTER_WEIGHTS_NAME,
    FORMAT_VERSION,
    HEAD_CONFIG_NAME,
    HEAD_WEIGHTS_NAME,
    RECIPE_NAME,
    UNRANKED,
    DraftHead,
    HeadLoss,
    HeadWeightsMismatch,
    check_head_state,
    config_from_dict,
    depth_ranks,
    draft_columns,
    load_adapter_state,
    load_checked_state,
    load_head_weights,
    load_saved_head,
    merged_target,
    read_head_config,
    read_head_weights,
    rebuild_as,
    save_adapter,
    token_ranks,
    trainable_parameters,
    warm_start,
)
from specgraft.heads.registry import get_family
from specgraft.target import Target


def head_class(head_type: str) -> type[DraftHead]:
    """The registered :class:`DraftHead` class of ``head_type`` (see :mod:`specgraft.heads.registry`)."""
    return get_family(head_type).head


def head_config_from_dict(head_type: str, raw_config: dict[str, Any], where: str) -> tuple[type[DraftHead], Any]:
    """(the registered class of ``head_type``, its typed config from the saved dict); refuses fields this version
    does not know (written by a newer specgraft) and values the config cannot take."""
    cls = head_class(head_type)
    return cls, config_from_dict(cls, raw_config, where)


def rebuild_head(target: Target, head_type: str, raw_config: dict[str, Any], state: dict[str, torch.Tensor],
                 where: str, load: bool = True) -> DraftHead:
    """THE way a saved head comes back (``load_head``, the exporter's reader, ``--resume`` through
    :func:`load_checked_state`): the registered class of ``head_type`` with its typed config, built on ``target``,
    holding exactly ``state`` (:func:`check_head_state`). ``where`` names the source in errors. ``load=False`` only
    checks: the exporter's target skeleton lives on the meta device, where there is nothing to load into."""
    return rebuild_as(head_class(head_type), target, raw_config, state, where, load=load)


def load_head(target: Target, path: str | Path) -> DraftHead:
    """Rebuild the head saved in ``path`` onto ``target``: registry lookup, identity check, strict weights.

    A Medusa-2 head (an ``adapter/`` folder beside the weights) is built on a copy of ``target`` with its LoRA
    adapter merged, which the returned head's :attr:`~DraftHead.target` holds: decode with ``head.target``. The
    caller's ``target`` is left as it was."""
    return load_saved_head(target, path, head_class)


def load_head_for_decoding(target: Target, path: str | Path) -> DraftHead:
    """:func:`load_head` for drafting: the head's floating-point weights in the target's dtype, as vLLM and SGLang
    serve a draft. Training keeps fp32 master weights whatever the target's dtype; a bf16 target decodes with a bf16
    draft (on a CPU with native bf16 matmuls, e.g. Intel AMX, that halves the bytes a draft step reads). Lossless
    either way: the verifier accepts only what the target itself would emit."""
    head = load_head(target, path)
    return head.to(dtype=head.target.dtype)  # floating tensors only; a no-op for an fp32 target
