"""Building blocks shared by the EAGLE heads, made from the TARGET's own transformers classes.

No modeling code is copied: a draft decoder layer is an instance of ``type(target.decoder_layers[0])`` built from a
copy of the target's config (``num_hidden_layers`` = draft layers, every layer full attention), positions come from
the target's own rotary embedding module, and EAGLE-3's midlayer re-uses the family's attention, MLP and norm
classes (only the q/k/v input projections are re-created to take ``2h`` inputs).

Draft attention (both heads) goes through :func:`eagle_attention_forward`, registered with transformers'
``AttentionInterface`` under :data:`EAGLE_ATTENTION` so that the family's attention module (its projections, q/k
norms, RoPE and soft-capping) runs unchanged while the score computation always honours explicit 4D masks (tree
drafting; the target's own backend may be flash attention) and supports training-time test:

* without TTT state it is ordinary attention under an explicit additive mask (decoding, with a KV cache);
* with a :class:`TTTKeys` state (training-time test) step ``s`` of the unrolled draft attends, at every position
  ``i`` at once, to the step-0 keys ``K0[0..i]`` (causal) plus the ``s`` "diagonal" keys ``K1[i] .. Ks[i]`` the same
  position produced at the earlier steps -- exactly what a KV cache holds when decoding position ``i`` for ``s``
  more steps, at a cost of one ``T x T`` score matrix plus ``s`` dot products per position.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specgraft.decoding.tree import additive_from_visible
from specgraft.errors import SpecgraftError
from specgraft.target import Target

#: Name of the attention function registered with transformers' AttentionInterface for EAGLE-3 drafts.
EAGLE_ATTENTION = "specgraft_eagle"

#: Input projections of an attention module that read the layer input (re-created with 2h inputs for EAGLE-3).
_QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj")

#: Norm attributes a decoder layer may have, by layout.
_PRE_NORM = {"input_layernorm", "post_attention_layernorm"}
_SANDWICH_NORM = _PRE_NORM | {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


# -- config and layers -----------------------------------------------------------------------------------------
def draft_layer_config(target: Target, num_layers: int, attn_implementation: str | None = None) -> Any:
    """A copy of the target's (text) config describing a ``num_layers``-layer draft of the same family.

    Every draft layer is full attention (the draft's masks are explicit; sliding windows of the target's layers do
    not apply to its one or two layers), and ``attn_implementation`` overrides the target's attention backend.
    """
    cfg = copy.deepcopy(target.text_config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * num_layers
    if hasattr(cfg, "use_sliding_window"):
        cfg.use_sliding_window = False
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    return cfg


def decoder_layer_class(target: Target) -> type[nn.Module]:
    """The class of the target's decoder layers (LlamaDecoderLayer, Qwen3DecoderLayer, ...)."""
    try:
        layers = target.decoder_layers
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise SpecgraftError(f"{target.name_or_path} ({target.identity.architecture}) exposes no decoder layers "
                             "(model.get_decoder().layers); EAGLE heads support decoder-only transformers LMs with "
                             "a `layers` list (Llama, Qwen, Mistral, Gemma, Phi, ...)")
    return type(layers[0])


def build_decoder_layer(target: Target, cfg: Any, layer_idx: int) -> nn.Module:
    """A freshly initialised decoder layer of the target's family for config ``cfg``."""
    cls = decoder_layer_class(target)
    try:
        layer = cls(cfg, layer_idx)
    except TypeError as exc:
        raise SpecgraftError(f"cannot build a {cls.__name__} for the draft ({exc}); this architecture's decoder "
                             "layer does not follow the transformers (config, layer_idx) convention, so EAGLE "
                             "heads do not support it") from None
    for name in ("self_attn", "mlp"):
        if not isinstance(getattr(layer, name, None), nn.Module):
            raise SpecgraftError(f"{cls.__name__} has no `{name}` module; EAGLE heads support decoder layers with "
                                 "self_attn and mlp sub-modules (Llama, Qwen, Mistral, Gemma, Phi, ...)")
    return layer


def target_rotary(target: Target) -> nn.Module:
    """The target's rotary embedding module (borrowed: it holds no trainable parameters)."""
    rotary = getattr(target.model.get_decoder(), "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise SpecgraftError(f"{target.identity.architecture} has no rotary embedding module (rotary_emb); EAGLE "
                             "heads support RoPE models (Llama, Qwen, Mistral, Gemma, Phi, ...)")
    return rotary


