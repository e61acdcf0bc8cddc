"""``specgraft tune``: its arguments, and the command as calls of :mod:`specgraft.pipeline.tune`.

``specgraft tune --target PATH (--head DIR | --draft DIR) --prompts FILE... [--cost-profile FILE]
[--calibration REPORT]`` predicts every candidate setting's speed from a device cost profile (measured now when none
is given) and a calibration eval (run now at the default setting when none is given), confirms the best with evals
on the calibration prompts and writes ``tuned.json`` beside the head (see :mod:`specgraft.tuning.tune`).
``--engine llamacpp`` tunes the draft length for llama.cpp instead (:func:`specgraft.commands.engine_tuning.run_tune`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specgraft.commands.flags import add_attention_kernel_argument, add_linear_kernel_argument
from specgraft.commands.profile import add_engine_arguments
from specgraft.errors import SpecgraftError
from specgraft.tuning.settings import DEFAULT_MIN_SPEEDUP

if TYPE_CHECKING:
    from specgraft.tuning.cost import CostProfile
    from specgraft.tuning.tune import TuneResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft tune``."""
    parser.add_argument("--target", required=True, help="target model: a transformers folder or Hub id (with "
                                                        "--engine llamacpp: the target GGUF llama.cpp serves)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--head", type=Path, help="trained head folder (medusa, eagle, eagle3 or dflash)")
    which.add_argument("--draft", type=Path, help="draft model folder")
    which.add_argument("--draft-gguf", type=Path,
                       help="--engine llamacpp: a `specgraft export --format llamacpp` draft.gguf to tune as it is "
                            "(the tuned record goes to --out; with --head/--draft it also goes beside the folder and "
                            "into the export's card)")
    parser.add_argument("--prompts", nargs="*", type=Path, default=[],
                        help="calibration prompt files (the confirming evals run on them too)")
    parser.add_argument("--limit-per-domain", type=int, help="use only the first N prompts of each domain")
    parser.add_argument("--cost-profile", type=Path, help="a `specgraft profile` JSON (default: measure one now)")
    parser.add_argument("--calibration", type=Path,
                        help="an eval report of this drafter at its default setting (default: run one now)")
    parser.add_argument("--out", type=Path, help="folder for the calibration/confirming reports (default: "
                                                 "<head>/tune)")
    parser.add_argument("--kv-length", type=int, help="KV length for a profile measured now (default: the mean "
                                                      "prompt length plus half of --max-new-tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per calibration turn (default 64)")
    parser.add_argument("--no-confirm", action="store_true", help="skip the confirming evals")
    parser.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                        help="speedup over plain decoding (measured by the confirming evals, else predicted) a "
                             "drafting setting needs to be chosen; below it tuned.json says plain decoding "
                             f"(default {DEFAULT_MIN_SPEEDUP})")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tuned.json")
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="model dtype")
    parser.add_argument("--threads", type=int, help="torch CPU threads (--engine llamacpp: llama.cpp's -t, default 1)")
    add_linear_kernel_argument(parser)
    add_attention_kernel_argument(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Tune one drafter; write tuned.json and print predicted vs measured."""
    if args.engine != "llamacpp" and args.draft_gguf is not None:
        raise SpecgraftError("--draft-gguf is a llama.cpp draft: add --engine llamacpp (specgraft's decoder takes "
                             "--head/--draft folders)")
    if args.engine == "llamacpp":
        from specgraft.commands.engine_tuning import run_tune

        return run_tune(args)
    from specgraft.tuning.tune import TUNED_NAME, check_min_speedup
    from specgraft.utils.io import output_lock
    from specgraft.utils.outputs import writing_output

    if not args.prompts:
        raise SpecgraftError("tuning needs calibration prompts; pass --prompts FILE (the prompts you will serve)")
    check_min_speedup(args.min_speedup)  # before anything is loaded
    source_dir = args.head if args.head is not None else args.draft
    tuned_file = source_dir / TUNED_NAME
    inputs = [args.target, *args.prompts, args.cost_profile, args.calibration]
    # One tune per folder at a time (two would mix their calibration/confirming reports), and tuned.json is
    # replaced only when an earlier tune wrote it.
    with output_lock(args.out or source_dir / "tune", "`specgraft tune`"), \
            writing_output(tuned_file, "tune", overwrite=args.overwrite, inputs=inputs, file=True,
                           flag="tuned.json"):
        return _tune(args, source_dir, tuned_file)


def _tune(args: argparse.Namespace, source_dir: Path, tuned_file: Path) -> int:
    import torch

    from specgraft.evaluation.loading import device_and_dtype
    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.settings import EvalSettings
    from specgraft.kernels.exact_attention import apply_attention_kernel
    from specgraft.kernels.linear import apply_linear_kernel
    from specgraft.pipeline.tune import (
        load_draft_source,
        load_head_source,
        measure_cost_profile,
        read_calibration,
        tune_drafter,
    )
    from specgraft.target import load_target
    from specgraft.tuning.cost import CostProfile, check_measure_args

    check_measure_args(args.kv_length)
    profile = CostProfile.load(args.cost_profile) if args.cost_profile is not None else None
    calibration = (read_calibration(args.calibration, args.head, source_dir) if args.calibration is not None
                   else None)
    settings = EvalSettings(max_new_tokens=args.max_new_tokens)
    settings.validate()
    prompts = load_prompts(args.prompts, limit_per_domain=args.limit_per_domain)
    device, dtype = device_and_dtype(args.device, args.dtype, args.threads)
    target = load_target(args.target, dtype=dtype, device=device)
    source = (load_head_source(target, args.head) if args.head is not None
              else load_draft_source(target, args.draft, dtype=dtype, device=device))
    apply_attention_kernel(args.attention_kernel, source.target.model)
    kernel = apply_linear_kernel(args.linear_kernel, device, dtype, source.target.model, source.module)
    if profile is None:
        profile = measure_cost_profile(source.target, [source], prompts, device=device, dtype=dtype,
                                       threads=torch.get_num_threads(), max_new_tokens=args.max_new_tokens,
                                       kv_length=args.kv_length, linear_kernel=kernel)
        out_profile = (args.out or source_dir / "tune") / "cost_profile.json"
        profile.save(out_profile)
        print(f"measured the cost profile -> {out_profile}")
    result = tune_drafter(source, prompts, args.out or source_dir / "tune", profile=profile, settings=settings,
                          calibration=calibration, confirm=not args.no_confirm, min_speedup=args.min_speedup,
                          linear_kernel=kernel)
    print_result(result, profile)
    print(f"wrote {tuned_file}; `specgraft eval --head/--draft {source_dir}` now uses it (a setting flag wins)")
    return 0


def print_result(result: TuneResult, profile: CostProfile) -> None:
    """The ranked candidates, then the tuned, default and other measured settings: predicted vs measured."""
    from specgraft.tuning.tune import TOP_CANDIDATES, is_plain, same_setting, setting_label

    kind = result.kind
    print(f"device: {profile.device} ({profile.device_name}), {profile.dtype}, {profile.threads} thread(s); plain "
          f"step {profile.plain_step_s * 1e3:.3f} ms at KV length {profile.kv_length}")
    print("rank | setting | E[accepted+1] | draft ms | step ms | overhead ms | predicted tok/s | predicted speedup")
    for i, c in enumerate(result.candidates[:TOP_CANDIDATES], start=1):
        print(f"{i:>4} | {setting_label(kind, c.setting)} | {1 + c.expected_accepted:.3f} | {c.draft_s * 1e3:.3f} | "
              f"{c.step_s * 1e3:.3f} | {c.overhead_s * 1e3:.3f} | {c.tokens_per_s:.1f} | {c.speedup:.3f}x")
    rows = [("tuned", result.chosen, "tuned")]
    if not same_setting(kind, result.chosen.setting, result.candidates[0].setting):
        rows.append(("predicted best", result.candidates[0], "best"))
    if result.alternative is not None and not same_setting(kind, result.chosen.setting, result.alternative.setting):
        rows.append(("second opinion (the other shape)", result.alternative, "alternative"))
    if result.calibrated is not None and not same_setting(kind, result.chosen.setting, result.calibrated.setting):
        rows.append(("calibration run", result.calibrated, "calibration"))
    if result.default is not None:
        rows.append(("default", result.default, "default"))
    for name, c, key in rows:
        if is_plain(c.setting):
            print(f"{name}: {setting_label(kind, c.setting)}: 1.00x and tau 1.00 by definition")
            continue
        m: dict[str, Any] = result.measured.get(key) or {}
        line = (f"{name}: {setting_label(kind, c.setting)}: predicted {c.tokens_per_s:.1f} tok/s "
                f"({c.speedup:.2f}x, tau {1 + c.expected_accepted:.2f})")
        if m.get("tokens_per_s") is not None and m.get("speedup_ratio_of_totals"):
            line += (f"; measured {m['tokens_per_s']:.1f} tok/s ({m['speedup_ratio_of_totals']:.2f}x, tau "
                     f"{m['tau']:.2f}); speedup prediction error "
                     f"{prediction_error(c.speedup, m['speedup_ratio_of_totals']):+.1%}")
        print(line)
        if m.get("lossless_check"):
            print(f"  lossless: {m['lossless_check']}")
    if is_plain(result.chosen.setting):
        print("no drafting setting is faster than plain decoding on this device: `specgraft eval` with this "
              "folder now decodes plainly (pass setting flags or --no-tuned to measure drafting anyway); a faster "
              "device, or a head that accepts more, changes the answer")
    print("measured tok/s come from the confirming evals (plain and speculative interleaved per prompt in one "
          "process); on a shared machine the absolute speed drifts with load, so compare the speedups")


def prediction_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured if measured else math.nan
