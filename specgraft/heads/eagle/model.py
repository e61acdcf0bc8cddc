"""EAGLE-1/2 head (Li et al. 2024): autoregression at the feature level.

Draft input at position ``i``: ``fc(concat(embedding(x_{i+1}), f_i))`` where ``f_i`` is the target's last hidden
state at position i; then ``num_layers`` decoder layers of the TARGET's own family (transformers' classes, built
from a copy of the target's config; the first layer without its input norm, as in the reference). The output
``f^_{i+1}`` predicts the next feature, and the target's frozen lm_head maps it to the distribution of token
``x_{i+2}``. The embeddings and the lm_head are borrowed from the target (never parameters, never saved).

Which feature: ``f`` is ``output_hidden_states`` index N -- the last layer's output AFTER the target's final norm,
i.e. exactly what the target's lm_head reads. That is what the EAGLE reference trains on (the base model's output
``hidden_states``) and what vLLM/SGLang feed an EAGLE-1 draft; the draft's output is projected by the lm_head
directly, with no norm in between (the reference applies ``head(out_hidden)``). So the target's final norm is not
used by this head, and its logits at position i are ``lm_head(f_i)``: training needs no separate target logits
(they are recomputed from the features when an offline cache holds only features).

Parameter names map 1:1 onto the serving layout: ``fc.weight`` [h, 2h] (+ ``fc.bias``),
``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
``layers.{l}.post_attention_layernorm.weight`` (+ ``layers.{l}.input_layernorm.weight`` for l >= 1, and the
family's extra norms/biases, e.g. Gemma's feed-forward norms or Qwen2's q/k/v biases). Phi-3 keeps its fused
``qkv_proj``/``gate_up_proj`` (supported; an exporter splits them).

Loss (:func:`eagle1_loss`): ``feature_loss_weight * SmoothL1(f^_{i+1}, f_{i+1}) + logit_loss_weight *
softCE(lm_head(f^_{i+1}), softmax(target logits at i+1))`` over positions whose predicted token ``x_{i+2}`` is a
loss (assistant) token; uniform noise U(-a, a) is added to the input features during training.

HASS (Zhang et al. 2024, training only; the head and its export are unchanged): ``ttt_steps`` > 1 unrolls the
draft on its own output features with EAGLE-3's training-time-test attention (harmonized context alignment,
:meth:`EagleHead.align_outputs`), and ``hass_topk`` > 0 adds a top-K distillation term (harmonized objective
distillation) to every pass's loss.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specgraft.heads.eagle.config import EagleConfig
from specgraft.heads.head import DraftHead, HeadLoss, depth_ranks
from specgraft.heads.layers import (
    EAGLE_ATTENTION,
    RotaryPositions,
    TTTKeys,
    build_decoder_layer,
    causal_additive_mask,
    draft_layer_config,
    register_eagle_attention,
)
from specgraft.heads.losses import (
    divide_by_count,
    linear_cross_entropy,
    masked_mean,
    soft_cross_entropy,
    topk_distillation,
)
from specgraft.target import Target, TargetOutput

logger = logging.getLogger(__name__)




class EagleHeadBase(DraftHead):
    """What the EAGLE-1 and EAGLE-3 heads share: borrowed embeddings and RoPE, and the drafting interface
    (:meth:`input_features`, :meth:`draft_forward`, :meth:`draft_token_ids`) that :mod:`eagle_drafter` uses."""

    needs_target_logits = True

    def __init__(self, config: Any, target: Target) -> None:
        super().__init__(config, target)
        # Borrowed from the target, never registered: a plain object holding the (buffer-only) rotary module.
        self._rope = RotaryPositions(target)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the head's weights (its ``fc``'s; an attribute read, where ``next(self.parameters())``
        walks the module tree, several times a draft step)."""
        return self.fc.weight.dtype

    @property
    def param_device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, h] the target's (frozen) input embeddings, in the head's dtype."""
        return self.target.embed(input_ids).to(self.param_dtype)

    def input_features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The draft's per-position input feature [.., h] from the target's hidden states (required_layers)."""
        raise NotImplementedError

    def draft_forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over Q new positions.

        Args:
            input_ids: [B, Q] the token following each input feature (x_{i+1} for feature i).
            hidden: [B, Q, h] input features (:meth:`input_features`, or the draft's own previous output).
            position_ids: [B or 1, Q] positions (i for the pair (f_i, x_{i+1})).
            attention_mask: additive [B or 1, 1, Q, past + Q] mask (0 = visible).
            cache: a transformers ``DynamicCache`` for the draft's layers (extended in place), or None.

        Returns:
            ``(out [B, Q, h], logits [B, Q, V_out])``: the draft's output feature (fed back as the next input
            feature) and its logits over :meth:`draft_token_ids` (the target vocab for EAGLE-1).
        """
        raise NotImplementedError

    def draft_token_ids(self) -> torch.Tensor | None:
        """[V_out] target id of every column of the draft logits, or None when they are the target vocab."""
        return None

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Same as :meth:`draft_forward`."""
        return self.draft_forward(input_ids, hidden, position_ids, attention_mask, cache)

    @staticmethod
    def _masks(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] bool real tokens, and real loss tokens."""
        input_ids = batch["input_ids"]  # [B, T]
        real = batch.get("attention_mask")
        real = torch.ones_like(input_ids, dtype=torch.bool) if real is None else real.bool()
        loss = batch.get("loss_mask")
        return real, (real if loss is None else real & loss.bool())


class EagleHead(EagleHeadBase):
    """EAGLE-1/2 draft head (see the module docstring)."""

    head_type = "eagle"
    Config = EagleConfig

    def __init__(self, config: EagleConfig, target: Target) -> None:
        config.validate()
        super().__init__(config, target)
        h = target.hidden_size
        # The draft's attention goes through specgraft's function (explicit masks on every backend, soft-capping
        # kept): the target's own backend may be one that ignores 4D tree masks (flash attention).
        register_eagle_attention()
        self.draft_config = draft_layer_config(target, config.num_layers, attn_implementation=EAGLE_ATTENTION)
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList(build_decoder_layer(target, self.draft_config, i)
                                    for i in range(config.num_layers))
        # The reference drops the first layer's input norm: fc's output goes straight into attention.
        self.layers[0].input_layernorm = nn.Identity()
        self.to(device=target.device)

    def compiled_modules(self) -> list[nn.Module]:
        """The draft decoder layers (``training.compile``)."""
        return list(self.layers)

    def required_layers(self) -> tuple[int, ...]:
        """The post-norm last hidden state (index N), which the target's lm_head reads."""
        return (self.target.num_layers,)

    def input_features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden_states[self.target.num_layers].to(self.param_dtype)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[.., h] draft features -> [.., V] logits through the target's frozen lm_head (and logit soft-cap)."""
        return self.target.logits_from_hidden(features).to(features.dtype)

    def _plain_lm_head(self) -> nn.Linear | None:
        """The target's lm_head when :meth:`logits` is a plain linear map of the features (chunked logit term)."""
        return self.target.plain_output_head()

    def draft_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.features_forward(input_ids, hidden, position_ids, attention_mask, cache)
        return x, self.logits(x)

    def features_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None, cache: Any = None,
                         eagle_ttt: TTTKeys | None = None) -> torch.Tensor:
        """:meth:`draft_forward` without the lm_head: [B, Q] ids, [B, Q, h] features -> [B, Q, h] (``eagle_ttt``:
        the training-time-test key state of :meth:`align_outputs`)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden.to(self.param_dtype)], dim=-1))  # [B, Q, h]
        position_embeddings = self._rope(x, position_ids)
        extra = {} if eagle_ttt is None else {"eagle_ttt": eagle_ttt}
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids,
                      position_embeddings=position_embeddings, cache=cache, use_cache=cache is not None, **extra)
        return x

    def loss_item_counts(self, batch: dict[str, torch.Tensor],
                         target_out: TargetOutput | None = None) -> dict[str, torch.Tensor]:
        """``step{s}``: the pairs pass s scores (predicted token ``x_{i+s+2}`` a real loss token), which all of
        that pass's loss terms average over."""
        _, labels = self._masks(batch)
        return {f"step{s}": labels[:, s + 2 :].sum() for s in range(self.config.ttt_steps)}

    def align_outputs(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      steps: int | None = None) -> list[torch.Tensor]:
        """The draft's output features [B, T-1, h] of each of the S alignment passes (HASS's harmonized context
        alignment; S = ``ttt_steps``), over the T-1 pairs ``(f_i, x_{i+1})``.

        Pass 0 at index i: the target feature ``f_i`` (+ the training noise) and token ``x_{i+1}`` at position i,
        causal attention over the pairs 0..i: its output predicts ``f_{i+1}``. Pass s >= 1 at index i: the draft's
        own pass-(s-1) output at i, token ``x_{i+s+1}`` (id 0 past the end, never scored), position ``i + s``,
        attending to the pass-0 keys ``0..i`` plus its own keys of passes 1..s at i (EAGLE-3's training-time test,
        :class:`~specgraft.heads.layers.TTTKeys`): what the drafter's KV cache holds when it drafts s tokens after
        pair i. Its output predicts ``f_{i+s+1}`` (and, through the lm_head, token ``x_{i+s+2}``).
        """
        steps = self.config.ttt_steps if steps is None else int(steps)
        input_ids = batch["input_ids"]  # [B, T]
        real, _ = self._masks(batch)
        length = input_ids.shape[1] - 1
        hidden = self.input_features(target_out.hidden_states)[:, :-1]  # [B, L, h] f_i
        if self.training and self.config.feature_noise > 0:
            a = self.config.feature_noise
            hidden = hidden + (torch.rand_like(hidden) * 2.0 - 1.0) * a
        # Padding keys always masked (all ones gives the plain causal mask): testing for padding is a host sync.
        key_valid = real[:, 1:]  # pair i holds token i+1
        mask = causal_additive_mask(length, key_valid, hidden.dtype, hidden.device)  # [B or 1, 1, L, L]
        positions = torch.arange(length, device=hidden.device)[None]  # [1, L]
        next_ids = input_ids[:, 1:]  # [B, L] x_{i+1}
        state = TTTKeys()  # one pass too: it marks the mask as the causal training mask
        outputs = []
        for s in range(steps):
            step_ids = F.pad(next_ids[:, s:], (0, min(s, length)))  # [B, L] x_{i+s+1}
            hidden = self.features_forward(step_ids, hidden, positions + s, mask, eagle_ttt=state)
            outputs.append(hidden)
        return outputs

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], target_out: TargetOutput, tokens: torch.Tensor,
                         depth: int) -> torch.Tensor:
        """Alignment pass ``d - 1`` of :meth:`align_outputs` at anchor ``i`` is the depth-``d`` draft: pass 0
        reads the target's feature ``f_i`` and the root ``x_{i+1}``, pass ``s`` its own pass-``(s-1)`` output and
        ``x_{i+s+1}`` (the accepted drafts), with the drafter's KV cache; its lm_head logits rank ``tokens[i + d]``
        (see :meth:`DraftHead.acceptance_ranks`). No feature noise: the head is in eval mode here."""
        logits = (self.logits(out) for out in self.align_outputs(batch, target_out, steps=depth))
        return depth_ranks(logits, tokens, depth)

    def training_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """EAGLE-1 loss over one batch: ``sum_s loss_decay**s * eagle1_loss(pass s)`` over the passes of
        :meth:`align_outputs` (one pass unless ``ttt_steps`` > 1); pass s's terms are divided by
        ``num_items["step{s}"]`` when given (see :meth:`DraftHead.training_loss`).

        Index i of pass s is scored when its predicted token ``x_{i+s+2}`` is a real loss token, against the
        target's feature ``f_{i+s+1}`` and logits at i+s+1. Only the scored rows are projected onto the
        vocabulary. Metrics: pass 0's ``loss/feature``, ``loss/logit`` (``loss/topk``) and ``top1/step0``; pass
        s >= 1's with a ``/step{s}`` suffix and ``top1/step{s}``.
        """
        seq_len = batch["input_ids"].shape[1]
        _, labels = self._masks(batch)
        feats = self.input_features(target_out.hidden_states)  # [B, T, h]
        if seq_len < 3:
            zero = sum(p.sum() for p in self.parameters()) * 0.0
            return HeadLoss(loss=zero, metrics={})
        total = None
        metrics: dict[str, torch.Tensor] = {}
        # the chunked logit term needs the target's plain lm_head and no HASS top-K term
        lm_head = self._plain_lm_head() if not self.config.hass_topk else None
        for s, pred in enumerate(self.align_outputs(batch, target_out)):
            # Index i (i < T-s-2) predicts f_{i+s+1}, scored when its token x_{i+s+2} is a real loss token.
            length = max(seq_len - s - 2, 0)
            scored = labels[:, s + 2 :]  # [B, L_s]
            rows = pred[:, :length][scored]  # [N, h]
            if target_out.logits is not None:
                target_rows = target_out.logits[:, s + 1 : s + 1 + length][scored]  # [N, V] target logits at i+s+1
            else:
                # Offline caches hold only the post-norm features; the target's logits are lm_head(f).
                last = target_out.hidden_states[self.target.num_layers]
                target_rows = self.target.logits_from_hidden(last[:, s + 1 : s + 1 + length][scored])
            next_rows = feats[:, s + 1 : s + 1 + length][scored]  # [N, h] the target's f_{i+s+1}
            step_items = None if num_items is None else num_items[f"step{s}"]
            if lm_head is not None:  # chunked over the rows: no [N, V] draft logits kept for the backward
                loss, step_metrics = eagle1_linear_loss(
                    rows, lm_head.weight, lm_head.bias, next_rows, target_rows,
                    feature_weight=self.config.feature_loss_weight, logit_weight=self.config.logit_loss_weight,
                    num_items=step_items, with_top1=self.metrics_enabled)
            else:
                loss, step_metrics = eagle1_loss(
                    rows,
                    self.logits(rows),
                    next_rows,
                    target_rows,
                    torch.ones(rows.shape[0], device=rows.device),
                    feature_weight=self.config.feature_loss_weight,
                    logit_weight=self.config.logit_loss_weight,
                    num_items=step_items,
                    topk=self.config.hass_topk,
                    topk_weight=self.config.hass_topk_weight,
                    with_top1=self.metrics_enabled,
                )
            term = (self.config.loss_decay ** s) * loss
            total = term if total is None else total + term
            for key, value in step_metrics.items():
                if s == 0:
                    metrics[key] = value
                else:
                    metrics[f"top1/step{s}" if key == "top1/step0" else f"{key}/step{s}"] = value
        assert total is not None  # ttt_steps >= 1 (validated)
        return HeadLoss(loss=total, metrics=metrics)


