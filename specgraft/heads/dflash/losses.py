"""DFlash training pieces as pure functions of tensors: anchors, the block attention mask, weights, the loss.

Facts (vllm-project/speculators @c05b95b, ``src/speculators/models/dflash/{utils,attention,core}.py`` and
``src/speculators/losses/eager.py``):

* A block for anchor ``a`` has ``block_size`` slots at positions ``a .. a + block_size - 1``: slot 0 holds the
  anchor token ``x_a``, the others the mask token. Slot ``k >= 1`` predicts ``x_{a+k}``; its target distribution is
  the target's prediction at position ``a + k - 1``.
* The block's queries see the context features of positions STRICTLY before the anchor (``t < a``: the anchor is
  slot 0 of the block, not context) and every slot of their own block (bidirectional), nothing of other blocks.
* Anchors are positions with a label; speculators also drops the last ``block_size`` positions. Here an anchor is
  valid when its whole block fits (``a + block_size <= T``), one position more at the end.
* Loss: ``sum_{blocks, k} w_k * mask * CE_k / max(sum mask, 1)`` with ``w_0 = 0`` and
  ``w_k = exp(-(k - 1) / gamma)`` (the denominator counts scored slots, unweighted, as speculators does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specgraft.decoding.tree import additive_from_visible


def valid_anchor_positions(loss_mask: torch.Tensor, block_size: int,
                           real: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: positions with a label whose block (``block_size`` slots from there) fits in the sequence, and,
    given ``real`` [B, T] (the attention mask), ends on a real token: then a row's anchors do not depend on how much
    padding its batch adds (a micro-batch split draws the same blocks)."""
    valid = loss_mask.bool().clone()
    seq_len = valid.shape[1]
    valid[:, max(seq_len - block_size + 1, 0):] = False
    if real is not None and seq_len >= block_size:
        valid[:, : seq_len - block_size + 1] &= real.bool()[:, block_size - 1:]
    return valid


def select_anchors(loss_mask: torch.Tensor, block_size: int, max_anchors: int,
                   generator: torch.Generator | Sequence[torch.Generator] | None = None,
                   real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``max_anchors`` distinct valid anchors per row (uniformly, without replacement), sorted.

    Args:
        loss_mask: [B, T] 1 where the token is a label (a real assistant token).
        block_size: slots per block.
        max_anchors: anchors per row at most.
        generator: the random source (CPU generator; the global RNG when None), or one generator per row.
        real: [B, T] the attention mask, or None (see :func:`valid_anchor_positions`).

    Returns:
        ``(anchors [B, A] int64, anchor_valid [B, A] bool)`` with ``A = min(max_anchors, most valid positions of any
        row)``; a row with fewer valid positions is padded with anchor 0 marked invalid.
    """
    valid = valid_anchor_positions(loss_mask, block_size, real)  # [B, T]
    counts = valid.sum(dim=1)  # [B]
    width = min(int(max_anchors), int(counts.max())) if valid.numel() else 0
    batch = valid.shape[0]
    anchors = torch.zeros(batch, width, dtype=torch.long, device=loss_mask.device)
    anchor_valid = torch.zeros(batch, width, dtype=torch.bool, device=loss_mask.device)
    for b in range(batch):
        positions = torch.nonzero(valid[b], as_tuple=False).squeeze(-1)  # [n]
        take = min(width, positions.numel())
        if take == 0:
            continue
        row_generator = generator[b] if isinstance(generator, (list, tuple)) else generator
        order = torch.randperm(positions.numel(), generator=row_generator).to(positions.device)
        anchors[b, :take] = torch.sort(positions[order[:take]]).values
        anchor_valid[b, :take] = True
    return anchors, anchor_valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, A] anchors -> [B, A * block_size] positions ``a + k`` of every slot, block after block."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + offsets).flatten(-2)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_length: int,
                         context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each block query may attend to, as a [B, A * bs, T + A * bs] bool tensor.

    Keys are ``[context positions 0 .. T-1 | block slots, block after block]``; the query of slot ``k`` of block
    ``j`` sees context key ``t`` iff ``t < anchors[:, j]`` (and ``context_valid[:, t]``: padding keys are hidden) and
    every slot of block ``j``. No query sees another block.
    """
    context = block_context_mask(anchors, block_size, context_length, context_valid)  # [B, Q, T]
    own = own_block_mask(anchors.shape[1], block_size, anchors.device).expand(anchors.shape[0], -1, -1)  # [B, Q, Q]
    return torch.cat([context, own], dim=-1)


def block_context_mask(anchors: torch.Tensor, block_size: int, context_length: int,
                       context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The context part of :func:`block_attention_mask`: [B, A * bs, T] bool, query (block j, any slot) sees
    context key ``t`` iff ``t < anchors[:, j]`` (and ``context_valid[:, t]``)."""
    t = torch.arange(context_length, device=anchors.device)
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    context = t[None, None, :] < query_anchor[:, :, None]  # [B, Q, T]
    if context_valid is not None:
        context = context & context_valid.bool()[:, None, :]
    return context


def own_block_mask(num_blocks: int, block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """The block part of :func:`block_attention_mask`: [A * bs, A * bs] bool, each slot sees its own block's."""
    block_of = torch.arange(num_blocks * block_size, device=device) // block_size  # [Q]
    return block_of[:, None] == block_of[None, :]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool -> [B, 1, Q, K] additive mask (0 visible, the dtype's minimum elsewhere)."""
    return additive_from_visible(visible, dtype)[:, None]


def dflash_position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size] float32 slot weights: 0 for the anchor slot, ``exp(-(k - 1) / gamma)`` for slot ``k >= 1``."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / float(gamma))
    weights[0] = 0.0
    return weights


def block_label_mask(loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """[B, A, bs] bool: slot ``k`` of block ``j`` is scored iff its anchor is valid, ``k >= 1`` and the token it
    predicts, ``x_{a+k}``, is a label."""
    positions = block_positions(anchors, block_size)  # [B, A*bs]
    labels = torch.gather(loss_mask.bool(), 1, positions).view(*anchors.shape, block_size)
    labels = labels & anchor_valid[..., None]
    labels[..., 0] = False
    return labels


def dflash_loss(block_logits: torch.Tensor, target_probs: torch.Tensor, slot_mask: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The DFlash loss from full logits (the reference the head's chunked training path is pinned against).

    Args:
        block_logits: [B, A, bs, V] the draft's logits per slot.
        target_probs: [B, A, bs, V] the target distribution each slot is trained towards.
        slot_mask: [B, A, bs] bool, the scored slots (:func:`block_label_mask`).
        weights: [bs] slot weights (:func:`dflash_position_weights`).

    Returns:
        ``sum(w_k * mask * CE) / max(sum(mask), 1)`` with ``CE = -sum_v p(v) log softmax(logits)(v)``.
    """
    ce = -(target_probs * F.log_softmax(block_logits.float(), dim=-1)).sum(-1)  # [B, A, bs]
    mask = slot_mask.to(ce.dtype)
    weighted = ce * mask * weights.to(ce)
    return weighted.sum() / mask.sum().clamp(min=1.0)

