"""EAGLE-3 head (Li et al. 2025): fused target layers, a 2h-input midlayer, a reduced draft vocabulary, and
training-time test (TTT).

Input at position ``i``: ``g_i = fc(concat(H_a[i], H_b[i], H_c[i]))`` (target ``output_hidden_states`` indices
``feature_layers``, default ``(2, N//2, N-3)``: the pre-norm residual stream) and the embedding of ``x_{i+1}``. The
midlayer attends over ``concat(input_layernorm(embedding), hidden_norm(g))`` (q/k/v take 2h) with the residual on
``g``, then the family's MLP; ``norm`` + the head's OWN ``lm_head`` give logits over the draft vocabulary (``d2t``:
target_id = draft_id + d2t[draft_id]; ``t2d``: target ids in the draft vocab; see :mod:`draft_vocab`). The output
feature is fed back as the next step's hidden input (fc is applied only to the fused target features).

Serving layout: ``fc.weight`` [h, 3h], ``midlayer.self_attn.{q,k,v}_proj.weight`` [., 2h], ``o_proj`` [h, .],
``midlayer.mlp.*``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``, ``norm.weight``,
``lm_head.weight`` [Vd, h], buffers ``d2t`` [Vd] int64 and ``t2d`` [V] bool. Extra draft layers
(``num_layers > 1``) are plain family decoder layers ``layers.{l}.*`` after the midlayer.

Training-time test with S steps (:meth:`Eagle3Head.ttt_logits`): step 0 runs the draft on every position i with the
target feature ``g_i`` and token ``x_{i+1}`` at position i; step s >= 1 runs it again on every position at once,
now with its own step-(s-1) output at i and the token ``x_{i+s+1}``, at position ``i+s``, attending to the step-0
keys ``0..i`` and its own keys of steps 1..s at i -- exactly the draft's KV cache when it decodes s tokens ahead of
position i. Its logits predict ``x_{i+s+2}``. Loss: :func:`eagle3_ttt_loss`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specgraft.errors import SpecgraftError
from specgraft.heads.draft_vocab import (
    assign_draft_vocab,
    check_counts,
    check_draft_vocab_size,
    coverage_facts,
    draft_to_target_ids,
)
from specgraft.heads.eagle.model import EagleHeadBase
from specgraft.heads.eagle3.config import Eagle3Config
from specgraft.heads.head import HeadLoss, depth_ranks, draft_columns, trainable_parameters
from specgraft.heads.layers import (
    EAGLE_ATTENTION,
    Eagle3MidLayer,
    InputScaledLinear,
    TTTKeys,
    build_decoder_layer,
    causal_additive_mask,
    draft_layer_config,
    power_of_two_scale,
    register_eagle_attention,
)
from specgraft.heads.losses import (
    decayed_sum,
    item_mean,
    linear_cross_entropy,
    linear_topk_distillation,
    masked_mean,
    topk_distillation,
)
from specgraft.target import Target, TargetOutput

logger = logging.getLogger(__name__)




class Eagle3Head(EagleHeadBase):
    """EAGLE-3 draft head (see the module docstring)."""

    head_type = "eagle3"
    Config = Eagle3Config

    def __init__(self, config: Eagle3Config, target: Target) -> None:
        config.validate()
        target.check_layer_indices(config.feature_layers, what="eagle3 feature_layers index")
        check_draft_vocab_size(config.draft_vocab_size, target.vocab_size)
        super().__init__(config, target)
        register_eagle_attention()
        h = target.hidden_size
        self.draft_config = draft_layer_config(target, config.num_layers, attn_implementation=EAGLE_ATTENTION)
        # head.feature_scaling: the fused features scaled while training, folded into the saved weight
        self.fc = InputScaledLinear(len(config.feature_layers) * h, h, bias=config.fc_bias)
        self.midlayer = Eagle3MidLayer(build_decoder_layer(target, self.draft_config, 0), h)
        self.layers = nn.ModuleList(build_decoder_layer(target, self.draft_config, i)
                                    for i in range(1, config.num_layers))
        # A fresh copy of the family's norm class (the midlayer's input norm, still untrained) for the final norm.
        self.norm = copy.deepcopy(self.midlayer.input_layernorm)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        vd, v = config.draft_vocab_size, target.vocab_size
        # Until prepare_from_data: the first Vd target ids (d2t zeros; for Vd == V that is the identity, for good).
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[:vd] = True
        self.register_buffer("t2d", t2d)
        if float(config.lm_head_lr_scale) == 0.0:  # frozen at the target's rows: no gradient to compute
            self.lm_head.requires_grad_(False)
        self.to(device=target.device)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def build(cls, target: Target, config: Eagle3Config) -> Eagle3Head:
        """A fresh head whose final norm and lm_head rows start from the target's (a warm start for the draft's
        output space); fc and the draft layers too with ``layer_init: target``, else they are randomly
        initialised."""
        head = cls(config, target)
        head._init_from_target()
        if config.layer_init == "target":
            head._init_layers_from_target()
        return head

    @torch.no_grad()
    def _init_layers_from_target(self) -> None:
        """``head.layer_init: target``: fc passes the deepest fused layer through, the draft layers are copies of
        the target's layers from the one that reads it (see :class:`Eagle3Config`)."""
        fused = [int(i) for i in self.config.feature_layers]
        deepest = max(fused)
        h = self.target.hidden_size
        weight = self.fc.weight  # [h, k*h]; the input scale (feature_scaling) is set later, keeping this function
        weight.zero_()
        column = fused.index(deepest) * h
        weight[:, column:column + h] = torch.eye(h, dtype=weight.dtype, device=weight.device)
        if self.fc.bias is not None:
            self.fc.bias.zero_()
        # output_hidden_states index i is decoder layer i's input; N, the target's (normed) output, has no reader.
        last = self.target.num_layers - 1
        sources = [min(deepest + i, last) for i in range(self.config.num_layers)]
        layers = self.target.decoder_layers
        self.midlayer.copy_decoder_layer(layers[sources[0]])
        for layer, source in zip(self.layers, sources[1:], strict=True):
            layer.load_state_dict(layers[source].state_dict())
        logger.info("EAGLE-3 layer_init=target: fc passes target layer %d through; the draft layers start as the "
                    "target's decoder layers %s", deepest, sources)

    @torch.no_grad()
    def _init_from_target(self) -> None:
        final_norm = self.target.final_norm
        if type(final_norm) is type(self.norm) and final_norm.state_dict().keys() == self.norm.state_dict().keys():
            self.norm.load_state_dict({k: v.detach().clone() for k, v in final_norm.state_dict().items()})
        weight = getattr(self.target.output_head, "weight", None)
        expected = (self.target.vocab_size, self.target.hidden_size)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == expected:
            rows = weight.index_select(0, self.draft_token_ids().to(weight.device))
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def prepare_from_data(self, token_counts: torch.Tensor | None, heldout_counts: torch.Tensor | None = None,
                          *, keep_vocabulary: bool = False) -> dict[str, Any]:
        """Choose the draft vocabulary from the counts [V] of the training data's loss tokens (sets ``d2t``/``t2d``
        and re-initialises the lm_head rows from the target's). Call it before training (it resets the lm_head).
        ``keep_vocabulary`` (a warm-started head): keep the vocabulary and report its coverage only.

        Returns ``draft_vocab_train_coverage``, the fraction of the counted tokens inside the draft vocabulary, and,
        given ``heldout_counts`` [V] of rows left out of ``token_counts``, ``draft_vocab_coverage`` measured on
        those (what a draft meets on text it was not counted from) with ``draft_vocab_heldout_tokens``."""
        vd, v = self.config.draft_vocab_size, self.target.vocab_size
        if token_counts is None:
            if not keep_vocabulary:
                logger.warning("no token counts given: the EAGLE-3 draft vocabulary stays the first %d target ids", vd)
            return {}
        check_counts(v, token_counts, heldout_counts)
        if not keep_vocabulary:
            assign_draft_vocab(self.d2t, self.t2d, token_counts)
            self._init_from_target()
        facts: dict[str, Any] = coverage_facts(self.t2d, token_counts, heldout_counts)
        counted = "it was counted from" if not keep_vocabulary else "(the warm-started head's vocabulary, kept)"
        if "draft_vocab_coverage" in facts:
            logger.info("EAGLE-3 draft vocabulary: %d of %d tokens, covering %.2f%% of %d held-out loss tokens "
                        "(%.2f%% of the training loss tokens %s)", vd, v, 100.0 * facts["draft_vocab_coverage"],
                        facts["draft_vocab_heldout_tokens"], 100.0 * facts["draft_vocab_train_coverage"], counted)
        else:
            logger.info("EAGLE-3 draft vocabulary: %d of %d tokens, covering %.2f%% of the training loss tokens %s "
                        "(no held-out rows: expect less on other text)", vd, v,
                        100.0 * facts["draft_vocab_train_coverage"], counted)
        return facts

    def wants_target_sample(self) -> bool:
        """``head.feature_scaling`` sizes fc's input scale from the target's hidden states."""
        return self.config.feature_scaling != "none"

    @torch.no_grad()
    def prepare_from_target(self, hidden_states: dict[int, torch.Tensor], mask: torch.Tensor, *,
                            warm_started: bool = False) -> dict[str, Any]:
        """Set fc's input scale (``head.feature_scaling``) from the target's hidden states [B, T, h] on a few
        training rows (``mask`` [B, T]: real tokens). A warm-started fc, or one started from the target
        (``layer_init: target``), keeps computing the same function; a fresh random one's initialisation applies to
        the scaled features. Returns the log2 scales per fused layer."""
        mode = self.config.feature_scaling
        if mode == "none":
            return {}
        real = mask.bool()
        scales, exponents = [], {}
        for layer in self.config.feature_layers:
            tokens = hidden_states[int(layer)][real].float()  # [N, h]
            if mode == "layer":
                typical = tokens.pow(2).mean(-1).sqrt().median().expand(tokens.shape[-1])
            else:  # dim
                typical = tokens.pow(2).median(0).values.sqrt()
            scale = power_of_two_scale(typical)
            scales.append(scale)
            log2 = torch.log2(scale).to(torch.int64)
            exponents[str(int(layer))] = (int(log2[0]) if mode == "layer"
                                          else [int(log2.min()), int(log2.max())])
        keep = warm_started or self.config.layer_init == "target"
        self.fc.set_input_scale(torch.cat(scales), keep_function=keep)
        logger.info("EAGLE-3 feature_scaling=%s: log2 of the fc input scale per fused layer %s (from %d tokens)",
                    mode, exponents, int(real.sum()))
        return {"feature_scale_log2": exponents}

    def optimizer_groups(self, learning_rate: float) -> list[dict[str, Any]]:
        """One group at ``learning_rate``, or with ``lm_head_lr_scale`` != 1 the lm_head in a second group at that
        multiple of it (none when 0: the lm_head is then frozen)."""
        scale = float(self.config.lm_head_lr_scale)
        if scale == 1.0:
            return super().optimizer_groups(learning_rate)
        output = {id(p) for p in self.lm_head.parameters()}
        groups = [{"params": [p for p in trainable_parameters(self) if id(p) not in output], "lr": learning_rate}]
        if scale > 0.0:
            groups.append({"params": list(self.lm_head.parameters()), "lr": learning_rate * scale})
        return groups

    def compiled_modules(self) -> list[nn.Module]:
        """The midlayer and any further draft layers (``training.compile``)."""
        return [self.midlayer, *self.layers]

    def required_layers(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(int(i) for i in self.config.feature_layers))

    # -- forward ---------------------------------------------------------------------------------------------
    def draft_token_ids(self) -> torch.Tensor:
        """[Vd] target id of every draft id."""
        return draft_to_target_ids(self.d2t)

    def input_features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """fc over the fused target layers: [.., k*h] -> [.., h]."""
        fused = torch.cat([hidden_states[int(i)] for i in self.config.feature_layers], dim=-1)
        return self.fc(fused.to(self.param_dtype))

    def _layers_forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        position_embeddings = self._rope(hidden, position_ids)
        x = self.midlayer(embeds, hidden, position_embeddings, attention_mask, position_ids=position_ids, **kwargs)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids,
                      position_embeddings=position_embeddings, **kwargs)
        return x

    def draft_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {"cache": cache, "use_cache": True} if cache is not None else {}
        x = self._layers_forward(self.embed(input_ids), hidden.to(self.param_dtype), position_ids, attention_mask,
                                 **kwargs)
        return x, self.lm_head(self.norm(x))

    def ttt_outputs(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                    steps: int | None = None) -> list[torch.Tensor]:
        """The draft's output features [B, T, h] of each of the S training-time-test steps.

        Step s at index i: input token ``x_{i+s+1}`` (zero embedding past the end), hidden = fc(target features)
        at s = 0 else the step-(s-1) output at i, position ``i + s``; attention over step-0 keys ``0..i``
        (causal, padding keys masked) plus this index's keys of steps 1..s (see
        :func:`~specgraft.heads.layers.eagle_attention_forward`). Its logits predict ``x_{i+s+2}``.
        """
        return self._unroll(batch, target_out, steps)[1]

    def _unroll(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                steps: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(fc's output on the fused target features [B, T, h], the S step outputs of :meth:`ttt_outputs`)."""
        steps = self.config.ttt_steps if steps is None else int(steps)
        input_ids = batch["input_ids"]  # [B, T]
        seq_len = input_ids.shape[1]
        fused = hidden = self.input_features(target_out.hidden_states)  # [B, T, h]
        embeds = self.embed(input_ids)  # [B, T, h]
        real = batch.get("attention_mask")
        # Padding keys masked whenever there is an attention mask (all ones gives the plain causal mask): testing
        # whether there is padding would read the mask on the host every micro-step.
        key_valid = None if real is None else F.pad(real.bool()[:, 1:], (0, 1), value=False)  # pair i: token i+1
        mask = causal_additive_mask(seq_len, key_valid, hidden.dtype, hidden.device)  # [B or 1, 1, T, T]
        base_positions = torch.arange(seq_len, device=hidden.device)[None]  # [1, T]
        state = TTTKeys()
        outputs = []
        for s in range(steps):
            step_embeds = F.pad(embeds[:, s + 1 :], (0, 0, 0, min(s + 1, seq_len)))  # [B, T, h]: x_{i+s+1}
            hidden = self._layers_forward(step_embeds, hidden, base_positions + s, mask, eagle_ttt=state)
            outputs.append(hidden)
        return fused, outputs

    def ttt_logits(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                   steps: int | None = None) -> list[torch.Tensor]:
        """Draft-vocab logits [B, T, Vd] of each TTT step (see :meth:`ttt_outputs`)."""
        return [self.lm_head(self.norm(out)) for out in self.ttt_outputs(batch, target_out, steps)]

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], target_out: TargetOutput, tokens: torch.Tensor,
                         depth: int) -> torch.Tensor:
        """TTT step ``d - 1`` at anchor ``i`` is the depth-``d`` draft (its input tokens ``x_{i+1..i+d}``, the
        root and the accepted drafts); tokens outside the draft vocabulary are unranked (see
        :meth:`DraftHead.acceptance_ranks`)."""
        columns = None
        if self.config.draft_vocab_size != self.target.vocab_size:
            columns = draft_columns(self.draft_token_ids().to(tokens.device), self.target.vocab_size)
        logits = (self.lm_head(self.norm(out)) for out in self.ttt_outputs(batch, target_out, steps=depth))
        return depth_ranks(logits, tokens, depth, columns)

    def _soft_targets(self, target_out: TargetOutput) -> torch.Tensor:
        """[B, T, V] the target's logits (recomputed from its post-norm last layer when only features are cached)."""
        if target_out.logits is not None:
            return target_out.logits
        last = target_out.hidden_states.get(self.target.num_layers)
        if last is None:
            raise SpecgraftError("EAGLE-3 training needs the target's logits (soft targets); run the target with "
                                 "logits=True (Eagle3Head.needs_target_logits) or cache its last layer")
        return self.target.logits_from_hidden(last)  # the post-norm last layer feeds the lm_head

    def _in_draft_vocab(self, target_logits: torch.Tensor) -> torch.Tensor | None:
        """[B, T] bool whether the target's top-1 is inside the draft vocab (None: the draft vocab is the target's,
        d2t = 0)."""
        if self.config.draft_vocab_size == self.target.vocab_size:
            return None
        return self.t2d[target_logits.argmax(-1)]

    def _scored(self, labels: torch.Tensor, in_vocab: torch.Tensor | None, s: int) -> torch.Tensor:
        """[B, max(T - s - 2, 0)] bool: index i of TTT step s is scored (token i+s+2 a loss token, the target's
        top-1 at i+s+1 in the draft vocab)."""
        length = max(labels.shape[1] - s - 2, 0)
        scored = labels[:, s + 2 :]  # [B, L]
        return scored if in_vocab is None else scored & in_vocab[:, s + 1 : s + 1 + length]

    def loss_item_counts_need_target(self) -> bool:
        """The scored rows depend on the target's top-1 unless the draft vocab is the whole target vocab."""
        return self.config.draft_vocab_size != self.target.vocab_size

    def loss_item_counts(self, batch: dict[str, torch.Tensor],
                         target_out: TargetOutput | None = None) -> dict[str, torch.Tensor]:
        """``step{s}``: the scored indices TTT step s's soft cross-entropy averages over; with
        ``feature_loss_weight`` > 0 also ``feature{s}`` (s < S-1), the real pairs its feature term averages over."""
        in_vocab = None
        if self.loss_item_counts_need_target():
            if target_out is None:
                raise ValueError("EAGLE-3 with a reduced draft vocabulary counts its loss items from the target's "
                                 "output; pass target_out")
            with torch.no_grad():
                in_vocab = self._in_draft_vocab(self._soft_targets(target_out))
        real, labels = self._masks(batch)
        counts = {f"step{s}": self._scored(labels, in_vocab, s).sum() for s in range(self.config.ttt_steps)}
        if self.config.feature_loss_weight:
            counts.update({f"feature{s}": _aligned(real, s).sum() for s in range(self.config.ttt_steps - 1)})
        return counts

    def training_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """:func:`eagle3_ttt_loss`, computed on the scored rows only and chunk by chunk over them
        (:func:`~specgraft.heads.losses.linear_cross_entropy`): the draft lm_head, the target distribution restricted
        to the draft vocabulary and the soft cross-entropy are never materialised as [tokens, vocab] tensors (nor is
        HASS's top-K term, ``hass_topk`` > 0, computed in the same chunks). Step s is divided by
        ``num_items["step{s}"]`` when given (see :meth:`DraftHead.training_loss`); ``loss/step{s}`` logs its soft
        cross-entropy, ``loss/topk/step{s}`` its top-K term. The soft targets are at ``target_temperature``; with
        ``feature_loss_weight`` > 0 the :func:`eagle3_feature_loss` term is added (``feature{s}`` counts,
        ``loss/feature/step{s}`` logs)."""
        target_logits = self._soft_targets(target_out)
        fused, outputs = self._unroll(batch, target_out)
        real, labels = self._masks(batch)  # [B, T] each
        batch_size, seq_len = labels.shape
        with torch.no_grad():
            flat_target = target_logits.detach().reshape(batch_size * seq_len, -1)  # [B*T, V]
            if float(self.config.target_temperature) != 1.0:
                flat_target = flat_target / float(self.config.target_temperature)
            in_vocab = self._in_draft_vocab(target_logits)  # [B, T] or None
            # [Vd] target id of each draft id (None: the draft vocab is the target vocab)
            columns = None if in_vocab is None else self.draft_token_ids().to(flat_target.device)
            # [B, T] row of flat_target holding (b, t)
            flat_index = torch.arange(batch_size * seq_len, device=labels.device).view(batch_size, seq_len)
        total = None
        metrics: dict[str, torch.Tensor] = {}
        topk, topk_weight = self.config.hass_topk, float(self.config.hass_topk_weight)
        for s, out in enumerate(outputs):
            # Index i (0 <= i < T-s-2) predicts token i+s+2 against the target's distribution at i+s+1.
            length = max(seq_len - s - 2, 0)
            scored = self._scored(labels, in_vocab, s)  # [B, L]
            rows = self.norm(out[:, :length][scored])  # [N, h]
            row_targets = flat_index[:, s + 1 : s + 1 + length][scored]  # [N]
            if topk:
                # HASS: + topk_weight * the top-K distillation term, in the same chunks.
                step_sum, topk_sum, rank = linear_topk_distillation(
                    rows, self.lm_head.weight, target_logits=flat_target, topk=topk, topk_weight=topk_weight,
                    target_rows=row_targets, target_columns=columns, with_rank=self.metrics_enabled)
                ce_sum = step_sum.detach() - topk_weight * topk_sum
                metrics[f"loss/topk/step{s}"] = item_mean(topk_sum, rows.shape[0], num_items, f"step{s}")
            else:
                step_sum, rank = linear_cross_entropy(
                    rows, self.lm_head.weight, target_logits=flat_target, target_rows=row_targets,
                    target_columns=columns, with_rank=self.metrics_enabled)
                ce_sum = step_sum.detach()
            step_loss = item_mean(step_sum, rows.shape[0], num_items, f"step{s}")
            term = (self.config.loss_decay ** s) * step_loss
            total = term if total is None else total + term
            metrics[f"loss/step{s}"] = item_mean(ce_sum, rows.shape[0], num_items, f"step{s}")
            if rank is not None:  # top-1 hit: the draft's top-1 is the target's (restricted) top-1
                metrics[f"top1/step{s}"] = item_mean((rank == 0).sum().float(), rows.shape[0], num_items,
                                                     f"step{s}")
        assert total is not None  # ttt_steps >= 1 (validated)
        weight = float(self.config.feature_loss_weight)
        if weight:
            fused = fused.detach()  # the target side of the alignment stays where fc puts it
            for s, out in enumerate(outputs[:-1]):
                aligned = _aligned(real, s)  # [B, L = T - s - 1]
                length = aligned.shape[1]
                # every index's error, then masked: no boolean indexing (a host sync) per step
                error = _relative_squared_error(out[:, :length], fused[:, s + 1 : s + 1 + length])  # [B, L]
                step_loss = item_mean(torch.where(aligned, error, 0.0).sum(), aligned.sum(), num_items,
                                      f"feature{s}")
                total = total + weight * (self.config.loss_decay ** s) * step_loss
                metrics[f"loss/feature/step{s}"] = step_loss.detach()
        return HeadLoss(loss=total, metrics=metrics)


