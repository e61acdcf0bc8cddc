"""The DFlash head: target context features, a mask-token block and a few non-causal draft layers.

Architecture (speculators' ``DFlashDraftModel``, vllm-project/speculators @c05b95b,
``src/speculators/models/dflash/{core,model_definitions}.py``; vLLM ``DFlashQwen3ForCausalLM``):

* context features ``c_t = hidden_norm(fc(concat(H_i[t] for i in aux_layer_ids)))`` for every position the target
  processed;
* a block ``[x_a, MASK, ..., MASK]`` at positions ``a .. a + bs - 1`` embedded with the target's (frozen) table;
* each draft layer is a decoder layer of the target's own family whose attention reads
  ``concat(c, input_layernorm(block))``: keys/values come from the context features (NOT re-normed, the same ``c``
  for every layer) and from the block; queries only from the block (bidirectional inside it); the residual stream
  and MLP run on the block only;
* ``norm`` then the target's lm_head (borrowed) or, with a reduced draft vocabulary, the head's own ``lm_head``
  and ``d2t``/``t2d`` as EAGLE-3.

Weight names: ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*`` (the family layer's own names, e.g.
``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm`` for Qwen3, ``mlp.*``, ``input_layernorm``,
``post_attention_layernorm``), ``norm.weight``, and ``lm_head.weight``/``d2t``/``t2d`` only when reduced.

The family's attention module is reused unchanged: it projects all ``C + Q`` rows (with its own q/k norms and
RoPE) and calls the attention function registered here, which computes only the last ``Q`` (block) query rows
against every key and returns zeros for the context rows (their o_proj output is dropped). Computing q/o for the
context rows is the price of not copying the family's attention code (the k/v projections are needed anyway).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specgraft.errors import SpecgraftError
from specgraft.heads.dflash.config import DFlashConfig, resolve_dflash_config
from specgraft.heads.dflash.losses import (
    additive_mask,
    block_context_mask,
    block_label_mask,
    block_positions,
    dflash_position_weights,
    own_block_mask,
    select_anchors,
)
from specgraft.heads.draft_vocab import assign_draft_vocab, check_counts, coverage_facts, draft_to_target_ids
from specgraft.heads.head import UNRANKED, DraftHead, HeadLoss, draft_columns, token_ranks
from specgraft.heads.layers import RotaryPositions, build_decoder_layer, cpu_flash_with_lse, draft_layer_config
from specgraft.heads.losses import divide_by_count, linear_cross_entropy
from specgraft.target import Target, TargetOutput
from specgraft.utils.seeds import derive_seed

logger = logging.getLogger(__name__)

#: Name of the attention function registered with transformers' AttentionInterface for DFlash drafts.
DFLASH_ATTENTION = "specgraft_dflash"

#: Block slots per draft forward when the held-out acceptance is measured (a block at every position): bounds the
#: forward's attention memory (slots x context keys) on long rows.
EVAL_BLOCK_SLOTS = 2048

_PRE_NORM = frozenset({"input_layernorm", "post_attention_layernorm"})
_SANDWICH_NORM = _PRE_NORM | {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


# -- attention -----------------------------------------------------------------------------------------------
def register_dflash_attention() -> None:
    """Register :func:`dflash_attention_forward` with transformers (idempotent; called when a head is built)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DFLASH_ATTENTION, dflash_attention_forward)


