"""What an exporter needs to know about the target, without loading its weights.

Export reads the target's CONFIG (sizes, RoPE, norms, special tokens) to write engine configs consistent with it,
and rebuilds the head's module skeleton on the ``meta`` device to know the exact tensors the head file must
hold. Only a Medusa head that borrows the target's lm_head needs target weights, and then only that one tensor
(read from the target's safetensors files when possible).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specgraft.errors import SpecgraftError
from specgraft.gguf import resolve_model_path
from specgraft.target import Target, TargetIdentity, load_target

logger = logging.getLogger(__name__)

#: transformers 5 keeps rope_theta inside rope_parameters; engines read these legacy keys.
ROPE_KEYS = ("rope_theta", "rope_scaling")


@dataclass
class TargetInfo:
    """The target as an exporter sees it.

    Attributes:
        name_or_path: where its config was read from.
        config: the target's (text) config.
        skeleton: a :class:`Target` whose model lives on the ``meta`` device (sizes and module structure).
        real: the real target when the caller passed one (its lm_head holds real weights).
    """

    name_or_path: str
    config: Any
    skeleton: Target
    real: Target | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def lm_head_weight(self) -> torch.Tensor:
        """[V, h] the target's output projection (real weights)."""
        if self.real is not None:
            return self.real.output_head.weight.detach().to("cpu", torch.float32).clone()
        weight = _read_lm_head(Path(self.name_or_path), self.config)
        if weight is not None:
            return weight

        logger.info("loading %s to read its lm_head", self.name_or_path)
        target = load_target(self.name_or_path)
        return target.output_head.weight.detach().to("cpu", torch.float32).clone()


def resolve_target(meta: dict[str, Any], target: str | Path | Target | None) -> TargetInfo:
    """The target of a saved head: ``target`` when given (a path/Hub id or a loaded Target), else the
    ``name_or_path`` recorded in the head config. Checks that it is the target the head was made for."""
    recorded = TargetIdentity.from_dict(meta["target"])
    if isinstance(target, Target):
        recorded.require_compatible(target.identity, what=f"{meta['head_type']} head")
        skeleton = _meta_target(target.model.config, target.name_or_path)
        return TargetInfo(target.name_or_path, target.text_config, skeleton, real=target)
    name = str(target) if target is not None else recorded.name_or_path
    config = _load_config(name, given=target is not None)
    skeleton = _meta_target(config, name)
    recorded.require_compatible(skeleton.identity, what=f"{meta['head_type']} head")
    return TargetInfo(name, skeleton.text_config, skeleton)


def _load_config(name: str, given: bool) -> Any:
    from transformers import AutoConfig


    try:
        return AutoConfig.from_pretrained(resolve_model_path(name))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        how = "check --target" if given else "pass --target PATH (a local copy of the target or its Hub id)"
        raise SpecgraftError(f"could not read the target config of {name} ({first}); {how}") from None


def _meta_target(config: Any, name: str) -> Target:
    """A Target whose weights live on the meta device: module structure and sizes without memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Target(model, None, name_or_path=name)


def _read_lm_head(folder: Path, config: Any) -> torch.Tensor | None:
    """The lm_head (or tied input embedding) tensor straight from the target's safetensors files, or None."""
    if not folder.is_dir():
        return None
    from safetensors import safe_open

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    candidates = (["model.embed_tokens.weight", "embed_tokens.weight"] if tied
                  else ["lm_head.weight", "model.lm_head.weight"])
    index = folder / "model.safetensors.index.json"
    files: dict[str, Path] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = {k: folder / v for k, v in weight_map.items()}
    elif (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
            files = {k: folder / "model.safetensors" for k in fh.keys()}
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as fh:
                return fh.get_tensor(name).to(torch.float32)
    return None


# ----------------------------------------------------------------------------------------------------------------
# Draft configs consistent with the target


def rope_fields(config: Any) -> dict[str, Any]:
    """The target's RoPE settings as engines read them: ``rope_theta`` (float) and ``rope_scaling`` (None for
    plain RoPE, else the scaling dict with both ``rope_type`` and the legacy ``type`` key), plus transformers 5's
    ``rope_parameters`` with the same content."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type RoPE (Gemma-3): the draft layer is full attention
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    else:
        theta = getattr(config, "rope_theta", None)
        legacy = getattr(config, "rope_scaling", None)
        params = dict(legacy) if isinstance(legacy, dict) else {}
        params.setdefault("rope_type", params.get("type", "default"))
        params["rope_theta"] = theta
    if theta is None:
        raise SpecgraftError("the target config has no rope_theta; engines need it to place draft positions, "
                             "so this target cannot be exported for an engine")
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope_type == "default":
        scaling_out = None
    else:
        scaling_out = dict(scaling, rope_type=rope_type, type=rope_type)
    return {"rope_theta": float(theta), "rope_scaling": scaling_out, "rope_parameters": params}


def llama_draft_config(config: Any, num_layers: int, dtype: str | None, attention_bias: bool) -> dict[str, Any]:
    """A LlamaConfig dict for a ``num_layers``-layer draft of ``config``'s target, with every value the engines
    read copied from the target: sizes, heads, RoPE, max positions, norm epsilon, activation, special tokens."""
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(config.intermediate_size),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "hidden_act": act,
        "max_position_embeddings": int(config.max_position_embeddings),
        "rms_norm_eps": float(config.rms_norm_eps),
        "vocab_size": int(config.vocab_size),
        **rope_fields(config),
        "attention_bias": bool(attention_bias),
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(config, "bos_token_id", None),
        "eos_token_id": getattr(config, "eos_token_id", None),
        "pad_token_id": getattr(config, "pad_token_id", None),
    }
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def config_dtype_name(config: Any) -> str | None:
    """The target's weight dtype name from its config (``bfloat16``, ...), or None when unrecorded."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return None
    return str(value).replace("torch.", "")