# ----------------------------------------------------------------------------------------------------------------
# The loss as a pure function (the reference the fast training path is pinned against)


def _aligned(real: torch.Tensor, step: int) -> torch.Tensor:
    """[B, max(T - s - 1, 0)] bool: index i of TTT step s has a feature-alignment target (tokens i and i+s+1
    real)."""
    length = max(real.shape[1] - step - 1, 0)
    return real[:, :length] & real[:, step + 1 : step + 1 + length]


def _relative_squared_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``|pred - target|^2 / |target|^2`` over the last dimension, [.., h] -> [..] (fp32; a zero target row counts
    as size 1e-6)."""
    target = target.float()
    return (pred.float() - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-6)


def _shift(x: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """``y[:, i] = x[:, i + offset]`` for i + offset < length, zero/False beyond: [B, T, ...] -> [B, T, ...]."""
    pad = [0, 0] * (x.dim() - 2) + [0, min(offset, length)]
    return F.pad(x[:, offset:], pad)


def _restricted_targets(target_logits: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target distribution restricted (and renormalised) to the draft vocab [B, T, Vd], whether the target's top-1
    is in the draft vocab [B, T], and the target's top-1 id [B, T]."""
    with torch.no_grad():
        logits = target_logits.float()
        top1 = logits.argmax(-1)  # [B, T]
        in_vocab = t2d.to(logits.device)[top1]
        restricted = logits.index_select(-1, draft_to_target_ids(d2t).to(logits.device))  # [B, T, Vd]
        return torch.softmax(restricted, dim=-1), in_vocab, top1


