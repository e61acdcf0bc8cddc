"""What each serving engine loads: the exact tensor names, shapes and dtypes per (head type, format).

Engines skip weight names they do not know and leave parameters they expect but do not find at their
initial values, both silently, so every exporter checks its output against one of the tables below: a missing
name, an unexpected name, a wrong shape or a wrong dtype is an error before anything is written.

A table is a tuple of :class:`TensorRule` (a name template, a symbolic shape, the loop variables the template
uses and an optional condition). :func:`expected_tensors` expands a table for concrete :class:`Dims`.

Sources (checked facts, see ``specgraft/export/FORMATS.md``):

* vLLM ``MedusaModel``: ``blocks.{k}.layers.{l}.weight/bias`` (bias only with ``medusa_fc_bias``),
  ``lm_heads.{k}.weight`` (only ``lm_heads.0`` with ``original_lm_head``), no lm_head bias.
* FasterDecoding Medusa (TensorRT-LLM's converter, TGI): ``{k}.{l}.linear.weight/bias``, ``{k}.{L}.weight``
  in ``medusa_lm_head.safetensors`` (the reference writes a pickled ``medusa_lm_head.pt``; the TensorRT-LLM
  converter reads either file, we write safetensors only).
* vLLM ``EagleLlamaForCausalLM`` / SGLang ``LlamaForCausalLMEagle``: ``fc``, ``layers.{j}.*`` of a Llama
  layer, no input norm in layer 0; vLLM's fc has no bias, SGLang's always has one.
* EAGLE-3, speculators layout (vLLM ``Eagle3LlamaForCausalLM`` and the speculators package): ``fc``,
  ``layers.0.*`` (2h-wide q/k/v, ``hidden_norm``), ``layers.{j}.*`` plain Llama layers, ``norm``, ``lm_head``,
  ``d2t``, ``t2d``.
* EAGLE-3, SGLang ``LlamaForCausalLMEagle3`` and TensorRT-LLM's PyTorch backend: the same with ``midlayer.``
  instead of ``layers.0.``, one layer only; TensorRT-LLM has ``d2t`` only when the draft vocabulary is smaller
  than the target's and no ``t2d``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from specgraft.errors import SpecgraftError


@dataclass(frozen=True)
class Dims:
    """The sizes and switches a layout table is expanded with."""

    hidden: int = 0
    """h, the draft's (= the target's) hidden size."""
    vocab: int = 0
    """V, the target's vocabulary size."""
    draft_vocab: int = 0
    """Vd, EAGLE-3's draft vocabulary size."""
    num_heads: int = 0
    """K, Medusa heads."""
    medusa_layers: int = 0
    """Residual blocks per Medusa head."""
    draft_layers: int = 0
    """EAGLE decoder layers (EAGLE-3: the midlayer plus plain layers)."""
    q_size: int = 0
    """num_attention_heads * head_dim."""
    kv_size: int = 0
    """num_key_value_heads * head_dim."""
    intermediate: int = 0
    """MLP width."""
    num_features: int = 3
    """EAGLE-3: target layers fused by fc."""
    fc_bias: bool = False
    attention_bias: bool = False
    """q/k/v/o biases (written as Llama's ``attention_bias``)."""
    shared_lm_head: bool = False
    """Medusa heads that borrow the target's lm_head."""
    draft_vocab_smaller: bool = False
    """EAGLE-3: Vd < V."""

    def value(self, symbol: str | int) -> int:
        """An int, a field name, or a product of those (``2*hidden``, ``num_features*hidden``)."""
        if isinstance(symbol, int):
            return symbol
        if "*" in symbol:
            left, right = symbol.split("*", 1)
            return self.value(left) * self.value(right)
        return int(symbol) if symbol.isdigit() else int(getattr(self, symbol))


#: Loop variables usable in name templates -> the range they take for given dims.
_LOOPS = {
    "k": lambda d: range(d.num_heads),
    "l": lambda d: range(d.medusa_layers),
    "j": lambda d: range(d.draft_layers),
    "j1": lambda d: range(1, d.draft_layers),
}


