"""Evaluate: the drafter a choice names, at its tuned, default or given setting, measured by the lossless decoder.

Drafters (:class:`DrafterChoice`):

* ``head``: a trained head folder; the drafter follows its family (``head_config.json``'s ``head_type``). ``k`` is
  the draft depth, ``tree_size`` the tree's tokens including the root, ``eagle_top_k`` EAGLE-2's expansion width.
* ``draft``: a separate draft LM with the target's vocabulary and tokenizer (a chain of ``k`` tokens, or a tree
  with ``mode="tree"`` and ``branching``).
* ``builtin="self"``: the target drafting for itself (greedy tau is exactly k+1: a pipeline check);
  ``builtin="random"``: uniformly random drafts (tau about 1).

A head or draft folder's ``tuned.json`` (``specgraft tune``) gives the setting unless a setting is given or
``use_tuned`` is false. There is no lossy (Medusa typical acceptance) option: the engine verifies losslessly only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.decoding.drafters import DraftModelDrafter, RandomDrafter, SelfDrafter
from specgraft.distill.tune import DRAFT_MODEL_KIND
from specgraft.errors import SpecgraftError
from specgraft.evaluation.loading import load_draft_model
from specgraft.evaluation.prompts import Prompt
from specgraft.evaluation.report import run_eval
from specgraft.evaluation.settings import DEFAULT_K, EvalSettings
from specgraft.heads.base import load_head_for_decoding, read_head_config
from specgraft.heads.registry import get_family
from specgraft.kernels.exact_attention import apply_attention_kernel
from specgraft.kernels.linear import apply_linear_kernel
from specgraft.target import Target
from specgraft.tuning.tune import drafter_info, is_plain, read_tuned

logger = logging.getLogger(__name__)

#: Branching of the first levels when a draft model / self drafter is asked for a tree without ``branching``.
DEFAULT_BRANCHING = (2, 2)


@dataclass(frozen=True)
class DrafterChoice:
    """Which drafter to evaluate (exactly one of ``head``, ``draft``, ``builtin``) and the setting that overrides
    its tuned or default one (None: not given). The names are ``specgraft eval``'s flags, which errors quote."""

    head: Path | None = None
    draft: str | None = None
    builtin: str | None = None
    k: int | None = None
    mode: str | None = None
    tree_size: int | None = None
    branching: Sequence[int] | None = None
    eagle_top_k: int | None = None
    use_tuned: bool = True

    @property
    def folder(self) -> str | None:
        """The head or draft folder (None for a built-in drafter)."""
        return str(self.head) if self.head is not None else self.draft


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SpecgraftError(f"{name} must be a positive integer, got {value}")


def build_drafter(choice: DrafterChoice, target: Target, dtype: Any, device: str
                  ) -> tuple[Any, dict[str, Any], Target]:
    """(the drafter ``choice`` names, what report.json records about it, the target to decode with: the head's own
    for a head, which for Medusa-2 is a copy of ``target`` with the trained adapter merged)."""
    _check_positive("--k", choice.k)
    _check_positive("--tree-size", choice.tree_size)
    _check_positive("--eagle-top-k", choice.eagle_top_k)
    if choice.branching is not None and any(b < 1 for b in choice.branching):
        raise SpecgraftError(f"--branching values must be >= 1, got {list(choice.branching)}")
    if choice.head is not None:
        return _head_drafter(choice, target)
    drafter, info = _model_drafter(choice, target, dtype, device)
    return drafter, info, target


def _model_drafter(choice: DrafterChoice, target: Target, dtype: Any, device: str) -> tuple[Any, dict[str, Any]]:
    """A drafter that is not a head: a draft model, the target itself, or random tokens."""
    if choice.tree_size is not None or choice.eagle_top_k is not None:
        raise SpecgraftError("--tree-size and --eagle-top-k apply to --head drafters; for --draft/self trees use "
                             "--mode tree --branching 2,2")
    k = choice.k or DEFAULT_K
    mode = choice.mode or ("tree" if choice.branching else "chain")
    if mode == "chain" and choice.branching:
        raise SpecgraftError("--branching makes a tree; drop --mode chain or drop --branching")
    branching = tuple(choice.branching or DEFAULT_BRANCHING) if mode == "tree" else None
    if branching is not None and len(branching) > k:
        raise SpecgraftError(f"--branching has {len(branching)} levels but the draft depth --k is {k}; give at most "
                             f"{k} values or raise --k")
    info: dict[str, Any] = {"k": k}
    if branching is not None:
        info["branching"] = list(branching)
    if choice.builtin == "random":
        if mode == "tree":
            raise SpecgraftError("the random drafter drafts chains only; drop --mode tree / --branching")
        return RandomDrafter(target.vocab_size, k=k), {"type": "random", "path": None, "mode": "chain", **info}
    if choice.builtin == "self":
        return SelfDrafter(k=k, tree_topk=branching), {"type": "self", "path": None, "mode": mode, **info}
    if choice.draft is None:
        raise SpecgraftError("no drafter chosen; pass --head, --draft or --drafter")
    explicit = choice.k is not None or choice.mode is not None or choice.branching is not None
    tuned = _tuned_setting(choice, Path(choice.draft), explicit, target)
    if tuned is not None and is_plain(tuned[0]):  # nothing drafts: the draft model is not loaded
        return None, {"type": DRAFT_MODEL_KIND, "path": str(choice.draft), "mode": "plain", "setting_source": tuned[1]}
    draft, draft_tok = load_draft_model(choice.draft, target, dtype, device)
    if tuned is not None:
        setting, source, _ = tuned
        k, mode, info = int(setting["k"]), "chain", {"k": int(setting["k"])}
        branching = None
    else:
        source = "flags" if explicit else "defaults"
    drafter = DraftModelDrafter(draft, k=k, tree_topk=branching, tokenizer=draft_tok)
    return drafter, {"type": DRAFT_MODEL_KIND, "path": str(choice.draft), "mode": mode, **info,
                     "setting_source": source}