def _step_mask(labels: torch.Tensor, in_vocab: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T] bool: index i at step s counts when token ``i+s+2`` is a loss token and the target's top-1 at
    ``i+s+1`` (its prediction of that token) is in the draft vocab."""
    seq_len = labels.shape[1]
    return _shift(labels, step + 2, seq_len) & _shift(in_vocab, step + 1, seq_len)


def eagle3_ttt_loss(
    step_logits: Sequence[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    decay: float = 0.8,
    topk: int = 0,
    topk_weight: float = 1.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """EAGLE-3 training-time-test loss: ``sum_s decay**s * (L_s + topk_weight * K_s)`` (K_s only when topk > 0).

    Args:
        step_logits: S tensors [B, T, Vd]; ``step_logits[s][b, i]`` is the draft at index i after s unrolled steps,
            which predicts token ``x_{i+s+2}``.
        target_logits: [B, T, V] the target's logits; position t predicts ``x_{t+1}``, so the target distribution
            for ``step_logits[s][:, i]`` is ``target_logits[:, i+s+1]``.
        loss_mask: [B, T] 1 on real loss tokens (assistant tokens that are not padding), at the TOKEN's position.
        d2t: [Vd] offsets (draft id d is target id ``d + d2t[d]``); t2d: [V] bool, target ids in the draft vocab.
        decay: step weight base.
        temperature: p is the softmax of the target's logits divided by it (``head.target_temperature``).

    ``L_s`` is the mean, over indices i with ``i+s+2 < T``, ``loss_mask[i+s+2] == 1`` and the target's top-1 at
    ``i+s+1`` inside the draft vocab, of ``-sum_d p(d) log softmax(step_logits[s][i])(d)`` where p is the softmax
    of the target's logits at ``i+s+1`` restricted to the draft vocab's target ids. A step without such indices
    contributes 0. ``K_s`` (HASS's harmonized objective distillation, :func:`topk_distillation`) is the mean over
    the same indices of ``-sum_{d in topK(p)} p(d) log softmax(step_logits[s][i])(d)``, p as above.

    Returns:
        (the scalar loss, the S per-step soft cross-entropies L_s).
    """
    target_probs, in_vocab, _ = _restricted_targets(target_logits / temperature, d2t, t2d)
    labels = loss_mask.bool()
    seq_len = labels.shape[1]
    per_step, weighted = [], []
    for s, logits in enumerate(step_logits):
        mask = _step_mask(labels, in_vocab, s)  # [B, T]
        probs = _shift(target_probs, s + 1, seq_len)  # [B, T, Vd]
        ce = -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, T]
        step_loss = masked_mean(ce, mask)
        per_step.append(step_loss)
        if topk:
            step_loss = step_loss + topk_weight * topk_distillation(logits, probs, mask, topk)
        weighted.append(step_loss)
    return decayed_sum(weighted, decay, "eagle3_ttt_loss"), per_step


def eagle3_feature_loss(step_outputs: Sequence[torch.Tensor], fused: torch.Tensor, attention_mask: torch.Tensor,
                        decay: float = 0.8) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The feature-alignment term of ``head.feature_loss_weight``: ``sum_{s < S-1} decay**s * F_s``.

    Args:
        step_outputs: S tensors [B, T, h], the draft's output feature of each TTT step at each index.
        fused: [B, T, h] fc's output on the fused target features (step 0's hidden input at each position).
        attention_mask: [B, T] 1 on real tokens.
        decay: step weight base.

    ``F_s`` is the mean, over indices i with tokens i and i+s+1 real, of ``|o_s[i] - g[i+s+1]|^2 / |g[i+s+1]|^2``
    (o_s the step-s output, g = fused, held fixed): step s+1 drafts from o_s[i] where step 0 drafts from
    g[i+s+1]. A step without such indices contributes 0. Returns (the scalar term, the S-1 per-step F_s).
    """
    real = attention_mask.bool()
    per_step = []
    for s, out in enumerate(step_outputs[:-1]):
        mask = _aligned(real, s)
        length = mask.shape[1]
        error = _relative_squared_error(out[:, :length], fused[:, s + 1 : s + 1 + length].detach())  # [B, L]
        per_step.append(masked_mean(error, mask))
    if not per_step:
        return fused.new_zeros(()), []
    return decayed_sum(per_step, decay, "eagle3_feature_loss"), per_step