def dflash_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    dflash_queries: int | None = None,
    dflash_block_size: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of the last ``dflash_queries`` query rows over every key (an ``AttentionInterface`` function).

    Shapes: query [B, H, R, d] (R = context rows + Q block rows), key/value [B, Hkv, K, d] (after the cache),
    attention_mask additive [B or 1, 1, Q, K] or None (every key visible: no causal masking at all). Returns
    [B, R, H, d] with zeros in the first ``R - Q`` rows.

    ``dflash_block_size`` (training): the keys are ``[context (K - Q) | the Q block slots]``, the Q queries form
    Q / bs blocks of ``bs`` slots, and a query sees the context keys ``attention_mask`` [B or 1, 1, Q, K - Q] opens
    and exactly the slots of its own block. On the CPU that goes through :class:`_BlockKeysAttention` (context keys
    through the fused kernel, the in-block keys by hand, one joint softmax) instead of scoring every block against
    every other; elsewhere the dense mask over all K keys is built here.
    """
    rows = query.shape[2]
    q_len = rows if dflash_queries is None else int(dflash_queries)
    q = query[:, :, rows - q_len:]
    p_drop = dropout if module.training else 0.0
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if dflash_block_size and attention_mask is None:
        raise ValueError("dflash_block_size needs the context mask (attention_mask [B, 1, Q, K - Q])")
    if dflash_block_size and not softcap and cpu_flash_with_lse(q, p_drop):
        context_len = key.shape[2] - q_len
        out = _BlockKeysAttention.apply(q.contiguous(), key[:, :, :context_len], value[:, :, :context_len],
                                        attention_mask, key[:, :, context_len:], value[:, :, context_len:],
                                        int(dflash_block_size), scale)
    else:
        if dflash_block_size:  # the dense mask: the context part given, each block's own slots open
            own = additive_mask(own_block_mask(q_len // int(dflash_block_size), int(dflash_block_size),
                                               q.device)[None], attention_mask.dtype)  # [1, 1, Q, Q]
            attention_mask = torch.cat([attention_mask, own.expand(attention_mask.shape[0], -1, -1, -1)], dim=-1)
        groups = q.shape[1] // key.shape[1]
        # On the CPU the fused kernel shares each key/value head among its query heads itself, so the copies are
        # skipped there; elsewhere not every kernel does.
        native_gqa = groups > 1 and not softcap and q.device.type == "cpu"
        if groups > 1 and not native_gqa:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        if softcap:
            scores = torch.matmul(q, key.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            if attention_mask is not None:
                scores = scores + attention_mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(F.dropout(weights, p=p_drop) if p_drop else weights, value)
        else:
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=p_drop,
                                                 scale=scale, enable_gqa=native_gqa)
    out = out.transpose(1, 2)  # [B, Q, H, d]
    if q_len < rows:
        out = torch.cat([out.new_zeros(out.shape[0], rows - q_len, *out.shape[2:]), out], dim=1)
    return out.contiguous(), None


def _blocked(x: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
    """[B, H, Q, d] -> [B, Hkv, H / Hkv, Q / bs, bs, d] (a view of a contiguous x)."""
    bsz, heads, length, dim = x.shape
    return x.reshape(bsz, kv_heads, heads // kv_heads, length // block_size, block_size, dim)


class _BlockKeysAttention(torch.autograd.Function):
    """DFlash training attention with the in-block keys kept out of the fused kernel (CPU).

    ``query`` [B, H, Q, d] (Q = A blocks of ``bs`` slots) attends to the context keys ``key/value`` [B, Hkv, T, d]
    under the additive ``mask`` [B or 1, 1, Q, T], plus the ``bs`` keys ``block_key/block_value`` [B, Hkv, Q, d] of
    its own block (all visible), one softmax over both. The context goes through torch's CPU flash kernel, which
    returns its log-sum-exp ``lse_c``; the [bs, bs] in-block scores ``S_b`` join it as ``lse = logsumexp(lse_c, S_b)``
    and ``out = exp(lse_c - lse) out_c + exp(S_b - lse) V_b``. The backward hands the kernel's backward the joint
    ``out`` and ``lse``, which makes it return exactly the context's share of the joint softmax's gradient; the
    in-block share is the same formula done by hand (``dS = P (dO V^T - rowsum(dO * out))``). Against the dense
    form (every query scored against all T + Q keys, the other blocks masked) this scores T + bs keys per query
    instead of T + Q: the same numbers to rounding (pinned by tests/heads/dflash/test_dflash.py).
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                block_key: torch.Tensor, block_value: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        kv_heads = key.shape[1]
        ctx_out, ctx_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scale)  # [B, H, Q, d], [B, H, Q] fp32
        q6 = _blocked(query, kv_heads, block_size).float()  # [B, Hkv, G, A, bs, d]
        k6 = _blocked(block_key.contiguous(), kv_heads, block_size).float()  # [B, Hkv, 1, A, bs, d]
        v6 = _blocked(block_value.contiguous(), kv_heads, block_size).float()
        scores = q6 @ k6.transpose(-1, -2) * scale  # [B, Hkv, G, A, bs(query), bs(key)]
        ctx_lse6 = _blocked(ctx_lse.unsqueeze(-1), kv_heads, block_size)  # [B, Hkv, G, A, bs, 1]
        lse6 = torch.logsumexp(torch.cat([ctx_lse6, scores], dim=-1), dim=-1, keepdim=True)  # [B, Hkv, G, A, bs, 1]
        weights = torch.exp(scores - lse6)  # the in-block softmax weights, kept for the backward
        out6 = _blocked(ctx_out, kv_heads, block_size).float() * torch.exp(ctx_lse6 - lse6) + weights @ v6
        out = out6.reshape(query.shape).to(query.dtype).contiguous()  # [B, H, Q, d]
        lse = lse6.reshape(ctx_lse.shape)  # [B, H, Q]
        ctx.save_for_backward(query, key, value, mask, block_key, block_value, out, lse, weights)
        ctx.block_size, ctx.scale = block_size, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, mask, block_key, block_value, out, lse, weights = ctx.saved_tensors
        bs, scale = ctx.block_size, ctx.scale
        kv_heads = key.shape[1]
        grad_out = grad_out.contiguous()
        grad_query, grad_key, grad_value = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        g6 = _blocked(grad_out, kv_heads, bs).float()  # [B, Hkv, G, A, bs, d]
        o6 = _blocked(out, kv_heads, bs).float()
        q6 = _blocked(query, kv_heads, bs).float()
        k6 = _blocked(block_key.contiguous(), kv_heads, bs).float()
        v6 = _blocked(block_value.contiguous(), kv_heads, bs).float()
        row_dot = (g6 * o6).sum(-1, keepdim=True)  # [B, Hkv, G, A, bs, 1]
        grad_scores = weights * (g6 @ v6.transpose(-1, -2) - row_dot) * scale  # [B, Hkv, G, A, bs, bs]
        grad_query = grad_query.float() + (grad_scores @ k6).reshape(query.shape)
        # keys/values: summed over the G query heads that share them
        grad_block_key = (grad_scores.transpose(-1, -2) @ q6).sum(2).reshape(block_key.shape)
        grad_block_value = (weights.transpose(-1, -2) @ g6).sum(2).reshape(block_value.shape)
        return (grad_query.to(query.dtype), grad_key, grad_value, None, grad_block_key.to(block_key.dtype),
                grad_block_value.to(block_value.dtype), None, None)


