"""Standalone draft models distilled on the target's outputs (DistillSpec / GKD).

* :mod:`specgraft.distill.losses`: FKL, RKL, generalised JSD, TV distance, top-1 CE, ``alpha_exact`` (pure).
* :mod:`specgraft.distill.student`: load a small sibling with the target's tokenizer, or cut one from the target.
* :mod:`specgraft.distill.data`: target continuations (sequence-level KD) and on-policy student samples (GKD).
* :mod:`specgraft.distill.trainer`: :class:`DistillTrainer` on the shared accelerate loop.
* :mod:`specgraft.distill.output`: the draft folder (transformers model + tokenizer + card + target identity).

``specgraft distill RECIPE`` (:mod:`specgraft.commands.distill`) runs a recipe from ``recipes/distill/``.
"""

from specgraft.utils.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("LOSS_NAMES", "alpha_exact", "distill_loss", "forward_kl", "generalized_jsd", "reverse_kl",
                     "top1_agreement", "top1_cross_entropy", "total_variation"), "losses"),
    **dict.fromkeys(("DRAFT_META", "draft_drafter", "load_draft", "save_draft"), "output"),
    **dict.fromkeys(("Student", "build_student", "load_student", "student_from_target"), "student"),
    # The trainer pulls in accelerate and the data stack, like every name here: imported when asked for.
    "DistillTrainer": "trainer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DRAFT_META",
    "LOSS_NAMES",
    "Student",
    "alpha_exact",
    "build_student",
    "distill_loss",
    "draft_drafter",
    "forward_kl",
    "generalized_jsd",
    "load_draft",
    "load_student",
    "reverse_kl",
    "save_draft",
    "student_from_target",
    "top1_agreement",
    "top1_cross_entropy",
    "total_variation",
]