def eagle1_loss(
    pred_features: torch.Tensor,
    draft_logits: torch.Tensor,
    next_features: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    feature_weight: float = 1.0,
    logit_weight: float = 0.1,
    num_items: torch.Tensor | None = None,
    topk: int = 0,
    topk_weight: float = 1.0,
    with_top1: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The EAGLE-1 loss on aligned rows (any leading shape ``S``).

    Args:
        pred_features: S x [h] the draft's predicted feature f^_{i+1}.
        draft_logits: S x [V] the target lm_head applied to ``pred_features``.
        next_features: S x [h] the true next feature f_{i+1}.
        target_logits: S x [V] the target's logits at position i+1 (the distribution of x_{i+2}).
        mask: S, 1 where the row counts.
        feature_weight, logit_weight: loss weights.
        num_items: what the sums over rows are divided by instead of ``mask.sum()`` (the whole batch's count when
            this is one micro-batch of it), for the losses and the metric alike.
        topk, topk_weight: HASS's harmonized objective distillation, off when ``topk`` is 0 (see Returns).
        with_top1: compute the ``top1/step0`` metric (an argmax over the vocabulary; the trainer asks for it on
            logged steps only).

    Returns:
        ``feature_weight * mean_rows(mean_h SmoothL1(pred, next)) + logit_weight * mean_rows(-sum_v p log q)
        [+ topk_weight * mean_rows(-sum_{v in topK(p)} p_v log q_v)]``, with p = softmax(target_logits), q =
        softmax(draft_logits) (:func:`~specgraft.heads.losses.topk_distillation`); metrics ``loss/feature``,
        ``loss/logit``, ``top1/step0`` (the draft's argmax equals the target's) and, with topk, ``loss/topk``.
    """
    mask = mask.to(torch.float32)
    feat = F.smooth_l1_loss(pred_features.float(), next_features.float(), reduction="none").mean(-1)  # S
    feature_loss = masked_mean(feat, mask, num_items)
    target_probs = torch.softmax(target_logits.float(), dim=-1)
    logit_loss = soft_cross_entropy(draft_logits, target_probs, mask, num_items)
    loss = feature_weight * feature_loss + logit_weight * logit_loss
    topk_loss = None
    if topk:
        topk_loss = topk_distillation(draft_logits, target_probs, mask, topk, num_items)
        loss = loss + topk_weight * topk_loss
    metrics = {"loss/feature": feature_loss.detach(), "loss/logit": logit_loss.detach()}
    if with_top1:
        with torch.no_grad():
            # The draft's logit at the target's top-1 is its maximum (cheaper than a second argmax).
            best = target_logits.argmax(-1, keepdim=True)
            hit = draft_logits.gather(-1, best) >= draft_logits.amax(-1, keepdim=True)
            metrics["top1/step0"] = masked_mean(hit.squeeze(-1).float(), mask, num_items)
    if topk_loss is not None:
        metrics["loss/topk"] = topk_loss.detach()
    return loss, metrics


def eagle1_linear_loss(
    pred_features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    next_features: torch.Tensor,
    target_logits: torch.Tensor,
    feature_weight: float = 1.0,
    logit_weight: float = 0.1,
    num_items: torch.Tensor | None = None,
    with_top1: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`eagle1_loss` on N rows that all count (no HASS top-K term), with the draft logits
    ``pred_features @ weight.T + bias`` (the target's plain lm_head) and their soft cross-entropy computed chunk by
    chunk (:func:`~specgraft.heads.losses.linear_cross_entropy`): nothing [N, V] is kept for the backward.

    Args:
        pred_features: [N, h]; weight: [V, h]; bias: [V] or None; next_features: [N, h]; target_logits: [N, V].
        Others as in :func:`eagle1_loss`.

    Returns:
        The same loss and metrics as ``eagle1_loss(pred, pred @ weight.T + bias, next, target_logits, ones(N), ...)``.
    """
    count = pred_features.shape[0] if num_items is None else num_items
    feat = F.smooth_l1_loss(pred_features.float(), next_features.float(), reduction="none").mean(-1)  # [N]
    feature_loss = divide_by_count(feat.sum(), count)
    ce_sum, rank = linear_cross_entropy(pred_features.to(weight.dtype), weight, bias, target_logits=target_logits,
                                        with_rank=with_top1)
    logit_loss = divide_by_count(ce_sum, count)
    loss = feature_weight * feature_loss + logit_weight * logit_loss
    metrics = {"loss/feature": feature_loss.detach(), "loss/logit": logit_loss.detach()}
    if rank is not None:  # rank 0: no draft logit above the one at the target's top-1
        metrics["top1/step0"] = divide_by_count((rank == 0).sum().float(), count).detach()
    return loss, metrics
