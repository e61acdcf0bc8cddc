"""Acceptance during training: the held-out simulated tau of the setting the head will be served with, and
optionally a real decoder run on a few held-out prompts.

**Simulated tau.** Every held-out row is read teacher-forced: the target runs once (greedy tokens ``g_j``, the
argmax after reading tokens ``0..j``), and the head ranks, for every anchor ``i`` and depth ``d``, the target's
token ``g_{i+d}`` among its depth-``d`` candidates (:meth:`~specgraft.heads.base.DraftHead.acceptance_ranks`).
Depth ``d`` of anchor ``i`` is a real decoding state only where the row follows the target's greedy path from the
anchor (tokens ``i+1..i+d`` are assistant tokens equal to ``g_{i..i+d-1}``: the root and the accepted drafts), so
only those count, and only at the anchors a greedy decoder would verify from (:func:`decoding_anchors`: a step
from anchor ``i`` moves to ``i + accepted + 1``). The counts are the per-(depth, rank) statistics an eval's
:class:`~specgraft.decoding.acceptance.AcceptanceRecorder` writes (``rank_attempts``, ``rank_accepts``): the anchor
reached depth ``d - 1`` along the top-1 spine, and then tried each rank the setting drafts at depth ``d``.
``p[d][r]`` (:func:`~specgraft.decoding.acceptance.rank_probabilities`) and the family's ``expected_accepted(setting,
p)`` hook (its tuner's own prediction: for a chain ``sum_d prod_{j<=d} p[j][0]``, which is ``specgraft simulate
--acceptance-profile`` of ``p[.][0]``; for a tree its static value) give ``tau = 1 + expected accepted drafts``.
Its cost is one target forward and one head pass per held-out batch.

**Decoder tau.** The first ``training.eval_prompts`` held-out rows, cut before their first assistant token, are
decoded greedily by :class:`~specgraft.decoding.decoder.SpeculativeDecoder` with the family's drafter at the same
setting, and by plain decoding: the tau of the speculative run and whether every answer is token-identical.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from specgraft.decoding.acceptance import rank_probabilities
from specgraft.errors import SpecgraftError
from specgraft.heads.base import DraftHead
from specgraft.heads.registry import get_family
from specgraft.target import Target


def served_setting(head: DraftHead, override: Mapping[str, Any] | None) -> dict[str, Any]:
    """The drafting setting the head is evaluated at: ``override`` (``training.eval_setting``) or the family's
    default (what an untuned ``specgraft eval --head`` drafts)."""
    if override:
        return dict(override)
    search = get_family(head.head_type).search
    if search is None:
        raise SpecgraftError(f"the {head.head_type} family has no default drafting setting; set "
                             "training.eval_setting (e.g. {mode: chain, depth: 4})")
    return dict(search.default_setting(head))


def setting_widths(setting: Mapping[str, Any]) -> list[int]:
    """Ranks drafted per depth (1..D) by ``setting``: a static tree's paths, a tree's ``top_k`` at every depth, or
    1 (a chain)."""
    paths = setting.get("paths")
    if paths:
        depth = max(len(p) for p in paths)
        return [1 + max(p[d] for p in paths if len(p) > d) for d in range(depth)]
    depth = int(setting.get("depth") or 0)
    if depth < 1:
        raise SpecgraftError(f"the drafting setting {dict(setting)} has no depth; set training.eval_setting.depth")
    width = int(setting.get("top_k") or 1) if setting.get("mode") == "tree" else 1
    return [width] * depth


def count_ranks(ranks: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor, labels: torch.Tensor,
                widths: Sequence[int], real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-(depth, rank) (attempts, accepts) [D, R] of one batch at the anchors a greedy decoder would verify
    from (see :func:`decoding_anchors`), and the number of those anchors.

    Args:
        ranks: [B, T, D] the head's rank of ``greedy[:, i + d]`` at anchor ``i``, depth ``d``.
        tokens: [B, T] the row's tokens.
        greedy: [B, T] the target's argmax after each position.
        labels: [B, T] bool, real assistant tokens.
        widths: ranks drafted per depth.
        real: [B, T] bool, real (not padding) tokens; default all.
    """
    depth, width = len(widths), max(widths)
    length = labels.shape[1]
    real = torch.ones_like(labels) if real is None else real.bool()
    # on_path[:, j]: token j + 1 is an assistant token equal to the target's greedy choice after position j.
    on_path = torch.zeros_like(labels)
    on_path[:, :-1] = labels[:, 1:] & (tokens[:, 1:] == greedy[:, :-1])

    def shifted(mask: torch.Tensor, offset: int) -> torch.Tensor:  # [:, i] = mask[:, i + offset], False past T
        out = torch.zeros_like(mask)
        if offset < length:
            out[:, : length - offset] = mask[:, offset:]
        return out

    # reached[d - 1][:, i]: from anchor i the decoder drafts depth d along the top-1 spine (the root and the
    # spine's accepted drafts, tokens i + 1 .. i + d, are on the greedy path); accepted[d - 1]: and the target's
    # token is among the ranks the setting drafts there. Conditioning on the spine, a tree's likeliest path, is
    # where a budgeted tree spends its depth (on stories260K's EAGLE-3 default 60-token tree it simulated the
    # decoder's tau 3% high; conditioning on any drafted rank, as if every top-k child had a full subtree,
    # 10% low); for a chain both are the same. A depth past the row's end is reached and rejected (as the
    # decoder stops at its last token), so for a chain on rows that follow the greedy path the per-depth rates
    # multiply back to the walk's tokens per step exactly.
    reached, accepted = [on_path], []
    for d in range(1, depth + 1):
        measurable = shifted(real, d)  # the target's token after position i + d is the truth
        rank = ranks[..., d - 1]
        accepted.append(reached[-1] & measurable & (rank < widths[d - 1]))
        continues = shifted(on_path, d) | ~shifted(real, d + 1)
        reached.append(reached[-1] & measurable & (rank == 0) & continues)
    anchors = decoding_anchors(torch.stack(accepted, dim=-1).sum(-1), on_path)
    attempts = torch.zeros(depth, width, dtype=torch.long, device=ranks.device)
    accepts = torch.zeros_like(attempts)
    for d in range(1, depth + 1):
        attempts[d - 1, : widths[d - 1]] += (reached[d - 1] & anchors).sum()
        hits = ranks[..., d - 1][accepted[d - 1] & anchors]
        accepts[d - 1] += torch.bincount(hits, minlength=width)[:width]
    return attempts, accepts, int(anchors.sum())


