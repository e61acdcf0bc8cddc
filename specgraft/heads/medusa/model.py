"""Medusa heads (Cai et al. 2024): K extra decoding heads on the target's last hidden state.

Head ``k`` (0-based) reads the target's post-norm last hidden state at position ``t`` and predicts the token at
``t + k + 2`` (the target itself predicts ``t + 1``). Each head is ``num_layers`` residual blocks
``x + SiLU(Linear_h->h(x))`` (the Linear zero-initialised, so a fresh head is the identity) followed by a vocabulary
projection initialised from the target's lm_head, or, with ``share_lm_head``, the target's frozen lm_head itself
(borrowed, never a parameter of the head and never saved).

Parameter names match vLLM's Medusa checkpoint format, so export is a copy:
``blocks.{h}.layers.{l}.weight``, ``blocks.{h}.layers.{l}.bias`` and ``lm_heads.{h}.weight``.

Every layer of every head owns its weights (the reference implementation's ``[ResBlock(h)] * n`` shared one module
across layers; tests pin that no two parameters share storage).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specgraft.errors import SpecgraftError
from specgraft.heads.head import DraftHead, HeadLoss, depth_ranks
from specgraft.heads.losses import decayed_sum, item_mean, linear_cross_entropy
from specgraft.heads.medusa.config import MedusaConfig
from specgraft.target import Target, TargetOutput


class MedusaBlock(nn.Module):
    """``num_layers`` residual blocks ``x + SiLU(W x + b)``, each with its own zero-initialised Linear."""

    def __init__(self, hidden_size: int, num_layers: int, device: torch.device | None = None) -> None:
        super().__init__()
        # A fresh Linear per layer: never repeat one module (the reference code's shared-weights bug).
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=True, device=device, dtype=torch.float32)
            for _ in range(num_layers)
        )
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., h]."""
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(DraftHead):
    """K Medusa heads grafted onto a frozen target; see the module docstring."""

    head_type = "medusa"
    Config = MedusaConfig
    needs_target_logits = False

    def __init__(self, config: MedusaConfig, target: Target) -> None:
        super().__init__(config, target)
        config.validate()
        lm_head = target.output_head
        weight = lm_head.weight  # [V, h]
        if (config.hidden_size, config.vocab_size) != (weight.shape[1], weight.shape[0]):
            raise SpecgraftError(
                f"medusa head config has hidden_size {config.hidden_size} and vocab_size {config.vocab_size} but "
                f"the target's lm_head is [{weight.shape[0]}, {weight.shape[1]}]; build the head for this target")
        device = weight.device
        self.blocks = nn.ModuleList(MedusaBlock(config.hidden_size, config.num_layers, device)
                                    for _ in range(config.num_heads))
        self._softcap = getattr(target.text_config, "final_logit_softcapping", None) or None
        if config.share_lm_head:
            self.lm_heads = None
        else:
            has_bias = getattr(lm_head, "bias", None) is not None
            heads = []
            for _ in range(config.num_heads):
                # skip_init: the weights are overwritten by the copy below (no wasted random init of [V, h]).
                linear = torch.nn.utils.skip_init(nn.Linear, config.hidden_size, config.vocab_size, bias=has_bias,
                                                  device=device, dtype=torch.float32)
                with torch.no_grad():
                    linear.weight.copy_(weight)
                    if has_bias:
                        linear.bias.copy_(lm_head.bias)
                heads.append(linear)
            self.lm_heads = nn.ModuleList(heads)

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def build(cls, target: Target, config: MedusaConfig) -> MedusaHead:
        """Fresh heads: identity residual blocks and vocabulary projections copied from the target's lm_head."""
        return cls(config, target)

    def required_layers(self) -> tuple[int, ...]:
        """The target's last hidden state (post final norm)."""
        return (self.target.num_layers,)

    # -- forward ---------------------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def set_topk_accuracy(self, accuracy: torch.Tensor | list[list[float]] | None) -> None:
        """Store measured [K, topk] accuracies in the config (saved by ``save_pretrained``) for tree building."""
        if accuracy is None:
            self.config.topk_accuracy = None
            return
        rows = torch.as_tensor(accuracy, dtype=torch.float64).tolist()
        previous = self.config.topk_accuracy
        self.config.topk_accuracy = rows
        try:
            self.config.validate()
        except SpecgraftError:
            self.config.topk_accuracy = previous
            raise

    def _param_dtype(self) -> torch.dtype:
        return self.blocks[0].layers[0].weight.dtype

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head ``k``'s logits: [..., h] hidden states -> [..., V]."""
        x = self.blocks[k](hidden.to(self._param_dtype()))
        if self.lm_heads is None:
            # The borrowed lm_head (and Gemma's soft-capping) in the target's dtype; gradients still reach x.
            return self.target.logits_from_hidden(x)
        logits = self.lm_heads[k](x)
        if self._softcap:
            # Same soft-capping as the target's own logits (a fresh head then reproduces them exactly).
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _plain_projection(self, k: int) -> nn.Linear | None:
        """Head ``k``'s vocabulary projection when its logits are a plain linear map of the block's output (no
        soft-capping), so the loss can be computed chunk by chunk; None otherwise."""
        if self.lm_heads is None:
            return self.target.plain_output_head()
        projection = self.lm_heads[k]
        return projection if not self._softcap and type(projection) is nn.Linear else None

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], target_out: TargetOutput, tokens: torch.Tensor,
                         depth: int) -> torch.Tensor:
        """Head ``d - 1`` at anchor ``i`` drafts depth ``d`` (it predicts token ``i + d + 1``); depths past the
        last head are unranked (see :meth:`DraftHead.acceptance_ranks`)."""
        hidden = target_out.hidden_states[self.target.num_layers]
        logits = (self.head_logits(hidden, k) for k in range(min(depth, self.num_heads)))
        return depth_ranks(logits, tokens, depth)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, h] last hidden states -> [K, B, T, V] logits (head k predicts position t + k + 2)."""
        return torch.stack([self.head_logits(hidden, k) for k in range(self.num_heads)])

    # -- training --------------------------------------------------------------------------------------------
    def _pair_masks(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        """Per head k, the [B, T - k - 2] bool pairs (position t, label t + k + 2) that count (None: too short)."""
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        labelled = label_mask(input_ids, batch.get("loss_mask"), attention_mask)  # [B, T] labels that count
        real = label_mask(input_ids, None, attention_mask)  # [B, T] positions holding a real token
        seq_len = input_ids.shape[1]
        return [real[:, : seq_len - (k + 2)] & valid_labels(labelled, k + 2) if seq_len > k + 2 else None
                for k in range(self.num_heads)]

    def loss_item_counts(self, batch: dict[str, torch.Tensor],
                         target_out: TargetOutput | None = None) -> dict[str, torch.Tensor]:
        """``head{k}``: the labelled pairs head k's cross-entropy averages over."""
        zero = batch["input_ids"].new_zeros(())
        return {f"head{k}": zero if sel is None else sel.sum() for k, sel in enumerate(self._pair_masks(batch))}

    def training_loss(self, batch: dict[str, torch.Tensor], target_out: TargetOutput,
                      num_items: dict[str, torch.Tensor] | None = None) -> HeadLoss:
        """Decayed sum of per-head cross-entropies on assistant tokens (see :func:`medusa_loss`); head k's is
        divided by ``num_items["head{k}"]`` when given (see :meth:`DraftHead.training_loss`).

        Only the rows that have a label are projected onto the vocabulary (one matmul per head on the flattened,
        masked rows), which is what makes head training cheap.
        """
        hidden = target_out.hidden_states[self.target.num_layers]  # [B, T, h]
        input_ids = batch["input_ids"]
        hidden = hidden.to(self._param_dtype())
        seq_len = input_ids.shape[1]
        total = hidden.new_zeros(())
        metrics: dict[str, torch.Tensor] = {}
        for k, sel in enumerate(self._pair_masks(batch)):
            offset = k + 2
            if sel is not None:  # [B, T - offset]
                rows = hidden[:, : seq_len - offset][sel]  # [N, h]
                labels = input_ids[:, offset:][sel]  # [N]
            else:
                rows = hidden.new_zeros((0, hidden.shape[-1]))
                labels = input_ids.new_zeros((0,))
            count = labels.numel()
            projection = self._plain_projection(k)
            if projection is not None:  # chunked over the rows: no [N, V] logits kept for the backward
                x = self.blocks[k](rows).to(projection.weight.dtype)  # [N, h]
                ce_sum, rank = linear_cross_entropy(x, projection.weight, projection.bias, labels=labels,
                                                    with_rank=self.metrics_enabled)
            else:
                logits = self.head_logits(rows, k)  # [N, V]
                ce_sum = _CrossEntropySum.apply(logits.float(), labels)
                rank = None
                if self.metrics_enabled:
                    with torch.no_grad():
                        rank = _label_rank(logits, labels)  # [N]
            ce = item_mean(ce_sum, count, num_items, f"head{k}")
            total = total + (self.config.loss_decay ** k) * ce
            metrics[f"loss/head{k}"] = ce.detach()
            if rank is not None:  # a rank over the vocabulary costs about as much as the loss itself
                with torch.no_grad():
                    metrics[f"top1/head{k}"] = item_mean((rank < 1).sum().float(), count, num_items, f"head{k}")
                    metrics[f"top5/head{k}"] = item_mean((rank < 5).sum().float(), count, num_items, f"head{k}")
        return HeadLoss(loss=total, metrics=metrics)