class RotaryPositions:
    """``(cos, sin)`` for draft positions from the target's rotary module.

    Gemma-3 keeps one RoPE per layer type; the draft's layers are full attention, so they use the target's
    ``full_attention`` RoPE when it has one, else the type of the target's last layer.
    """

    def __init__(self, target: Target) -> None:
        self.rotary = target_rotary(target)
        self.layer_type: str | None = None
        if "layer_type" in inspect.signature(self.rotary.forward).parameters:
            types = list(getattr(self.rotary, "layer_types", None) or [])
            target_types = list(getattr(target.text_config, "layer_types", None) or [])
            if "full_attention" in types:
                self.layer_type = "full_attention"
            elif target_types:
                self.layer_type = target_types[-1]
            elif types:
                self.layer_type = types[-1]

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: any [B, T, h] tensor (gives dtype/device); position_ids: [B or 1, T] -> cos, sin [B or 1, T, d]."""
        if self.layer_type is not None:
            return self.rotary(x, position_ids, self.layer_type)
        return self.rotary(x, position_ids)


# -- masks -------------------------------------------------------------------------------------------------------
def causal_additive_mask(
    length: int, key_valid: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive causal mask [B or 1, 1, T, T]: 0 where query i may see key j (j <= i and key j valid), else the
    dtype's minimum. The diagonal is always open so padded rows never become all-masked (no NaN)."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]  # [1, T, T]
    if key_valid is not None:
        eye = torch.eye(length, dtype=torch.bool, device=device)[None]
        allowed = (allowed & key_valid.bool()[:, None, :]) | eye  # [B, T, T]
    return additive_from_visible(allowed, dtype)[:, None]


def diagonal_additive_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, T, T]: 0 on the diagonal (query i sees key i only), the dtype's minimum elsewhere."""
    visible = torch.eye(length, dtype=torch.bool, device=device)[None]  # [1, T, T]
    return additive_from_visible(visible, dtype)[:, None]


# -- attention ---------------------------------------------------------------------------------------------------
class TTTKeys:
    """Keys/values of the unrolled steps of training-time test, per draft layer.

    The first call for a layer stores the step-0 keys/values ``K0, V0`` [B, Hkv, T, d]; each later call appends
    that step's ``Kr, Vr`` (same shape), which position ``i`` sees only at its own row (the "diagonal"). Passing one
    also tells the attention that its mask is the training loops' causal one (``causal_additive_mask``), so a
    single pass (EAGLE-1) passes one too.
    """

    def __init__(self) -> None:
        self.base: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.diag: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if layer_idx not in self.base:
            self.base[layer_idx] = (key, value)
            self.diag[layer_idx] = []
        else:
            self.diag[layer_idx].append((key, value))


