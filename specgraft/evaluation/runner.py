"""Measure tau, acceptance and speedup per domain with the lossless decoder.

``specgraft eval --target PATH (--head DIR | --draft DIR | --drafter self|random) --prompts FILE... --out DIR``
decodes every prompt with the drafter and with plain decoding of the same target (the baseline), groups the
results by domain and writes report.json, report.md, answers.jsonl and three PNG plots into ``--out`` (see
:mod:`specgraft.evaluation.report`): a new or empty folder (``--overwrite`` replaces an earlier report), locked
while the run writes so that two evals cannot mix their files. Drafters:

* ``--head DIR``: a trained head folder; the drafter class follows its ``head_type`` (medusa -> MedusaDrafter,
  eagle / eagle3 -> EagleDrafter). ``--k`` is the draft depth, ``--tree-size`` the tree's tokens including the root
  (Medusa default 64, EAGLE default 60), ``--eagle-top-k`` EAGLE-2's expansion width.
* ``--draft DIR``: a separate draft LM with the target's vocabulary and tokenizer (a chain of ``--k`` tokens, or a
  tree with ``--mode tree --branching 2,2``).
* ``--drafter self``: the target drafting for itself (greedy tau is exactly k+1: a pipeline check);
  ``--drafter random``: uniformly random drafts (tau about 1).

There is no lossy (Medusa typical acceptance) option: the engine verifies losslessly only.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.evaluation.loading import check_device, device_and_dtype, load_draft_model  # noqa: F401 (re-exported)
from specgraft.evaluation.settings import DEFAULT_K, EvalSettings
from specgraft.kernels.exact_attention import apply_attention_kernel
from specgraft.kernels.linear import apply_linear_kernel
from specgraft.utils.outputs import check_output, writing_output

logger = logging.getLogger(__name__)

#: Branching of the first levels when a draft model / self drafter is asked for a tree without --branching.
DEFAULT_BRANCHING = (2, 2)


# -- drafters ---------------------------------------------------------------------------------------------------------


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SpecgraftError(f"{name} must be a positive integer, got {value}")


def build_drafter(args: argparse.Namespace, target: Any, dtype: Any, device: str
                  ) -> tuple[Any, dict[str, Any], Any]:
    """(the drafter named by the arguments, what report.json records about it, the target to decode with: the
    head's own for a head, which for Medusa-2 is a copy of ``target`` with the trained adapter merged)."""
    _check_positive("--k", args.k)
    _check_positive("--tree-size", args.tree_size)
    _check_positive("--eagle-top-k", args.eagle_top_k)
    if args.branching is not None and any(b < 1 for b in args.branching):
        raise SpecgraftError(f"--branching values must be >= 1, got {args.branching}")
    if args.head is not None:
        return _head_drafter(args, target)
    drafter, info = _model_drafter(args, target, dtype, device)
    return drafter, info, target


def _model_drafter(args: argparse.Namespace, target: Any, dtype: Any, device: str) -> tuple[Any, dict[str, Any]]:
    """A drafter that is not a head: a draft model, the target itself, or random tokens."""
    from specgraft.decoding.drafters import DraftModelDrafter, RandomDrafter, SelfDrafter

    if args.tree_size is not None or args.eagle_top_k is not None:
        raise SpecgraftError("--tree-size and --eagle-top-k apply to --head drafters; for --draft/self trees use "
                             "--mode tree --branching 2,2")
    k = args.k or DEFAULT_K
    mode = args.mode or ("tree" if args.branching else "chain")
    if mode == "chain" and args.branching:
        raise SpecgraftError("--branching makes a tree; drop --mode chain or drop --branching")
    branching = tuple(args.branching or DEFAULT_BRANCHING) if mode == "tree" else None
    if branching is not None and len(branching) > k:
        raise SpecgraftError(f"--branching has {len(branching)} levels but the draft depth --k is {k}; give at most "
                             f"{k} values or raise --k")
    info: dict[str, Any] = {"k": k}
    if branching is not None:
        info["branching"] = list(branching)
    if args.drafter == "random":
        if mode == "tree":
            raise SpecgraftError("the random drafter drafts chains only; drop --mode tree / --branching")
        return RandomDrafter(target.vocab_size, k=k), {"type": "random", "path": None,
                                                                       "mode": "chain", **info}
    if args.drafter == "self":
        return SelfDrafter(k=k, tree_topk=branching), {"type": "self", "path": None, "mode": mode, **info}
    from specgraft.tuning.tune import is_plain

    explicit = args.k is not None or args.mode is not None or args.branching is not None
    tuned = _tuned_setting(args, Path(args.draft), explicit, target)
    if tuned is not None and is_plain(tuned[0]):  # nothing drafts: the draft model is not loaded
        return None, {"type": "draft_model", "path": str(args.draft), "mode": "plain", "setting_source": tuned[1]}
    draft, draft_tok = load_draft_model(args.draft, target, dtype, device)
    if tuned is not None:
        setting, source, _ = tuned
        k, mode, info = int(setting["k"]), "chain", {"k": int(setting["k"])}
        branching = None
    else:
        source = "flags" if explicit else "defaults"
    drafter = DraftModelDrafter(draft, k=k, tree_topk=branching, tokenizer=draft_tok)
    return drafter, {"type": "draft_model", "path": str(args.draft), "mode": mode, **info, "setting_source": source}


def _tuned_setting(args: argparse.Namespace, folder: Path, explicit: bool,
                   target: Any) -> tuple[dict[str, Any], str, str] | None:
    """The folder's tuned setting and how the report names it, unless a setting flag or --no-tuned wins."""
    from specgraft.tuning.tune import is_plain, read_tuned

    if explicit or getattr(args, "no_tuned", False) or not folder.is_dir():
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
    from specgraft.heads.base import read_head_config
    from specgraft.heads.registry import get_family

    return get_family(read_head_config(head_dir)["head_type"])


def _head_drafter(args: argparse.Namespace, target: Any) -> tuple[Any, dict[str, Any], Any]:
    from specgraft.heads.base import load_head_for_decoding

    if args.branching is not None:
        raise SpecgraftError("--branching applies to --draft/self trees; for heads use --tree-size (and "
                             "--eagle-top-k for EAGLE)")
    family = head_family(args.head)
    head = load_head_for_decoding(target, args.head)
    explicit = any(v is not None for v in (args.k, args.mode, args.tree_size, args.eagle_top_k))
    tuned = _tuned_setting(args, Path(args.head), explicit, target)
    if tuned is not None:
        from specgraft.tuning.tune import drafter_info, is_plain

        setting, source, tuned_kind = tuned
        if family.tuning != tuned_kind:
            raise SpecgraftError(f"{args.head}/tuned.json is for a {tuned_kind} drafter, not this {family.name} "
                                 "head; re-run `specgraft tune --overwrite` for it")
        info = drafter_info(tuned_kind, family.name, str(args.head), setting, source)
        if is_plain(setting):
            return None, info, head.target
        drafter = family.drafter(head, setting)
        info["tree_size"] = family.describe_drafter(drafter)["tree_size"]
        return drafter, info, head.target
    setting = family.setting_from_flags(mode=args.mode, k=args.k, tree_size=args.tree_size, top_k=args.eagle_top_k)
    drafter = family.drafter(head, setting)
    info: dict[str, Any] = {"type": family.name, "path": str(args.head), "mode": setting["mode"],
                            "setting_source": "flags" if explicit else "defaults"}
    info.update(family.describe_drafter(drafter))
    return drafter, info, head.target


def run(args: argparse.Namespace) -> int:
    """Validate the inputs (cheap checks first), load target, drafter and prompts, evaluate, print the table."""
    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.report import REPORT_JSON, REPORT_MD, run_eval

    settings = EvalSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, repeats=args.repeats, warmup=args.warmup,
                            ignore_eos=args.ignore_eos)
    settings.validate()
    check_output(args.out, "eval", overwrite=args.overwrite, inputs=_inputs(args))  # before the slow part
    prompts = load_prompts(args.prompts, domain_field=args.domain_field, prompt_field=args.prompt_field,
                           limit_per_domain=args.limit_per_domain)
    device, dtype = device_and_dtype(args)

    from specgraft.target import load_target

    target = load_target(args.target, dtype=dtype, device=device)
    drafter, info, target = build_drafter(args, target, dtype, device)
    # After the drafter is built: a Medusa-2 head brings its own merged target, and every module it decodes with
    # (target, head, draft model) must run the same kernels as plain decoding.
    info["attention_kernel"] = apply_attention_kernel(args.attention_kernel, target.model)
    info["linear_kernel"] = apply_linear_kernel(args.linear_kernel, device, dtype, target.model,
                                               *(drafter.modules() if drafter is not None else ()))
    logger.info("evaluating %s drafter (%s) on %d prompts from %d file(s)", info["type"], info["mode"], len(prompts),
                len(args.prompts))
    # Checked again under the lock: another run may have finished into it while this one loaded.
    with writing_output(args.out, "eval", overwrite=args.overwrite, inputs=_inputs(args), clear=True):
        report = run_eval(target, drafter, prompts, args.out, settings=settings, drafter_info=info,
                          progress=not args.no_progress)
    _print_summary(report)
    print(f"wrote {args.out / REPORT_JSON}, {args.out / REPORT_MD}, answers and plots to {args.out}")
    return 0


def _inputs(args: argparse.Namespace) -> list[Any]:
    """The paths eval reads (an --out containing one is refused)."""
    return [args.target, args.head, args.draft, *args.prompts]


def _print_summary(report: dict[str, Any]) -> None:
    from specgraft.evaluation.report import render_markdown

    table = [line for line in render_markdown(report).splitlines() if line.startswith("|")]
    print("\n".join(table))
    overall = report.get("overall") or {}
    print(f"lossless check: {overall.get('lossless_check')}")
