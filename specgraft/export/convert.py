"""Tensor and config conversion between specgraft heads and the engines' layouts, both ways.

``to_engine`` maps a head's state dict (``head.safetensors``) onto one engine layout and builds the engine's
``config.json``; ``from_engine`` maps an exported folder's tensors back onto the state dict of a specgraft head,
which is how the round-trip tests prove that an export holds exactly the trained head.

The engines run EAGLE drafts as Llama layers. Heads of targets whose layers are Llama layers with a different
packing are converted: Phi-3's fused ``qkv_proj``/``gate_up_proj`` are split (and fused back on load), and
Qwen2's q/k/v biases are written with Llama's ``attention_bias`` (which also gives ``o_proj`` a bias; it is
written as zeros, and must read back as zeros). Anything the Llama layout cannot hold (Qwen3's q/k norms,
Gemma's sandwich norms, MLP biases, ...) is refused, never dropped. The layout primitives the families' converters
are built from are :mod:`specgraft.export.engine`'s; this module dispatches to the registered family.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.evaluation.report_reader import is_plain
from specgraft.export.engine import EngineCheckpoint
from specgraft.export.formats import engine_exporter, expected_tensors
from specgraft.export.layouts import check_tensors
from specgraft.export.options import DEFAULT_SPECULATIVE_TOKENS
from specgraft.export.target_info import TargetInfo
from specgraft.heads.registry import family_names, find_tuning_search, get_family

logger = logging.getLogger(__name__)

def tuned_engine_settings(tuned: Mapping[str, Any]) -> dict[str, Any]:
    """Engine settings for a ``tuned.json`` record (``specgraft tune``): vLLM's ``num_speculative_tokens``, SGLang's
    ``--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens`` (root counted) and
    TensorRT-LLM's ``max_draft_len`` (plus ``medusa_choices`` for a Medusa tree), as the record's search
    (:meth:`~specgraft.heads.family.TuningSearch.engine_settings`) states them."""
    setting = tuned.get("setting") or {}
    if is_plain(setting):
        # Tuned to plain decoding on its device: nothing to say about draft lengths (engines keep their defaults).
        return {}
    search = find_tuning_search(str(tuned.get("kind")))
    if search is None:  # a kind this version has no search for: the generic chain
        k = int(setting.get("k") or setting.get("depth") or DEFAULT_SPECULATIVE_TOKENS)
        return {"vllm": {"num_speculative_tokens": k}, "trtllm": {"max_draft_len": k}}
    return search.engine_settings(setting, DEFAULT_SPECULATIVE_TOKENS)


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return tensors
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


# ----------------------------------------------------------------------------------------------------------------
# Head -> engine


def to_engine(head_type: str, fmt: str, state: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
              info: TargetInfo, *, base_model: str, dtype: torch.dtype | None = None,
              speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> EngineCheckpoint:
    """Convert a validated head state dict to ``fmt``'s layout and config (the family's registered exporter),
    checked against the family's layout table."""
    exporter = engine_exporter(head_type, fmt)
    ckpt = exporter.to_engine(fmt, state, meta["config"], info, base_model, speculative_tokens)
    ckpt.tensors = _cast(ckpt.tensors, dtype)
    if exporter.container == "safetensors":  # a GGUF's tensors carry their own types
        _set_dtype(ckpt.config, str(dtype or _state_dtype(state)).replace("torch.", ""))
    expected = ckpt.expected if ckpt.expected is not None else expected_tensors(head_type, fmt, ckpt.dims)
    check_tensors(ckpt.tensors, expected, f"the {fmt} export")
    return ckpt


def _family_title(name: str) -> str:
    card = get_family(name).card if name in family_names() else None
    return card.title if card is not None else name


def _require_speculators_type(config: Mapping[str, Any], expected: str | None, head_type: str) -> None:
    """Refuse a speculators export of another algorithm read back as ``head_type`` (e.g. DFlash as EAGLE-3)."""
    found = config.get("speculators_model_type")
    if expected is None or found is None or found == expected:
        return
    raise SpecgraftError(f"this export is a {_family_title(str(found))} draft (speculators_model_type {found!r}), "
                         f"not {_family_title(head_type)}; load it as the {found} head it is")


def _require_own_architecture(config: Mapping[str, Any], fmt: str, head_type: str) -> None:
    """Refuse an export whose ``architectures`` another family's ``fmt`` layout claims (e.g. SGLang's
    ``DFlashDraftModel`` read back as EAGLE-3)."""
    found = config.get("architectures")
    found = {str(a) for a in found} if isinstance(found, list) else set()
    for name in family_names():
        other = get_family(name).exporters.get(fmt)
        if name != head_type and other is not None and found & set(other.architectures):
            raise SpecgraftError(f"this export is a {_family_title(name)} draft (architectures {sorted(found)}), not "
                                 f"{_family_title(head_type)}; load it as the {name} head it is")


def _state_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    for tensor in state.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _set_dtype(config: dict[str, Any], dtype_name: str) -> None:
    config["torch_dtype"] = dtype_name
    inner = config.get("transformer_layer_config")
    if isinstance(inner, dict):
        inner["torch_dtype"] = dtype_name


def apply_tuned(config: dict[str, Any], head_type: str, fmt: str, engines: Mapping[str, Any]) -> None:
    """Write a tuned setting into an engine config through the family's ``apply_tuned`` (e.g. TensorRT-LLM
    Medusa's ``medusa_choices``, the tree); families without one take their settings from the command line."""
    apply = get_family(head_type).apply_tuned
    if apply is not None:
        apply(config, fmt, engines)


# ----------------------------------------------------------------------------------------------------------------
# Engine -> head


def from_engine(head_type: str, fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                head_cfg: Mapping[str, Any], want: Mapping[str, torch.Tensor],
                target_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Map an exported folder's tensors back onto a head state dict with exactly the names/shapes of ``want``
    (the state dict of a freshly built head of the same config). Unused exported tensors are an error."""
    used: set[str] = set()
    names = set(want)
    exporter = engine_exporter(head_type, fmt)
    _require_speculators_type(config, exporter.speculators_model_type, head_type)
    _require_own_architecture(config, fmt, head_type)
    state = exporter.from_engine(fmt, tensors, config, head_cfg, want, used, target_lm_head)
    left = sorted(set(tensors) - used)
    if left:
        raise SpecgraftError(f"the export holds tensors {left[:6]} that a {head_type} head of this config does not "
                             "have; the export was edited or made for another head")
    missing = sorted(names - set(state))
    if missing:
        raise SpecgraftError(f"the export lacks the head tensors {missing[:6]}; re-export the head")
    return state