# ----------------------------------------------------------------------------------------------------------------
# The loss as a pure function (the reference the fast training path is pinned against)


def label_mask(input_ids: torch.Tensor, loss_mask: torch.Tensor | None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: positions that hold a real token (attention mask) and count for the loss (loss mask).

    Used for both ends of a Medusa pair: the hidden state at ``t`` must be a real token, and the label at
    ``t + k + 2`` must be a real assistant token.
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()
    if loss_mask is not None:
        mask = mask & loss_mask.bool()
    return mask


def valid_labels(mask: torch.Tensor, offset: int) -> torch.Tensor:
    """[B, T - offset] bool: whether the label ``offset`` positions ahead of each position counts."""
    return mask[:, offset:]


def medusa_loss(
    head_logits: torch.Tensor | list[torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor | None,
    decay: float,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Medusa-1 loss: ``sum_k decay**k * CE_k``.

    ``CE_k`` is the mean cross-entropy of head k's logits at position ``t`` against the token at ``t + k + 2``,
    over the pairs where that label exists (``t + k + 2 < T``), is an assistant token (``loss_mask`` at the LABEL
    position is 1) and is not padding, and the position ``t`` itself is not padding (``attention_mask``). A head
    with no such pair contributes 0.

    Args:
        head_logits: [K, B, T, V] (or K tensors [B, T, V]).
        input_ids: [B, T].
        loss_mask: [B, T] 1 on tokens that count as labels (assistant tokens), or None for all.
        decay: weight base of head k.
        attention_mask: [B, T] 1 on real tokens, 0 on padding (None: no padding).

    Returns:
        (the scalar loss, the K per-head mean CEs).
    """
    loss_positions = label_mask(input_ids, loss_mask, attention_mask)  # [B, T]
    real = label_mask(input_ids, None, attention_mask)  # [B, T]
    seq_len = input_ids.shape[1]
    per_head: list[torch.Tensor] = []
    for k, logits in enumerate(head_logits):
        offset = k + 2
        length = max(seq_len - offset, 0)
        sel = real[:, :length] & valid_labels(loss_positions, offset)[:, :length]  # [B, T - offset]
        rows = logits[:, :length][sel]  # [N, V]
        labels = input_ids[:, offset:][:, :length][sel]
        ce = F.cross_entropy(rows.float(), labels, reduction="sum") / max(labels.numel(), 1)
        per_head.append(ce)
    return decayed_sum(per_head, decay, "medusa_loss"), per_head


class _CrossEntropySum(torch.autograd.Function):
    """``F.cross_entropy(logits, labels, reduction="sum")`` with a leaner backward for [N, V] fp32 logits.

    The backward is ``softmax - onehot`` computed from the saved log-probabilities in place, instead of PyTorch's
    zero-filled NLL gradient followed by a separate log-softmax backward (one pass over the [N, V] logits fewer for
    Medusa's per-head loss). Pinned against ``F.cross_entropy`` by the tests.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)  # [N, V]
        ctx.save_for_backward(logp, labels)
        return -logp.gather(-1, labels.unsqueeze(-1)).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logp, labels = ctx.saved_tensors
        grad_logits = logp.exp()  # softmax [N, V]
        minus_one = torch.full((labels.shape[0], 1), -1.0, dtype=grad_logits.dtype, device=grad_logits.device)
        grad_logits.scatter_add_(-1, labels.unsqueeze(-1), minus_one)
        return grad_logits.mul_(grad), None


def _label_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N, V], [N] -> [N] number of vocabulary entries scored strictly above the label (0 = top-1)."""
    label_logit = logits.gather(-1, labels.unsqueeze(-1))  # [N, 1]
    # int32 accumulation: about twice as fast on CPU as the default int64 sum of a bool tensor.
    return (logits > label_logit).sum(-1, dtype=torch.int32)


def medusa_num_parameters(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                          share_lm_head: bool) -> int:
    """Trainable parameters of a Medusa head set (for size estimates before building one)."""
    blocks = num_heads * num_layers * (hidden_size * hidden_size + hidden_size)
    return blocks + (0 if share_lm_head else num_heads * hidden_size * vocab_size)
