"""Medusa's engine layouts (vLLM ``MedusaModel``, FasterDecoding / TensorRT-LLM), model-card text and tuned-tree
hook.

Sources (checked facts, see ``specgraft/export/FORMATS.md``): vLLM ``MedusaModel`` loads
``blocks.{k}.layers.{l}.weight/bias`` (bias only with ``medusa_fc_bias``) and ``lm_heads.{k}.weight`` (only
``lm_heads.0`` with ``original_lm_head``), no lm_head bias; FasterDecoding Medusa (TensorRT-LLM's converter, TGI)
reads ``{k}.{l}.linear.weight/bias`` and ``{k}.{L}.weight`` from ``medusa_lm_head.safetensors`` (the reference
writes a pickled ``medusa_lm_head.pt``; the converter reads either file, we write safetensors only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.export.engine import EngineCheckpoint, SourceState, refuse_bias, refuse_leftovers
from specgraft.export.layouts import Dims, TensorRule
from specgraft.export.target_info import TargetInfo
from specgraft.heads.family import CardText, EngineExporter

logger = logging.getLogger(__name__)

VLLM_LAYOUT = (
    TensorRule("blocks.{k}.layers.{l}.weight", ("hidden", "hidden"), ("k", "l")),
    TensorRule("blocks.{k}.layers.{l}.bias", ("hidden",), ("k", "l")),
    TensorRule("lm_heads.{k}.weight", ("vocab", "hidden"), ("k",), unless="shared_lm_head"),
    TensorRule("lm_heads.0.weight", ("vocab", "hidden"), when="shared_lm_head"),
)
TRTLLM_LAYOUT = (
    TensorRule("{k}.{l}.linear.weight", ("hidden", "hidden"), ("k", "l")),
    TensorRule("{k}.{l}.linear.bias", ("hidden",), ("k", "l")),
    TensorRule("{k}.{medusa_layers}.weight", ("vocab", "hidden"), ("k",)),
)


def to_engine(fmt: str, state: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], info: TargetInfo,
              base_model: str, speculative_tokens: int) -> EngineCheckpoint:
    src = SourceState(state)
    heads, layers = int(cfg["num_heads"]), int(cfg["num_layers"])
    shared = bool(cfg["share_lm_head"])
    if any(name.startswith("lm_heads.") and name.endswith(".bias") for name in state):
        refuse_bias(fmt, "medusa", "lm_head bias (the target's lm_head has one)", ("native",))
    dims = Dims(hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]), num_heads=heads, medusa_layers=layers,
                shared_lm_head=shared)
    notes: list[str] = []
    target_head = info.lm_head_weight() if shared else None
    if target_head is not None and tuple(target_head.shape) != (dims.vocab, dims.hidden):
        raise SpecgraftError(f"the target's lm_head is {tuple(target_head.shape)}, not [{dims.vocab}, {dims.hidden}]; "
                             "pass the target this head was trained for with --target")
    tensors: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for layer in range(layers):
            w = src.take(f"blocks.{k}.layers.{layer}.weight")
            b = src.take(f"blocks.{k}.layers.{layer}.bias")
            if fmt == "vllm":
                tensors[f"blocks.{k}.layers.{layer}.weight"], tensors[f"blocks.{k}.layers.{layer}.bias"] = w, b
            else:
                tensors[f"{k}.{layer}.linear.weight"], tensors[f"{k}.{layer}.linear.bias"] = w, b
        head_w = target_head if shared else src.take(f"lm_heads.{k}.weight")
        if fmt == "vllm":
            if not shared:
                tensors[f"lm_heads.{k}.weight"] = head_w
            elif k == 0:
                tensors["lm_heads.0.weight"] = head_w  # vLLM's original_lm_head: one lm_head shared by all heads
        else:
            # One copy per head: safetensors refuses tensors that share memory.
            tensors[f"{k}.{layers}.weight"] = head_w.clone() if shared else head_w
    if shared:
        what = "once (original_lm_head)" if fmt == "vllm" else f"{heads} times (the layout has one per head)"
        notes.append(f"the heads share the target's lm_head; it is written {what}")
    if getattr(info.config, "final_logit_softcapping", None):
        notes.append("the target soft-caps its logits; engines' Medusa heads do not (greedy proposals are the same)")
    refuse_leftovers(src, fmt, "medusa", "?")
    if fmt == "vllm":
        # vLLM renames every config key containing "num" and "heads"/"layers": write no other such key.
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": dims.hidden,
                  "vocab_size": dims.vocab, "num_heads": heads, "num_hidden_layers": layers,
                  "truncated_vocab_size": dims.vocab, "medusa_fc_bias": True, "original_lm_head": shared}
    else:
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": base_model,
                  "hidden_size": dims.hidden, "vocab_size": dims.vocab}
    return EngineCheckpoint(tensors, config, dims, notes)


def from_engine(fmt: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], cfg: Mapping[str, Any],
                want: Mapping[str, torch.Tensor], used: set[str],
                target_lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    heads, layers, shared = int(cfg["num_heads"]), int(cfg["num_layers"]), bool(cfg["share_lm_head"])
    state: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for layer in range(layers):
            for kind in ("weight", "bias"):
                name = (f"blocks.{k}.layers.{layer}.{kind}" if fmt == "vllm" else f"{k}.{layer}.linear.{kind}")
                used.add(name)
                state[f"blocks.{k}.layers.{layer}.{kind}"] = tensors[name]
        head_name = f"lm_heads.{k}.weight" if fmt == "vllm" else f"{k}.{layers}.weight"
        if shared and fmt == "vllm" and k > 0:
            continue
        used.add(head_name)
        if shared:
            if target_lm_head is not None and not torch.equal(tensors[head_name].float(), target_lm_head.float()):
                logger.warning("the exported lm_head copy %s differs from the target's lm_head; the head borrows the "
                               "target's, so the copy is ignored", head_name)
        else:
            state[f"lm_heads.{k}.weight"] = tensors[head_name]
    return state



def apply_tuned(config: dict[str, Any], fmt: str, engines: Mapping[str, Any]) -> None:
    """A tuned Medusa tree reaches TensorRT-LLM as ``medusa_choices`` (vLLM's Medusa runs every head)."""
    if fmt == "trtllm" and engines.get("trtllm", {}).get("medusa_choices"):
        config["medusa_choices"] = engines["trtllm"]["medusa_choices"]


def describe(cfg: Mapping[str, Any], size: str) -> str:
    shared = "the target's own lm_head" if cfg.get("share_lm_head") else "one vocabulary projection per head"
    return (f"{cfg.get('num_heads')} Medusa heads{size}: head k reads the target's last hidden state and predicts "
            f"the token k+2 positions ahead through {cfg.get('num_layers')} residual block(s) and {shared}.")


def trtllm_lines(cfg: Mapping[str, Any], base: str, where: str, tuned: Mapping[str, Any],
                 max_draft_len: int) -> list[str]:
    lines = ["The files follow the FasterDecoding layout (`medusa_lm_head.safetensors`, which TensorRT-LLM's "
             "Medusa converter reads like the reference `.pt`):", "", "```bash",
             f"python examples/medusa/convert_checkpoint.py --model_dir {base} --medusa_model_dir {where} \\",
             f"  --num_medusa_heads {cfg.get('num_heads')} --output_dir ./tllm_ckpt", "```", ""]
    if tuned.get("medusa_choices"):
        lines += ["The tuned tree (`medusa_choices` for the engine build, also in `config.json`):", "",
                  "```", json.dumps(tuned["medusa_choices"]), "```", ""]
    return lines


#: A Medusa config carries only the sizes of the target (no layers).
_SIZES = ("hidden_size", "vocab_size")
EXPORTERS = {
    "vllm": EngineExporter("model.safetensors", VLLM_LAYOUT, to_engine, from_engine, _SIZES),
    "trtllm": EngineExporter("medusa_lm_head.safetensors", TRTLLM_LAYOUT, to_engine, from_engine, _SIZES),
}
CARD = CardText(title="Medusa", describe=describe, vllm_method="medusa", vllm_tokens_are_heads=True,
                trtllm_lines=trtllm_lines)