def _layer_norms(layer: nn.Module) -> bool:
    """True for Gemma's sandwich norms, False for pre-norm layers; raises for other layouts."""
    norms = {name for name, child in layer.named_children() if "norm" in name.lower() and name != "self_attn"}
    if norms == _SANDWICH_NORM:
        return True
    if norms == _PRE_NORM:
        return False
    raise SpecgraftError(f"{type(layer).__name__} has norms {sorted(norms)}; DFlash draft layers support pre-norm "
                         "layers (input_layernorm, post_attention_layernorm) and Gemma's sandwich norms")


def qwen3_layer_config(target: Target, num_layers: int) -> Any:
    """A transformers ``Qwen3Config`` for ``num_layers`` draft layers with the target's sizes, activation, norm
    epsilon and RoPE (speculators builds DFlash drafts of any target this way)."""
    from transformers import Qwen3Config

    src = target.text_config
    heads = int(src.num_attention_heads)
    rotary = float(getattr(src, "partial_rotary_factor", 1.0) or 1.0)
    if rotary != 1.0:
        raise SpecgraftError(f"{target.identity.model_type} rotates only {rotary:.0%} of each head, which Qwen3 "
                             "layers cannot; use head.draft_layers: target for this target")
    eps = next((getattr(src, name) for name in ("rms_norm_eps", "layer_norm_eps") if getattr(src, name, None)),
               1e-6)
    cfg = Qwen3Config(
        vocab_size=int(src.vocab_size), hidden_size=int(src.hidden_size),
        intermediate_size=int(src.intermediate_size), num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=int(getattr(src, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(src, "head_dim", None) or src.hidden_size // heads),
        hidden_act=str(getattr(src, "hidden_act", None) or getattr(src, "hidden_activation", "silu")),
        max_position_embeddings=int(getattr(src, "max_position_embeddings", 4096) or 4096), rms_norm_eps=float(eps),
        rope_parameters=copy.deepcopy(getattr(src, "rope_parameters", None)), attention_bias=False,
        tie_word_embeddings=False, layer_types=["full_attention"] * num_layers, use_sliding_window=False)
    cfg._attn_implementation = DFLASH_ATTENTION
    return cfg


# -- the head ------------------------------------------------------------------------------------------------
#: Where a batch keeps the anchors drawn for it (see :meth:`DFlashHead.batch_anchors`).
ANCHORS_KEY = "dflash_anchors"


class DFlashHead(DraftHead):
    """DFlash draft head (see the module docstring)."""

    head_type = "dflash"
    Config = DFlashConfig
    needs_target_logits = True

    def __init__(self, config: DFlashConfig, target: Target) -> None:
        config.check_against_target(target)
        super().__init__(config, target)
        register_dflash_attention()
        h = target.hidden_size
        if config.draft_layers == "qwen3":
            from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

            self.draft_config = qwen3_layer_config(target, config.num_layers)
            self.layers = nn.ModuleList(Qwen3DecoderLayer(self.draft_config, i) for i in range(config.num_layers))
        else:
            self.draft_config = draft_layer_config(target, config.num_layers, attn_implementation=DFLASH_ATTENTION)
            self.layers = nn.ModuleList(build_decoder_layer(target, self.draft_config, i)
                                        for i in range(config.num_layers))
        self._sandwich = _layer_norms(self.layers[0])
        self.fc = nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        # Fresh copies of the family's norm class (still untrained) for the context and final norms.
        self.hidden_norm = copy.deepcopy(self.layers[0].input_layernorm)
        self.norm = copy.deepcopy(self.layers[0].input_layernorm)
        if config.reduced_vocab:
            vd, v = config.draft_vocab_size, target.vocab_size
            self.lm_head = nn.Linear(h, vd, bias=False)
            # Until prepare_from_data: the first Vd target ids (d2t zeros).
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[:vd] = True
            self.register_buffer("t2d", t2d)
        else:
            self.lm_head = None
            self.d2t = None
            self.t2d = None
        # Borrowed from the target, never registered: a plain object holding the (buffer-only) rotary module.
        self._rope = RotaryPositions(target)
        self.to(device=target.device)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def build(cls, target: Target, config: DFlashConfig) -> DFlashHead:
        """A fresh head whose final norm (and own lm_head rows) start from the target's; the rest is random."""
        head = cls(config, target)
        head._init_from_target()
        return head

    @classmethod
    def config_from_recipe(cls, head_cfg: Any, target: Target) -> DFlashConfig:
        """The DFlash fields of a recipe's head section (None or absent = default); ``feature_layers`` is accepted
        as the recipe-wide name of ``aux_layer_ids``."""
        names = ("block_size", "num_layers", "aux_layer_ids", "mask_token_id", "draft_vocab_size", "decay_gamma",
                 "max_anchors", "sample_from_anchor", "draft_layers")
        fields = {name: getattr(head_cfg, name, None) for name in names}
        if fields["aux_layer_ids"] is None:
            fields["aux_layer_ids"] = getattr(head_cfg, "feature_layers", None)
        return resolve_dflash_config(target, **fields)

    @torch.no_grad()
    def _init_from_target(self) -> None:
        final_norm = self.target.final_norm
        if type(final_norm) is type(self.norm) and final_norm.state_dict().keys() == self.norm.state_dict().keys():
            self.norm.load_state_dict({k: v.detach().clone() for k, v in final_norm.state_dict().items()})
        if self.lm_head is not None:
            weight = self.target.output_head.weight
            rows = weight.index_select(0, self.draft_token_ids().to(weight.device))
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def prepare_from_data(self, token_counts: torch.Tensor | None, heldout_counts: torch.Tensor | None = None,
                          *, keep_vocabulary: bool = False) -> dict[str, Any]:
        """With a reduced draft vocabulary: choose it from the loss-token counts [V] (sets d2t/t2d, re-initialises
        the lm_head rows) and report its coverage (held-out when given); ``keep_vocabulary`` (a warm-started head):
        keep it and report its coverage only. Nothing to do for the full vocabulary."""
        if not self.config.reduced_vocab:
            return {}
        vd, v = self.config.draft_vocab_size, self.target.vocab_size
        if token_counts is None:
            if not keep_vocabulary:
                logger.warning("no token counts given: the DFlash draft vocabulary stays the first %d target ids", vd)
            return {}
        check_counts(v, token_counts, heldout_counts)
        if not keep_vocabulary:
            assign_draft_vocab(self.d2t, self.t2d, token_counts)
            self._init_from_target()
        return coverage_facts(self.t2d, token_counts, heldout_counts)

    def required_layers(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(int(i) for i in self.config.aux_layer_ids))

    # -- forward ---------------------------------------------------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def param_device(self) -> torch.device:
        return self.fc.weight.device

    def draft_token_ids(self) -> torch.Tensor | None:
        """[Vd] target id of every draft logit column, or None when the draft predicts the full target vocab."""
        return None if self.d2t is None else draft_to_target_ids(self.d2t)

    def _projection_module(self) -> nn.Module:
        """The draft's vocabulary projection: its own lm_head (reduced vocabulary) or the target's."""
        return self.lm_head if self.lm_head is not None else self.target.output_head

    def _output_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [V_out, h], bias or None) of the draft's vocabulary projection."""
        projection = self._projection_module()
        return projection.weight, getattr(projection, "bias", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, Q] -> [B, Q, h] the target's (frozen) input embeddings, in the head's dtype."""
        return self.target.embed(input_ids).to(self.param_dtype)

    def context_features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """``hidden_norm(fc(concat(aux layers)))``: [.., T, k*h] -> [.., T, h]."""
        fused = torch.cat([hidden_states[int(i)] for i in self.config.aux_layer_ids], dim=-1)
        return self.hidden_norm(self.fc(fused.to(self.param_dtype)))

    def block_forward(self, block_embeds: torch.Tensor, context: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache: Any = None,
                      blocks_of: int | None = None) -> torch.Tensor:
        """The draft layers over Q block slots.

        Args:
            block_embeds: [B, Q] slot embeddings (:meth:`embed` of the anchor and mask tokens).
            context: [B, C] new context features (:meth:`context_features`); C may be 0.
            position_ids: [B or 1, C + Q] positions of the context rows then the block slots.
            attention_mask: additive [B or 1, 1, Q, past + C + Q] over ``[cache | context | block]`` keys, or None
                (every key visible: decoding, where the cache holds only positions before the anchor).
            cache: a transformers ``DynamicCache`` (context keys of earlier calls; extended in place by C + Q rows,
                so the caller crops the block rows off afterwards), or None.
            blocks_of: training: the Q slots are Q / ``blocks_of`` blocks that each see their own slots and the
                context keys ``attention_mask`` [B or 1, 1, Q, C] opens (the mask then covers the context only), which
                lets the attention skip the other blocks' keys.

        Returns:
            [B, Q, h] the last layer's block states (before :attr:`norm`).
        """
        q_len = block_embeds.shape[1]
        position_embeddings = self._rope(block_embeds, position_ids)
        extra = {"cache": cache} if cache is not None else {}
        if blocks_of is not None:
            extra["dflash_block_size"] = blocks_of
        x = block_embeds
        for layer in self.layers:
            residual = x
            inputs = torch.cat([context, layer.input_layernorm(x)], dim=1)  # [B, C + Q, h]
            attn, _ = layer.self_attn(hidden_states=inputs, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, dflash_queries=q_len, **extra)
            attn = attn[:, -q_len:]
            if self._sandwich:
                attn = layer.post_attention_layernorm(attn)
            x = residual + attn
            residual = x
            if self._sandwich:
                x = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = layer.mlp(layer.post_attention_layernorm(x))
            x = residual + x
        return x

    def block_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., h] block states -> [.., V_out] draft logits (over :meth:`draft_token_ids`, or the target vocab).

        The projection is called as its module where the dtypes agree, so that a decoder's linear-kernel switch
        (:mod:`specgraft.kernels.linear`) reaches it: through ``F.linear`` with the weight, a few-row vocabulary
        projection stays on the BLAS's slow few-row path, which on some CPUs costs more than the rest of the draft."""
        x = self.norm(hidden)
        projection = self._projection_module()
        if isinstance(projection, nn.Linear) and projection.weight.dtype == x.dtype:
            return projection(x)
        weight, bias = self._output_projection()
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def batch_anchors(self, batch: dict[str, Any], generator: torch.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(labels [B, T], anchors [B, A], anchor_valid [B, A])`` of a batch: drawn once, then kept in the batch
        (under :data:`ANCHORS_KEY`) so that :meth:`loss_item_counts` and :meth:`training_loss` score the same
        blocks. Without ``generator`` each row draws from its own generator seeded by the run's seed, the
        optimizer step being trained (:attr:`current_step`) and the row's tokens: a row gets the same anchors
        whatever micro-batch or process it lands in (so accumulation and processes are the same optimisation),
        new ones each step, and the same ones again after a resume."""
        kept = batch.get(ANCHORS_KEY)
        if kept is not None:
            return kept
        input_ids = batch["input_ids"]
        real = batch.get("attention_mask")
        labels = torch.ones_like(input_ids, dtype=torch.bool)
        if real is not None:
            labels = labels & real.bool()
        if batch.get("loss_mask") is not None:
            labels = labels & batch["loss_mask"].bool()
        if generator is None:
            generator = [self._row_generator(row if real is None else row[real[b].bool()])
                         for b, row in enumerate(input_ids)]
        anchors, anchor_valid = select_anchors(labels, self.config.block_size, self.config.max_anchors, generator,
                                               real)
        batch[ANCHORS_KEY] = (labels, anchors, anchor_valid)
        return labels, anchors, anchor_valid

    def _row_generator(self, tokens: torch.Tensor) -> torch.Generator:
        digest = hashlib.sha256(tokens.detach().cpu().numpy().tobytes()).hexdigest()
        return torch.Generator().manual_seed(derive_seed(torch.initial_seed(), self.current_step, int(digest[:15], 16)))

    def loss_item_counts(self, batch: dict[str, Any], target_out: TargetOutput | None = None
                         ) -> dict[str, torch.Tensor]:
        """``slots``: the scored (anchor, slot >= 1) pairs of the batch's blocks, which the loss averages over;
        ``pos{k}``: those of slot k (its logged loss and top-1)."""
        labels, anchors, anchor_valid = self.batch_anchors(batch)
        scored = block_label_mask(labels, anchors, anchor_valid, self.config.block_size)  # [B, A, bs]
        counts = {"slots": scored[:, :, 1:].sum()}
        counts.update({f"pos{k}": scored[:, :, k].sum() for k in range(1, self.config.block_size)})
        return counts

    def training_blocks(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                        generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample anchors and run every block of the batch in one forward.

        Returns ``(hidden [B, A, bs, h], anchors [B, A], anchor_valid [B, A], labels [B, T])`` where ``labels``
        marks real loss tokens.
        """
        labels, anchors, anchor_valid = self.batch_anchors(batch, generator)  # [B, T], [B, A], [B, A]
        context = self.context_features(target_out.hidden_states)  # [B, T, h]
        hidden = self.blocks_at(batch["input_ids"], context, anchors, batch.get("attention_mask"))
        return hidden, anchors, anchor_valid, labels

    def blocks_at(self, input_ids: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor,
                  real: torch.Tensor | None) -> torch.Tensor:
        """Every block ``[x_a, MASK, ..]`` at ``anchors`` [B, A] in one forward, each seeing the context features
        [B, T, h] of positions ``< a`` (``real`` [B, T]: padding keys hidden): [B, A, bs, h] block states."""
        batch_size, seq_len = input_ids.shape
        bs = self.config.block_size
        num_blocks = anchors.shape[1]
        slot_ids = torch.full((batch_size, num_blocks, bs), self.config.mask_token_id, dtype=torch.long,
                              device=input_ids.device)
        slot_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
        embeds = self.embed(slot_ids.view(batch_size, num_blocks * bs))  # [B, A*bs, h]
        positions = torch.cat([torch.arange(seq_len, device=input_ids.device).expand(batch_size, seq_len),
                               block_positions(anchors, bs)], dim=1)  # [B, T + A*bs]
        # The context part only ([B, 1, A*bs, T]): each block's own slots are implied by blocks_of (the dense
        # [A*bs, T + A*bs] mask, the other blocks' keys hidden, is built only where the attention needs it).
        visible = block_context_mask(anchors, bs, seq_len, None if real is None else real.bool())
        mask = additive_mask(visible, context.dtype)
        hidden = self.block_forward(embeds, context, positions, mask, blocks_of=bs)  # [B, A*bs, h]
        return hidden.view(batch_size, num_blocks, bs, -1)

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], target_out: TargetOutput, tokens: torch.Tensor,
                         depth: int) -> torch.Tensor:
        """The drafter's step from anchor ``i`` (the target has read ``0..i``) is the block anchored at the root,
        position ``a = i + 1``, over the context ``0..i``; its slot ``d`` is the depth-``d`` draft and ranks
        ``tokens[i + d]`` (see :meth:`DraftHead.acceptance_ranks`). The slots never read each other's drafts, so
        the ranks need no teacher forcing beyond the root. A block at every position, :data:`EVAL_BLOCK_SLOTS`
        slots per forward; depths past ``block_size - 1`` and tokens outside a reduced draft vocabulary are
        unranked."""
        input_ids = batch["input_ids"]  # [B, T]
        batch_size, seq_len = input_ids.shape
        ranks = torch.full((batch_size, seq_len, depth), UNRANKED, dtype=torch.long, device=input_ids.device)
        slots = min(int(depth), self.config.block_size - 1)
        if seq_len < 2 or slots < 1:
            return ranks
        context = self.context_features(target_out.hidden_states)  # [B, T, h]
        columns = draft_columns(self.draft_token_ids(), self.target.vocab_size)
        real = batch.get("attention_mask")
        chunk = max(1, EVAL_BLOCK_SLOTS // self.config.block_size)
        for start in range(0, seq_len - 1, chunk):
            anchor_ids = torch.arange(start, min(start + chunk, seq_len - 1), device=input_ids.device)  # i
            hidden = self.blocks_at(input_ids, context, (anchor_ids + 1).expand(batch_size, -1), real)
            for d in range(1, slots + 1):
                inside = anchor_ids[anchor_ids + d < seq_len]  # the depth-d token is in the row
                if inside.numel() == 0:
                    break
                logits = self.block_logits(hidden[:, : inside.numel(), d]).float()  # [B, n, V_out]
                ranks[:, inside, d - 1] = token_ranks(logits, tokens[:, inside + d], columns)
        return ranks

    def training_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """:func:`~specgraft.heads.dflash.losses.dflash_loss` against the target's distributions, computed slot by
        slot on the scored rows only with the chunked :func:`~specgraft.heads.losses.linear_cross_entropy` (no
        [rows, vocab] tensor is materialised).

        The sum is divided by ``num_items["slots"]`` when given (the whole optimiser step's scored slots, counted by
        :meth:`loss_item_counts` on the same anchors), else by this batch's own count."""
        target_logits = target_out.logits
        if target_logits is None:
            last = target_out.hidden_states.get(self.target.num_layers)
            if last is None:
                raise SpecgraftError("DFlash training needs the target's logits (soft targets); run the target with "
                                     "logits=True (DFlashHead.needs_target_logits) or cache its last layer")
            target_logits = self.target.logits_from_hidden(last)
        hidden, anchors, anchor_valid, labels = self.training_blocks(batch, target_out)
        batch_size, seq_len = labels.shape
        bs = self.config.block_size
        slot_mask = block_label_mask(labels, anchors, anchor_valid, bs)  # [B, A, bs]
        weights = dflash_position_weights(bs, self.config.decay_gamma).tolist()
        weight, bias = self._output_projection()
        columns = self.draft_token_ids()
        with torch.no_grad():
            flat_target = target_logits.detach().reshape(batch_size * seq_len, -1)  # [B*T, V]
            # Slot k of anchor a is trained towards the target's prediction at a + k - 1 (row b*T + a + k - 1).
            base_rows = torch.arange(batch_size, device=labels.device)[:, None] * seq_len + anchors - 1  # [B, A]
        total = (self.fc.weight * 0).sum()  # keeps the graph when no slot is scored
        count = 0
        metrics: dict[str, torch.Tensor] = {}
        for k in range(1, bs):
            scored = slot_mask[:, :, k]  # [B, A]
            rows = self.norm(hidden[:, :, k][scored])  # [N, h]
            n = rows.shape[0]
            if n == 0:
                continue
            ce_sum, rank = linear_cross_entropy(
                rows, weight, bias, target_logits=flat_target, target_rows=(base_rows + k)[scored],
                target_columns=None if columns is None else columns.to(flat_target.device),
                with_rank=self.metrics_enabled)
            total = total + weights[k] * ce_sum
            count += n
            per_slot = n if num_items is None else num_items[f"pos{k}"]
            metrics[f"loss/pos{k}"] = divide_by_count(ce_sum.detach(), per_slot)
            if rank is not None:
                metrics[f"top1/pos{k}"] = divide_by_count((rank == 0).sum().float(), per_slot)
        loss = divide_by_count(total, count if num_items is None else num_items["slots"])
        metrics["anchors"] = anchor_valid.sum().float()  # a count: the trainer sums the micro-batches' shares
        return HeadLoss(loss=loss, metrics=metrics)