def decoding_anchors(accepted: torch.Tensor, can_anchor: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the anchors a greedy decoder verifies from when it decodes each row. A step from anchor ``i``
    emits ``accepted[i]`` drafts and the bonus token, so the next step's anchor is ``i + accepted[i] + 1``;
    positions whose root is not on the greedy path (``can_anchor`` False) are skipped. Counting every position
    instead would over-weight easy stretches, which a decoder crosses in few steps."""
    chosen = torch.zeros_like(can_anchor)
    accepted_rows, anchor_rows = accepted.tolist(), can_anchor.tolist()
    for b, (row, ok) in enumerate(zip(accepted_rows, anchor_rows)):
        i = 0
        while i < len(row):
            if ok[i]:
                chosen[b, i] = True
                i += int(row[i]) + 1
            else:
                i += 1
    return chosen


def collect_rank_statistics(head: DraftHead, target: Target, batches: Iterable[Mapping[str, torch.Tensor]],
                            widths: Sequence[int], max_batches: int) -> dict[str, Any] | None:
    """The ``acceptance_statistics`` (``verdicts``: anchors, ``rank_attempts``, ``rank_accepts``) of up to
    ``max_batches`` held-out batches; None when the family does not rank its drafts."""
    device = next(iter(head.parameters())).device
    attempts = accepts = None
    anchors = 0
    was_training = head.training
    head.eval()
    try:
        with torch.no_grad():
            for index, batch in enumerate(batches):
                if index >= max_batches:
                    break
                batch = {k: v.to(device) for k, v in batch.items() if torch.is_tensor(v)}
                out = target(batch["input_ids"], batch.get("attention_mask"), layers=head.required_layers(),
                             logits=True)
                greedy = out.logits.argmax(-1)
                ranks = head.acceptance_ranks(batch, out, greedy, len(widths))
                if ranks is None:
                    return None
                labels = batch["attention_mask"].bool() if "attention_mask" in batch else \
                    torch.ones_like(batch["input_ids"], dtype=torch.bool)
                if batch.get("loss_mask") is not None:
                    labels = labels & batch["loss_mask"].bool()
                a, h, steps = count_ranks(ranks, batch["input_ids"], greedy, labels, widths,
                                          real=batch.get("attention_mask"))
                attempts = a if attempts is None else attempts + a
                accepts = h if accepts is None else accepts + h
                anchors += steps
    finally:
        head.train(was_training)
    if attempts is None:
        return None
    return {"verdicts": anchors, "rank_attempts": attempts.tolist(), "rank_accepts": accepts.tolist()}


def simulated_tau(head: DraftHead, setting: Mapping[str, Any], statistics: Mapping[str, Any]) -> dict[str, Any]:
    """``sim_tau`` (1 + the family's expected accepted drafts of ``setting``) and ``sim_acceptance_by_depth``
    (``p[d][0]``) from held-out rank statistics."""
    search = get_family(head.head_type).search
    if search is None or not search.simulates_acceptance:
        raise SpecgraftError(f"the {head.head_type} family's search has no expected_accepted; set "
                             "training.eval_every=0")
    probs = rank_probabilities(dict(statistics), min_attempts=1)
    return {"sim_tau": 1.0 + float(search.expected_accepted(setting, probs)),
            "sim_acceptance_by_depth": [round(row[0], 4) if row else 0.0 for row in probs],
            "sim_anchors": int(statistics["verdicts"])}


def prompt_ids(row: Mapping[str, Any]) -> list[int]:
    """A held-out row's prompt: its tokens before the first assistant (loss) token, or its first quarter when the
    whole row is loss (plain text)."""
    ids = [int(t) for t in row["input_ids"]]
    if "attention_mask" in row:
        ids = ids[: int(sum(int(m) for m in row["attention_mask"]))]
    mask = [int(m) for m in row.get("loss_mask", [1] * len(ids))][: len(ids)]
    first = next((i for i, m in enumerate(mask) if m), len(ids))
    return ids[:first] if first > 0 else ids[: max(1, len(ids) // 4)]


def decoder_tau(head: DraftHead, target: Target, setting: Mapping[str, Any], prompts: Sequence[Sequence[int]],
                max_new_tokens: int) -> dict[str, Any]:
    """Greedy speculative decoding of ``max_new_tokens`` tokens (EOS ignored) after each of ``prompts`` at
    ``setting`` against plain decoding: ``decoder_tau`` (pooled
    over every verification step), ``decoder_identical`` (answers token-identical to plain decoding, of
    ``decoder_prompts``) and the decoding seconds."""
    from specgraft.decoding.decoder import SpeculativeDecoder

    was_training = head.training
    head.eval()
    started = time.perf_counter()
    try:
        drafter = get_family(head.head_type).drafter(head, dict(setting))
        # A fixed number of tokens per prompt (no stop at EOS), as the held-out rows it is compared with run on.
        spec = SpeculativeDecoder(target, target.tokenizer, drafter=drafter, ignore_eos=True)
        plain = SpeculativeDecoder(target, target.tokenizer, drafter=None, ignore_eos=True)
        steps = emitted = identical = 0
        for ids in prompts:
            s = spec.generate(list(ids), max_new_tokens)
            b = plain.generate(list(ids), max_new_tokens)
            steps += s.num_steps
            emitted += sum(a + 1 for a in s.accepted_lengths)
            identical += int(s.generated_ids == b.generated_ids)
    finally:
        head.train(was_training)
    return {"decoder_tau": emitted / steps if steps else float("nan"), "decoder_identical": identical,
            "decoder_prompts": len(prompts), "decoder_s": time.perf_counter() - started}