def _tuned_setting(choice: DrafterChoice, folder: Path, explicit: bool,
                   target: Target) -> tuple[dict[str, Any], str, str] | None:
    """The folder's tuned setting and how the report names it, unless a setting or ``use_tuned=False`` wins."""
    if explicit or not choice.use_tuned or not folder.is_dir():
        return None
    tuned = read_tuned(folder)
    if tuned is None:
        return None
    device = tuned.get("device") or {}
    here = str(target.device)
    if str(device.get("device", "")).split(":")[0] != here.split(":")[0]:
        logger.warning("the tuned setting in %s was chosen on %s (%s), not on this device %s; pass setting flags or "
                       "re-run `specgraft tune` here", folder, device.get("device"), device.get("device_name"), here)
    source = (f"tuned ({folder / 'tuned.json'}, on {device.get('device')} {device.get('device_name')}, "
              f"{device.get('threads')} thread(s), {device.get('dtype')})")
    if is_plain(tuned["setting"]):
        logger.warning("%s says no drafting setting was faster than plain decoding on %s (%s): this eval measures "
                       "plain decoding; pass a setting flag or --no-tuned to measure drafting", folder / "tuned.json",
                       device.get("device"), device.get("device_name"))
    return tuned["setting"], source, str(tuned["kind"])


def head_family(head_dir: str | Path) -> Any:
    """The registered family of the head saved in ``head_dir`` (see :mod:`specgraft.heads.registry`)."""
    return get_family(read_head_config(head_dir)["head_type"])


def _head_drafter(choice: DrafterChoice, target: Target) -> tuple[Any, dict[str, Any], Target]:
    if choice.branching is not None:
        raise SpecgraftError("--branching applies to --draft/self trees; for heads use --tree-size (and "
                             "--eagle-top-k for EAGLE)")
    head_dir = Path(choice.head)
    family = head_family(head_dir)
    head = load_head_for_decoding(target, head_dir)
    explicit = any(v is not None for v in (choice.k, choice.mode, choice.tree_size, choice.eagle_top_k))
    tuned = _tuned_setting(choice, head_dir, explicit, target)
    if tuned is not None:
        setting, source, tuned_kind = tuned
        if family.tuning != tuned_kind:
            raise SpecgraftError(f"{head_dir}/tuned.json is for a {tuned_kind} drafter, not this {family.name} "
                                 "head; re-run `specgraft tune --overwrite` for it")
        info = drafter_info(tuned_kind, family.name, str(head_dir), setting, source)
        if is_plain(setting):
            return None, info, head.target
        drafter = family.drafter(head, setting)
        info["tree_size"] = family.describe_drafter(drafter)["tree_size"]
        return drafter, info, head.target
    setting = family.setting_from_flags(mode=choice.mode, k=choice.k, tree_size=choice.tree_size,
                                        top_k=choice.eagle_top_k)
    drafter = family.drafter(head, setting)
    info: dict[str, Any] = {"type": family.name, "path": str(head_dir), "mode": setting["mode"],
                            "setting_source": "flags" if explicit else "defaults"}
    info.update(family.describe_drafter(drafter))
    return drafter, info, head.target


@dataclass(frozen=True)
class LoadedDrafter:
    """A drafter ready to decode: the drafter (None: plain decoding), what report.json records about it and the
    target it decodes with, every module switched to the same kernels."""

    drafter: Any
    info: dict[str, Any]
    target: Target


def load_drafter(target: Target, choice: DrafterChoice, *, dtype: str, device: str, linear_kernel: str = "auto",
                 attention_kernel: str = "auto") -> LoadedDrafter:
    """Build ``choice``'s drafter on ``target`` and switch the modules it decodes with to the kernels
    (``auto`` or a name; a resolved name is not measured again)."""
    drafter, info, target = build_drafter(choice, target, dtype, device)
    # After the drafter is built: a Medusa-2 head brings its own merged target, and every module it decodes with
    # (target, head, draft model) must run the same kernels as plain decoding.
    info["attention_kernel"] = apply_attention_kernel(attention_kernel, target.model)
    info["linear_kernel"] = apply_linear_kernel(linear_kernel, device, dtype, target.model,
                                               *(drafter.modules() if drafter is not None else ()))
    return LoadedDrafter(drafter, info, target)


def evaluate(loaded: LoadedDrafter, prompts: Sequence[Prompt], out: Path, *, settings: EvalSettings,
             progress: bool = True) -> dict[str, Any]:
    """Decode ``prompts`` with ``loaded``'s drafter and plainly, per domain; write the report into ``out`` (see
    :func:`~specgraft.evaluation.report.run_eval`) and return it."""
    settings.validate()
    logger.info("evaluating %s drafter (%s) on %d prompts", loaded.info["type"], loaded.info["mode"], len(prompts))
    return run_eval(loaded.target, loaded.drafter, prompts, out, settings=settings, drafter_info=loaded.info,
                    progress=progress)