def cpu_flash_with_lse(query: torch.Tensor, p_drop: float) -> bool:
    """Whether the attentions that join extra keys to torch's CPU flash kernel by log-sum-exp can run here
    (:class:`_DiagonalKeysAttention`, DFlash's block attention): CPU, no dropout, and torch's CPU flash-attention
    ops (they return the softmax's log-sum-exp, which the public ``scaled_dot_product_attention`` does not)."""
    return (query.device.type == "cpu" and not p_drop
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


class _DiagonalKeysAttention(torch.autograd.Function):
    """Training-time-test attention with the diagonal keys kept out of the fused kernel (CPU).

    ``query`` [B, H, Q, d] attends to the block keys ``key/value`` [B, Hkv, K, d] under the additive ``mask``
    [B or 1, 1, Q, K] (causal too when ``causal``) plus, at each row i (s >= 1), the s diagonal keys ``Kr[i], Vr[i]``
    (``extras`` = K1, V1, ..., Ks, Vs, each [B, Hkv, Q, d]), one softmax over all of them. The block goes through
    torch's CPU flash kernel, which returns its log-sum-exp ``lse_b``; the diagonal scores ``d_r = q_i . Kr[i]``
    join it as ``lse = logsumexp(lse_b, d_1..d_s)`` and ``out = exp(lse_b - lse) out_b + sum_r exp(d_r - lse) Vr[i]``.
    The backward hands the kernel's backward the joint ``out`` and ``lse``, which makes it return exactly the
    block's share of the joint softmax's gradient; the diagonal terms are the same formula done by hand
    (``dS = P (dO . V - rowsum(dO * out))``). Against the keys-concatenated form (K + s*Q keys with a dense
    diagonal mask, then repeated for grouped queries) this does 1/(s + 1) of the kernel work per step and keeps
    the causal block skipping: the same numbers to rounding (pinned by tests/heads/test_eagle3.py). Without
    extras (step 0, and EAGLE-1's single pass) it is the kernel alone, with its causal flag:
    ``F.scaled_dot_product_attention`` refuses a mask together with ``is_causal`` and, given the mask alone, scores
    every key block, masked ones included, which grows with the sequence length.
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, scale: float, *extras: torch.Tensor) -> torch.Tensor:
        block_out, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=mask, scale=scale)  # [B, H, Q, d], [B, H, Q] fp32
        if not extras:  # step 0: the block alone (the kernel's causal flag skips the key blocks above the diagonal)
            out = block_out.contiguous()
            ctx.save_for_backward(query, key, value, mask, out, block_lse, None)
            ctx.causal, ctx.scale = causal, scale
            return out
        diag_scores = _diagonal_scores(query, extras[0::2], scale)  # [B, H, Q, s] fp32
        lse = torch.logsumexp(torch.cat([block_lse.unsqueeze(-1), diag_scores], dim=-1), dim=-1)  # [B, H, Q]
        kv_heads = key.shape[1]
        out = _grouped(block_out * torch.exp(block_lse - lse).unsqueeze(-1).to(block_out.dtype), kv_heads)
        # the diagonal keys' softmax weights, kept (s values per row) for the backward
        weights = torch.exp(diag_scores - lse.unsqueeze(-1))  # [B, H, Q, s] fp32
        for r, diag_value in enumerate(extras[1::2]):  # [B, Hkv, G, Q, d] += [B, Hkv, G, Q, 1] * [B, Hkv, 1, Q, d]
            out = out + _grouped(weights[..., r : r + 1].to(query.dtype), kv_heads) * diag_value.unsqueeze(2)
        out = out.reshape(query.shape).contiguous()  # [B, H, Q, d]
        ctx.save_for_backward(query, key, value, mask, out, lse, weights, *extras)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, mask, out, lse, weights, *extras = ctx.saved_tensors
        scale = ctx.scale
        grad_out = grad_out.contiguous()
        grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, ctx.causal, attn_mask=mask, scale=scale)
        if not extras:
            return grad_query, grad_key, grad_value, None, None, None
        kv_heads = key.shape[1]
        row_dot = (grad_out.float() * out.float()).sum(-1, keepdim=True)  # [B, H, Q, 1]
        grad_query = grad_query.float()
        q5 = _grouped(query, kv_heads).float()  # [B, Hkv, G, Q, d]
        g5 = _grouped(grad_out, kv_heads).float()
        grads: list[torch.Tensor] = []
        for r, (diag_key, diag_value) in enumerate(zip(extras[0::2], extras[1::2])):
            p = _grouped(weights[..., r : r + 1], kv_heads)  # [B, Hkv, G, Q, 1]
            value_dot = (g5 * diag_value.unsqueeze(2).float()).sum(-1, keepdim=True)  # [B, Hkv, G, Q, 1]
            grad_score = p * (value_dot - _grouped(row_dot, kv_heads)) * scale  # [B, Hkv, G, Q, 1]
            grad_query = grad_query + (grad_score * diag_key.unsqueeze(2).float()).reshape(query.shape)
            grads.append((grad_score * q5).sum(2).to(diag_key.dtype))  # [B, Hkv, Q, d]
            grads.append((p * g5).sum(2).to(diag_value.dtype))
        return (grad_query.to(query.dtype), grad_key, grad_value, None, None, None, *grads)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, Q, n] -> [B, Hkv, G, Q, n]: the G query heads that share each KV head (a view when x's layout
    allows)."""
    bsz, heads = x.shape[:2]
    return x.reshape(bsz, kv_heads, heads // kv_heads, *x.shape[2:])


def _diagonal_scores(query: torch.Tensor, diag_keys: Any, scale: float) -> torch.Tensor:
    """[B, H, Q, s] fp32: ``q_i . Kr[i] * scale`` for each diagonal key block Kr [B, Hkv, Q, d] (s >= 1)."""
    kv_heads = diag_keys[0].shape[1]
    q5 = _grouped(query, kv_heads).float()  # [B, Hkv, G, Q, d]
    scores = [(q5 * k.unsqueeze(2).float()).sum(-1) for k in diag_keys]  # each [B, Hkv, G, Q]
    return (torch.stack(scores, dim=-1) * scale).reshape(*query.shape[:3], len(scores))


def register_eagle_attention() -> None:
    """Register :func:`eagle_attention_forward` with transformers (idempotent; called when a head is built)."""
    from transformers import AttentionInterface

    AttentionInterface.register(EAGLE_ATTENTION, eagle_attention_forward)


def eagle_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    eagle_ttt: TTTKeys | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention with optional training-time-test diagonal keys (an ``AttentionInterface`` function).

    Shapes: query [B, H, Q, d]; key/value [B, Hkv, K, d] (after the KV cache when decoding); attention_mask additive
    [B or 1, 1, Q, K] or None (no masking). Returns the output [B, Q, H, d] like every transformers backend.

    With ``eagle_ttt`` (training, Q == K == T): the first call of a layer is step 0 and stores ``key/value`` as
    ``K0/V0``; at step s >= 1 this call's ``key/value`` become ``Ks/Vs``, and position i's scores are
    ``[q_i . K0[j] for j <= i (mask)] ++ [q_i . Kr[i] for r = 1..s]`` -- a [B, H, T, T] block plus s diagonal
    columns [B, H, T, 1], softmaxed jointly, so that all T positions are computed in parallel at each step.
    """
    extra: list[tuple[torch.Tensor, torch.Tensor]] = []
    if eagle_ttt is not None:
        eagle_ttt.add(module.layer_idx, key, value)
        key, value = eagle_ttt.base[module.layer_idx]
        extra = eagle_ttt.diag[module.layer_idx]
    bsz, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    p_drop = dropout if module.training else 0.0
    if not softcap:
        if eagle_ttt is not None and cpu_flash_with_lse(query, p_drop):
            flat = [t for pair in extra for t in pair]
            # causal=True: the training-time-test loops build the step-0 mask causal, so the kernel may skip the
            # key blocks above the diagonal (step 0 included: there is no extra key then)
            out = _DiagonalKeysAttention.apply(query, key, value, attention_mask, True, scale, *flat)
            return out.transpose(1, 2).contiguous(), None
        if extra:
            # The diagonal keys as s more key blocks, each open only on its own row ([Q, Q] diagonal mask): the
            # same joint softmax, through torch's fused kernel, which never holds the [B, H, Q, K + s] scores and
            # weights for the backward (a plain matmul + softmax keeps ~ 2 of them per step and layer).
            block = attention_mask if attention_mask is not None else query.new_zeros(1, 1, q_len, k_len)
            diagonal = diagonal_additive_mask(q_len, query.dtype, query.device).expand(block.shape[0], -1, -1, -1)
            attention_mask = torch.cat([block, *[diagonal] * len(extra)], dim=-1)  # [B or 1, 1, Q, K + s*Q]
            key = torch.cat([key, *(k for k, _ in extra)], dim=2)  # [B, Hkv, K + s*Q, d]
            value = torch.cat([value, *(v for _, v in extra)], dim=2)
        # Plain masked attention (step 0, decoding) too: torch's fused kernel.
        out = F.scaled_dot_product_attention(query, _repeat_kv(key, groups), _repeat_kv(value, groups),
                                             attn_mask=attention_mask, dropout_p=p_drop, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    # Soft-capped scores (Gemma-2) cannot go through the fused kernel: explicit scores [B, H, Q, K + s]. Grouped-
    # query attention without repeating keys: the G query heads of a KV head share one matmul.
    q_grouped = query.reshape(bsz, kv_heads, groups * q_len, head_dim)
    scores = torch.matmul(q_grouped, key.transpose(-1, -2)).view(bsz, kv_heads, groups, q_len, k_len) * scale
    q5 = q_grouped.view(bsz, kv_heads, groups, q_len, head_dim)
    diag = [(q5 * k.unsqueeze(2)).sum(-1, keepdim=True) * scale for k, _ in extra]  # each [B, Hkv, G, Q, 1]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
        diag = [torch.tanh(d / softcap) * softcap for d in diag]
    if attention_mask is not None:
        scores = scores + attention_mask.unsqueeze(1)  # [B or 1, 1, 1, Q, K]
    if diag:
        scores = torch.cat([scores, *diag], dim=-1)  # [B, Hkv, G, Q, K + s]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if p_drop:
        weights = F.dropout(weights, p=p_drop)
    # split (not slicing): its backward is one concatenation instead of a zero-filled full-size grad per slice.
    parts = torch.split(weights, [k_len] + [1] * len(diag), dim=-1)
    out = torch.matmul(parts[0].reshape(bsz, kv_heads, groups * q_len, k_len), value)
    out = out.view(bsz, kv_heads, groups, q_len, head_dim)
    for w, (_, v) in zip(parts[1:], extra):
        out = out + w * v.unsqueeze(2)  # [B, Hkv, G, Q, 1] * [B, Hkv, 1, Q, d]
    out = out.reshape(bsz, heads, q_len, head_dim).transpose(1, 2).contiguous()
    return out, None


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, K, d] -> [B, Hkv * groups, K, d] (each KV head repeated for its query heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# -- EAGLE-3 midlayer --------------------------------------------------------------------------------------------
def _norm_attributes(layer: nn.Module) -> set[str]:
    return {name for name, child in layer.named_children() if "norm" in name.lower() and name != "self_attn"}


class Eagle3MidLayer(nn.Module):
    """EAGLE-3's first draft layer: attention over ``concat(norm(embedding), norm(hidden))`` (2h wide), residual on
    ``hidden`` (h wide), then the family's MLP block.

    Built from a freshly initialised decoder layer of the target's family: its attention module (with the q/k/v
    input projections re-created for 2h inputs), MLP and norms are taken over; ``hidden_norm`` is a fresh copy of
    its input norm. Parameter names match the serving layout: ``self_attn.*``, ``mlp.*``, ``input_layernorm``
    (applied to the embedding), ``hidden_norm``, ``post_attention_layernorm`` (+ Gemma's feed-forward norms).
    """

    def __init__(self, layer: nn.Module, hidden_size: int) -> None:
        super().__init__()
        norms = _norm_attributes(layer)
        if norms == _SANDWICH_NORM:
            self.sandwich = True  # Gemma-2/3: norms before and after both the attention and the MLP
        elif norms == _PRE_NORM:
            self.sandwich = False  # Llama, Qwen, Mistral, Phi: input norm + post-attention (pre-MLP) norm
        else:
            raise SpecgraftError(f"{type(layer).__name__} has norms {sorted(norms)}; the EAGLE-3 midlayer supports "
                                 "pre-norm layers (input_layernorm, post_attention_layernorm) and Gemma's sandwich "
                                 "norms; use the eagle head type for this target")
        attn = layer.self_attn
        found = False
        for name in _QKV_NAMES:
            proj = getattr(attn, name, None)
            if isinstance(proj, nn.Linear):
                if proj.in_features != hidden_size:
                    raise SpecgraftError(f"{type(attn).__name__}.{name} reads {proj.in_features} features, not the "
                                         f"hidden size {hidden_size}; EAGLE-3 cannot widen it to 2h")
                setattr(attn, name, nn.Linear(2 * hidden_size, proj.out_features, bias=proj.bias is not None,
                                              device=proj.weight.device, dtype=proj.weight.dtype))
                found = True
        if not found:
            raise SpecgraftError(f"{type(attn).__name__} has none of the projections {', '.join(_QKV_NAMES)}; the "
                                 "EAGLE-3 midlayer cannot widen its input to 2h; use the eagle head type")
        self.self_attn = attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.post_attention_layernorm = layer.post_attention_layernorm
        if self.sandwich:
            self.pre_feedforward_layernorm = layer.pre_feedforward_layernorm
            self.post_feedforward_layernorm = layer.post_feedforward_layernorm

    @torch.no_grad()
    def copy_decoder_layer(self, layer: nn.Module) -> None:
        """Take over the weights of ``layer``, a decoder layer of the same family (the target's): the midlayer
        then computes on ``hidden`` what ``layer`` computes on its input, whatever the embedding (the q/k/v
        columns that read the embedding start at zero; the embedding's own norm keeps its initialisation)."""
        state = {name: value.detach() for name, value in layer.state_dict().items()}
        for name in [name for name in state if name.startswith("input_layernorm.")]:
            state["hidden_norm." + name.removeprefix("input_layernorm.")] = state.pop(name)
        for name, current in self.state_dict().items():
            if name.startswith("input_layernorm."):
                continue
            source = state.get(name)
            if source is None:
                raise SpecgraftError(f"{type(layer).__name__} has no {name} to start the EAGLE-3 midlayer's from; "
                                     "use head.layer_init=random")
            if current.shape == source.shape:
                current.copy_(source)
            elif current.ndim == 2 and current.shape[0] == source.shape[0] and current.shape[1] == 2 * source.shape[1]:
                width = source.shape[1]  # q/k/v read concat(embedding, hidden): the hidden half is the layer's
                current[:, :width].zero_()
                current[:, width:].copy_(source)
            else:
                raise SpecgraftError(f"cannot start the EAGLE-3 midlayer's {name} {tuple(current.shape)} from "
                                     f"{type(layer).__name__}'s {tuple(source.shape)}; use head.layer_init=random")

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """embeds, hidden: [B, T, h] -> [B, T, h] (kwargs: cache / eagle_ttt / position_ids for the attention)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2h]
        attn, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **kwargs)
        if self.sandwich:
            attn = self.post_attention_layernorm(attn)
        hidden = residual + attn
        residual = hidden
        if self.sandwich:
            hidden = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        else:
            hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


# -- input preconditioning -------------------------------------------------------------------------------------
class InputScaledLinear(nn.Linear):
    """A Linear that may multiply its input by a fixed per-feature scale while it trains, folded into ``weight``
    wherever the weights leave the module.

    Training ``y = W' (x * s)`` instead of ``y = W x`` is the same function with ``W = W' * s`` (columns scaled),
    but AdamW moves every entry of ``W'`` at about the learning rate, so each input feature reaches the output at
    a speed proportional to its scaled size: with ``s`` about 1 / the typical size of each feature, features of
    very different sizes (a target's shallow and deep hidden states, or their outlier dimensions) learn at the same
    speed. ``state_dict`` holds the folded ``W`` and ``load_state_dict`` takes a folded ``W`` (unfolding it with the
    current scale), so saved heads, checkpoints and every export are plain Linear weights. Scales are powers of
    two, which makes folding and unfolding exact: a resumed run is bitwise the uninterrupted one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # [in_features] power-of-two input multiplier while training; None: a plain Linear (never saved).
        self.register_buffer("input_scale", None, persistent=False)
        self.register_state_dict_post_hook(_fold_input_scale)
        self.register_load_state_dict_post_hook(_unfold_input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is None:
            return super().forward(x)
        return F.linear(x * self.input_scale, self.weight, self.bias)

    @torch.no_grad()
    def set_input_scale(self, scale: torch.Tensor | None, *, keep_function: bool) -> None:
        """Scale the input by ``scale`` [in_features] (powers of two) from now on; None: back to a plain Linear.
        ``keep_function``: re-express the current weight so that the layer computes the same function (a
        warm-started or loaded weight); else the weight stays as it is (a fresh initialisation, which then applies
        to the scaled input)."""
        if scale is not None:
            scale = scale.to(device=self.weight.device, dtype=self.weight.dtype)
            if tuple(scale.shape) != (self.in_features,):
                raise ValueError(f"input scale of shape {tuple(scale.shape)} for {self.in_features} input features")
            exponent = torch.log2(scale)
            if not torch.equal(exponent, exponent.round()):
                raise ValueError("input scales must be powers of two (folding them into the weight is then exact)")
        if keep_function:
            folded = self.weight if self.input_scale is None else self.weight * self.input_scale
            self.weight.copy_(folded if scale is None else folded / scale)
        self.input_scale = scale


def _fold_input_scale(module: InputScaledLinear, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    if module.input_scale is not None and prefix + "weight" in state:
        state[prefix + "weight"] = state[prefix + "weight"] * module.input_scale


def _unfold_input_scale(module: InputScaledLinear, incompatible_keys: Any) -> None:
    if module.input_scale is not None:
        with torch.no_grad():
            module.weight.div_(module.input_scale)


def power_of_two_scale(typical_size: torch.Tensor) -> torch.Tensor:
    """``2 ** -round(log2(size))``: the power of two nearest to ``1 / size`` (sizes clamped away from 0)."""
    return torch.exp2(-torch.log2(typical_size.float().clamp_min(1e-6)).round())
