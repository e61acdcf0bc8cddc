"""``specgraft profile --engine llamacpp`` and ``specgraft tune --engine llamacpp``: the commands over
:mod:`specgraft.tuning.llamacpp` (llama.cpp's step costs, the engine-side calibration, the draft-length choice)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.tuning.llamacpp import (
    LLAMACPP_TUNED_NAME,
    LlamacppProfile,
    Prediction,
    check_draft_for_target,
    choose,
    does_not_pay,
    engine_prompts,
    measure_costs,
    predict,
    run_interleaved,
    spec_flags,
    step_offset_of,
    tuned_record,
)


def print_profile(profile: LlamacppProfile) -> None:
    print(f"llama.cpp on {profile.cpu}, {profile.threads} thread(s), {profile.spec_type}; KV ~"
          f"{profile.prompt_tokens + profile.new_tokens // 2}: plain {profile.plain_ms:.3f} ms/token")
    print("draft length K | step ms (x plain) | draft call ms | verify K+1 rows ms | break-even tau")
    for k in sorted(profile.step_ms):
        draft = profile.draft_ms.get(k)
        verify = profile.verify_ms(k)
        draft_cell = f"{draft:.3f}" if draft is not None else "-"
        verify_cell = f"{verify:.3f}" if verify is not None else "-"
        print(f"{k:>14} | {profile.step_ms[k]:8.3f} ({profile.step_ms[k] / profile.plain_ms:4.2f}x) | "
              f"{draft_cell:>13} | {verify_cell:>18} | {profile.break_even_tau(k):.2f}")


def new_tokens_of(args: argparse.Namespace) -> int:
    """Tokens per request: ``profile --new-tokens``, ``tune --max-new-tokens``."""
    return int(args.new_tokens if getattr(args, "new_tokens", None) is not None else args.max_new_tokens)


def check_engine_args(args: argparse.Namespace, command: str) -> None:
    """The flags ``--engine llamacpp`` needs, refused in one line each."""
    from specgraft.export.llamacpp_engine import llamacpp_bin

    if getattr(args, "calibration", None) is not None:
        raise SpecgraftError("--calibration takes a specgraft eval report, but --engine llamacpp calibrates acceptance "
                             "in llama.cpp itself (the engine's own counters on --prompts): leave it out")
    target = Path(args.target)
    if target.suffix != ".gguf" or not target.is_file():
        raise SpecgraftError(f"--engine llamacpp serves a GGUF target: pass --target TARGET.gguf (got {args.target})")
    if args.max_draft < 1:
        raise SpecgraftError(f"--max-draft must be at least 1, got {args.max_draft}")
    if new_tokens_of(args) < 8:
        raise SpecgraftError(f"tokens per request (--new-tokens / --max-new-tokens) must be at least 8, got "
                             f"{new_tokens_of(args)}")
    if getattr(args, "draft_gguf", None) is not None and not Path(args.draft_gguf).is_file():
        raise SpecgraftError(f"--draft-gguf {args.draft_gguf} is not a file; pass the draft.gguf of a "
                             "`specgraft export --format llamacpp`")
    llamacpp_bin()
    if command == "profile" and getattr(args, "draft_gguf", None) is None and not args.head and not args.draft:
        raise SpecgraftError("profile --engine llamacpp needs a draft: --draft-gguf DRAFT.gguf (a `specgraft export "
                             "--format llamacpp`), or --head/--draft FOLDER to export now")


def _export_draft(source: Path, target_gguf: Path, out: Path) -> Path:
    """A head or distilled draft folder exported for llama.cpp (into ``out``, the command's own scratch)."""
    from specgraft.export import export_head

    return export_head(source, "llamacpp", out, target_gguf=target_gguf, overwrite=True).path / "draft.gguf"


def run_profile(args: argparse.Namespace) -> int:
    """``specgraft profile --engine llamacpp``."""
    from specgraft.utils.outputs import writing_output

    check_engine_args(args, "profile")
    sources = [*args.head, *[Path(d) for d in args.draft]]
    if len(sources) + (args.draft_gguf is not None) != 1:
        raise SpecgraftError("profile --engine llamacpp measures one draft: pass one of --draft-gguf, --head, --draft")
    inputs = [args.target, args.draft_gguf, *sources]
    with writing_output(args.out, "profile", overwrite=args.overwrite, inputs=inputs, file=True), \
            tempfile.TemporaryDirectory(prefix="specgraft-llamacpp-") as tmp:
        target = Path(args.target)
        draft = Path(args.draft_gguf) if args.draft_gguf is not None else _export_draft(sources[0], target,
                                                                                       Path(tmp) / "export")
        profile = measure_costs(target, draft, max_draft=args.max_draft, kv_length=args.kv_length,
                                new_tokens=args.new_tokens, rounds=args.rounds, threads=args.threads or 1)
        if args.draft_gguf is None:
            profile.draft_gguf = f"{sources[0]} (exported for {target.name})"
        profile.save(args.out)
    print_profile(profile)
    print(f"wrote {args.out}")
    return 0


def run_tune(args: argparse.Namespace) -> int:
    """``specgraft tune --engine llamacpp``: costs, calibration in the engine, choice, confirming run, record."""
    from specgraft.utils.io import atomic_write_json, output_lock
    from specgraft.utils.outputs import writing_output

    check_engine_args(args, "tune")
    if not args.prompts:
        raise SpecgraftError("tuning needs calibration prompts; pass --prompts FILE (the prompts you will serve)")
    if not args.min_speedup > 0:
        raise SpecgraftError(f"--min-speedup must be positive, got {args.min_speedup}")
    folder = args.head if args.head is not None else args.draft
    source = Path(folder) if folder is not None else None
    if source is None and args.out is None:
        raise SpecgraftError("tune --engine llamacpp --draft-gguf needs --out DIR for the tuned record")
    out_dir = Path(args.out) if args.out is not None else source / "tune-llamacpp"
    tuned_file = (source if source is not None else out_dir) / LLAMACPP_TUNED_NAME
    inputs = [args.target, *args.prompts, args.cost_profile, args.draft_gguf]
    with output_lock(out_dir, "`specgraft tune --engine llamacpp`"), \
            writing_output(tuned_file, "tune", overwrite=args.overwrite, inputs=inputs, file=True,
                           flag=LLAMACPP_TUNED_NAME):
        record = _tune(args, source, out_dir)
        atomic_write_json(tuned_file, record)
        if source is None:
            print(f"wrote {tuned_file}")
            return 0
        atomic_write_json(out_dir / LLAMACPP_TUNED_NAME, record)
        # The export made for measuring, written again now that the card can carry the tuned draft length.
        export = _export_draft(source, Path(args.target), out_dir / "export").parent
    k = record["draft_tokens"]
    print(f"wrote {tuned_file} and the tuned llama.cpp export {export}; `specgraft export {source} --format llamacpp "
          f"--target-gguf {Path(args.target).name}` now writes "
          f"{'--spec-draft-n-max ' + str(k) if k else 'that speculation does not pay here'} into its card")
    return 0


def _tune(args: argparse.Namespace, source: Path | None, out_dir: Path) -> dict[str, Any]:
    from specgraft.evaluation.prompts import load_prompts

    target = Path(args.target)
    threads = args.threads or 1
    prompts = load_prompts(args.prompts, limit_per_domain=args.limit_per_domain)
    draft = Path(args.draft_gguf) if source is None else _export_draft(source, target, out_dir / "export")
    check_draft_for_target(draft, target)
    ids = engine_prompts(target, [p.turns[0] for p in prompts], threads)
    if args.cost_profile is not None:
        profile = LlamacppProfile.load(args.cost_profile)
        if Path(profile.target_gguf).name != target.name or profile.threads != threads:
            raise SpecgraftError(f"{args.cost_profile} was measured for {Path(profile.target_gguf).name} at "
                                 f"{profile.threads} thread(s), not {target.name} at {threads}; measure a profile "
                                 "for this setup (or leave --cost-profile out)")
    else:
        mean_prompt = sum(len(p) for p in ids) / len(ids)
        kv_length = args.kv_length or int(mean_prompt + new_tokens_of(args) / 2)
        print(f"measuring llama.cpp's step costs (KV ~{kv_length}, draft lengths 1..{args.max_draft})")
        profile = measure_costs(target, draft, max_draft=args.max_draft, kv_length=kv_length,
                                new_tokens=new_tokens_of(args), rounds=args.rounds, threads=threads)
        profile.save(out_dir / "llamacpp_profile.json")
    print_profile(profile)
    n = max(profile.step_ms)
    print(f"calibrating acceptance in llama.cpp at draft length {n} (beside plain decoding) on {len(ids)} prompt(s)")
    calib, _ = run_interleaved(target, {"plain": ([], 0), f"k{n}": (spec_flags(draft, profile.spec_type, n), n)},
                               ids, new_tokens_of(args), threads)
    calibration = calib[f"k{n}"]
    acceptance = calibration.acceptance_per_position()
    if not acceptance:
        raise SpecgraftError(f"llama.cpp drafted no full-length ({n}) chain on the calibration prompts; use longer "
                             "--new-tokens")
    offset, plain_ms = step_offset_of(profile, calibration, calib["plain"])
    predictions = predict(profile, acceptance, offset, plain_ms)
    print(f"the calibration run's steps cost {offset:+.3f} plain tokens beyond the profile's at draft length {n}; "
          f"plain decoding {plain_ms:.3f} ms/token on the prompts")
    chosen = choose(predictions, args.min_speedup)
    best = max(predictions, key=lambda p: p.tokens_per_s)
    confirm_k = (chosen or best).draft_tokens
    measured: dict[str, Any] = {}
    if not args.no_confirm:
        print(f"confirming: plain vs draft length {confirm_k}, interleaved on {len(ids)} prompt(s)")
        configs = {"plain": ([], 0), f"k{confirm_k}": (spec_flags(draft, profile.spec_type, confirm_k), confirm_k)}
        totals, outputs = run_interleaved(target, configs, ids, new_tokens_of(args), threads)
        plain, spec = totals["plain"], totals[f"k{confirm_k}"]
        predicted = next(p for p in predictions if p.draft_tokens == confirm_k)
        measured = {
            "draft_tokens": confirm_k, "prompts": len(ids), "new_tokens": new_tokens_of(args),
            "plain_tokens_per_s": round(plain.tokens_per_s, 3), "tokens_per_s": round(spec.tokens_per_s, 3),
            "speedup": round(spec.tokens_per_s / plain.tokens_per_s, 4),
            "tau": round(spec.tokens / max(spec.tokens - spec.accepted, 1), 4),
            "predicted_plain_tokens_per_s": round(1000.0 / plain_ms, 3),
            "predicted_tokens_per_s": predicted.tokens_per_s, "predicted_speedup": predicted.speedup,
            "identical_to_plain": f"{sum(a == b for a, b in zip(outputs['plain'], outputs[f'k{confirm_k}']))}/"
                                  f"{len(ids)}",
        }
        measured["speedup_prediction_error"] = round(predicted.speedup / measured["speedup"] - 1, 4)
        measured["tokens_per_s_prediction_error"] = round(predicted.tokens_per_s / spec.tokens_per_s - 1, 4)
        if chosen is None and measured["speedup"] >= args.min_speedup:
            print(f"note: the confirming run measured {measured['speedup']:.2f}x at K={confirm_k} though "
                  f"{predicted.speedup:.2f}x was predicted: re-run on a quieter machine or with more prompts")
    calibration_info = {"source": "llama.cpp's own per-step acceptance counters", "draft_tokens": n,
                        "prompts": len(ids), "full_length_steps": calibration.full_steps,
                        "plain_ms": round(plain_ms, 4), "step_offset_plain_tokens": round(offset, 4),
                        "tau": round(calibration.tokens / max(calibration.tokens - calibration.accepted, 1), 4)}
    record = tuned_record(profile, acceptance, predictions, chosen, measured, calibration_info, args.min_speedup)
    print_tune(record, predictions, chosen, acceptance)
    return record


def print_tune(record: Mapping[str, Any], predictions: Sequence[Prediction], chosen: Prediction | None,
               acceptance: Sequence[float]) -> None:
    print(f"acceptance per position in llama.cpp: {[round(a, 3) for a in acceptance]}")
    print("K | tau | step ms | break-even tau | predicted tok/s | predicted speedup")
    for p in predictions:
        mark = " <- chosen" if chosen is not None and p.draft_tokens == chosen.draft_tokens else ""
        print(f"{p.draft_tokens} | {p.tau:.3f} | {p.step_ms:.3f} | {p.break_even_tau:.3f} | {p.tokens_per_s:.1f} | "
              f"{p.speedup:.3f}x{mark}")
    if chosen is None:
        print(does_not_pay(predictions, acceptance))
    m = record.get("measured") or {}
    if m:
        print(f"measured (plain and K={m['draft_tokens']} interleaved): plain {m['plain_tokens_per_s']:.1f} tok/s "
              f"(predicted {m['predicted_plain_tokens_per_s']:.1f}), K={m['draft_tokens']} {m['tokens_per_s']:.1f} "
              f"tok/s (predicted {m['predicted_tokens_per_s']:.1f}, error {m['tokens_per_s_prediction_error']:+.1%}); "
              f"speedup {m['speedup']:.3f}x (predicted {m['predicted_speedup']:.3f}x, error "
              f"{m['speedup_prediction_error']:+.1%}); outputs identical to plain {m['identical_to_plain']}")
    if chosen is not None:
        print("serve with: llama-server -m TARGET.gguf -md draft.gguf " + " ".join(record["serve_flags"]))