@dataclass(frozen=True)
class TensorRule:
    """One family of tensors: ``template`` (``str.format`` with loop variables and Dims fields), its symbolic
    ``shape``, its dtype kind and the Dims switch that must be on for it to exist."""

    template: str
    shape: tuple[str | int, ...]
    loops: tuple[str, ...] = ()
    when: str | None = None
    unless: str | None = None
    dtype: str = "float"
    """float | int64 | bool."""


def llama_layer(prefix: str, loops: tuple[str, ...], qkv_in: str = "hidden",
                 input_norm: bool = True, hidden_norm: bool = False) -> tuple[TensorRule, ...]:
    """The tensors of one Llama decoder layer (q/k/v read ``qkv_in`` features)."""
    rules = [
        TensorRule(f"{prefix}.self_attn.q_proj.weight", ("q_size", qkv_in), loops),
        TensorRule(f"{prefix}.self_attn.k_proj.weight", ("kv_size", qkv_in), loops),
        TensorRule(f"{prefix}.self_attn.v_proj.weight", ("kv_size", qkv_in), loops),
        TensorRule(f"{prefix}.self_attn.o_proj.weight", ("hidden", "q_size"), loops),
        TensorRule(f"{prefix}.self_attn.q_proj.bias", ("q_size",), loops, when="attention_bias"),
        TensorRule(f"{prefix}.self_attn.k_proj.bias", ("kv_size",), loops, when="attention_bias"),
        TensorRule(f"{prefix}.self_attn.v_proj.bias", ("kv_size",), loops, when="attention_bias"),
        TensorRule(f"{prefix}.self_attn.o_proj.bias", ("hidden",), loops, when="attention_bias"),
        TensorRule(f"{prefix}.mlp.gate_proj.weight", ("intermediate", "hidden"), loops),
        TensorRule(f"{prefix}.mlp.up_proj.weight", ("intermediate", "hidden"), loops),
        TensorRule(f"{prefix}.mlp.down_proj.weight", ("hidden", "intermediate"), loops),
        TensorRule(f"{prefix}.post_attention_layernorm.weight", ("hidden",), loops),
    ]
    if input_norm:
        rules.append(TensorRule(f"{prefix}.input_layernorm.weight", ("hidden",), loops))
    if hidden_norm:
        rules.append(TensorRule(f"{prefix}.hidden_norm.weight", ("hidden",), loops))
    return tuple(rules)


EAGLE3_TAIL = (
    TensorRule("norm.weight", ("hidden",)),
    TensorRule("lm_head.weight", ("draft_vocab", "hidden")),
)

_DTYPES = {"int64": (torch.int64,), "bool": (torch.bool,)}


def expand_rules(rules: Sequence[TensorRule], dims: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype kind) of every tensor a layout table ``rules`` names for ``dims``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    fields = {name: getattr(dims, name) for name in dims.__dataclass_fields__}
    for rule in rules:
        if rule.when is not None and not getattr(dims, rule.when):
            continue
        if rule.unless is not None and getattr(dims, rule.unless):
            continue
        shape = tuple(dims.value(s) for s in rule.shape)
        ranges = [_LOOPS[v](dims) for v in rule.loops]
        for combo in itertools.product(*ranges):
            name = rule.template.format(**fields, **dict(zip(rule.loops, combo)))
            out[name] = (shape, rule.dtype)
    return out


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], str]],
                  what: str) -> None:
    """Raise SpecgraftError unless ``tensors`` has exactly the ``expected`` names, shapes and dtype kinds."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise SpecgraftError(f"{what} does not match the engine's weight names (missing {missing[:6]}, unexpected "
                             f"{unexpected[:6]}); this is a specgraft bug, please report it with the head config")
    for name, (shape, kind) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise SpecgraftError(f"{what}: tensor {name} has shape {tuple(tensor.shape)} but the engine expects "
                                 f"{shape}; the head config and its weights disagree, re-save the head")
        ok = tensor.dtype in _DTYPES[kind] if kind in _DTYPES else tensor.dtype.is_floating_point
        if not ok:
            raise SpecgraftError(f"{what}: tensor {name} has dtype {tensor.dtype} but the engine expects {kind}; "
                                 "re-save the head")
