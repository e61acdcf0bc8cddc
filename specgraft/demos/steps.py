"""The steps both demos share (:mod:`specgraft.demos.stories` on the embedded target, :mod:`specgraft.demos.smollm2` on
SmolLM2-135M-Instruct): train and evaluate each drafter, tune them for the machine, export, write the summary, each
step a call of :mod:`specgraft.pipeline`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from specgraft.config import DistillRecipe, Recipe, from_dict, recipe_schema, safe_load_yaml
from specgraft.defaults.corpus import DOMAINS
from specgraft.demos import RECIPES_DIR
from specgraft.evaluation.prompts import load_prompts
from specgraft.evaluation.settings import EvalSettings
from specgraft.export.exporter import export_head
from specgraft.heads.registry import family_names, get_family
from specgraft.kernels.exact_attention import apply_attention_kernel
from specgraft.kernels.linear import apply_linear_kernel, resolve_linear_kernel
from specgraft.pipeline.evaluate import DrafterChoice, evaluate, load_drafter
from specgraft.pipeline.train import distill_draft, train_head
from specgraft.pipeline.tune import (
    DrafterSource,
    load_draft_source,
    load_head_source,
    measure_cost_profile,
    profile_kv_length,
    tune_drafter,
)
from specgraft.target import Target, load_target
from specgraft.tuning.tune import is_plain, setting_label
from specgraft.utils.io import atomic_write_json, atomic_write_text

#: The engines the demo exports each head for: the first two of these that the head's family holds.
DEMO_EXPORT_FORMATS = ("vllm", "sglang", "trtllm")


def in_registry_order(drafters: Iterable[str]) -> list[str]:
    """Head families in the registry's order, then the other drafters (the distilled draft) by name."""
    order = {name: i for i, name in enumerate(family_names())}
    return sorted(drafters, key=lambda name: (order.get(name, len(order)), name))


def run_drafters(out: Path, target: Any, target_path: Path, recipes: dict[str, Any], prompts_file: Path,
                 budget: Any, threads: int | None, export: bool = True
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, Path]]:
    """The middle of every demo: choose the decode kernel, train and evaluate each drafter of ``recipes``, tune
    them for this machine, export the heads (unless ``export`` is false); returns (results, tuning, exports)."""
    kernel = choose_decode_kernel(target.model)
    results = train_and_evaluate(out, target, target_path, recipes, prompts_file, budget, kernel)
    tuning = tune_all(out, results, target_path, prompts_file, budget, threads, kernel) if results else {}
    exports = export_heads(out, results) if export else {}
    return results, tuning, exports


def train_and_evaluate(out: Path, target: Any, target_path: Path, recipes: dict[str, Any], prompts_file: Path,
                       budget: Any, kernel: str) -> dict[str, dict[str, Any]]:
    """Train the heads of ``recipes`` (by name, in the demo's order; a distillation recipe distills a draft model,
    evaluated last) and evaluate each at its family's default setting with the linear ``kernel``
    (:func:`choose_decode_kernel`); the results by drafter name, in the demo's order."""
    results: dict[str, dict[str, Any]] = {}
    for kind, recipe in recipes.items():
        if isinstance(recipe, Recipe):
            head_dir = _train_head(kind, target, recipe)
            results[kind] = _evaluate_head(out, kind, head_dir, target_path, prompts_file, budget, kernel)
    if "distill" in recipes:
        draft_dir = _distill(recipes["distill"])
        results["distilled draft"] = _evaluate_draft(out, draft_dir, target_path, prompts_file, budget, kernel)
    return results


# -- steps ----------------------------------------------------------------------------------------------------


def demo_recipe(name: str, run: Mapping[str, Mapping[str, Any]]) -> Recipe | DistillRecipe:
    """The demo recipe ``recipes/demo/<name>.yaml`` (shipped in the package) with the run's sections ``run``
    (paths, seed, step budget) merged over it, validated."""
    raw = safe_load_yaml((RECIPES_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
    for section, values in run.items():
        raw[section] = {**(raw.get(section) or {}), **values}
    return from_dict(recipe_schema(raw, name), raw)


def demo_recipe_sections(name: str) -> dict[str, dict[str, Any]]:
    """The sections of ``recipes/demo/<name>.yaml`` that are settings, not run paths: head or distill, and
    training."""
    raw = safe_load_yaml((RECIPES_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
    return {section: dict(raw[section]) for section in ("head", "distill", "training") if section in raw}


def _train_head(kind: str, target: Target, recipe: Recipe) -> Path:
    print(f"[demo] training {kind} ({recipe.training.max_steps} steps) -> {recipe.output.dir}", flush=True)
    head_dir, summary = train_head(recipe, target)
    print(f"[demo]   {summary['tokens_per_s']:.0f} target tokens/s", flush=True)
    return head_dir


def _distill(recipe: DistillRecipe) -> Path:
    print(f"[demo] distilling a draft model ({recipe.training.max_steps} steps) -> {recipe.output.dir}", flush=True)
    return distill_draft(recipe)[0]


def _eval_settings(budget: Any) -> EvalSettings:
    return EvalSettings(max_new_tokens=budget.max_new_tokens, repeats=budget.repeats, warmup=1)


def choose_decode_kernel(target_model: Any) -> str:
    """`auto`'s linear kernel for fp32 on CPU (what `specgraft eval` uses by default), measured once per demo on the
    target, whose layers dominate decoding: every eval, the profile and the tuning then run the same kernel."""
    return resolve_linear_kernel("auto", "cpu", "float32", target_model)


def _evaluate(out: Path, name: str, choice: DrafterChoice, target_path: Path, prompts_file: Path, budget: Any,
              kernel: str, what: str) -> dict[str, Any]:
    """``choice`` at its family's default setting (as `specgraft eval --no-tuned` drafts it), on a fresh target (the
    decoder owns its caches), with the demo's linear ``kernel`` and `auto` attention."""
    loaded = load_drafter(load_target(target_path), choice, dtype="float32", device="cpu", linear_kernel=kernel)
    print(f"[demo] evaluating {what} per domain", flush=True)
    report = evaluate(loaded, load_prompts([prompts_file]), out / "eval" / name, settings=_eval_settings(budget))
    folder = Path(choice.folder or "")
    return {"report": report, "report_dir": out / "eval" / name, "head_dir": choice.head,
            "drafter_dir": folder}


def _evaluate_head(out: Path, kind: str, head_dir: Path, target_path: Path, prompts_file: Path,
                   budget: Any, kernel: str) -> dict[str, Any]:
    return _evaluate(out, kind, DrafterChoice(head=head_dir, use_tuned=False), target_path, prompts_file, budget,
                     kernel, kind)


def _evaluate_draft(out: Path, draft_dir: Path, target_path: Path, prompts_file: Path,
                    budget: Any, kernel: str) -> dict[str, Any]:
    return _evaluate(out, "distilled", DrafterChoice(draft=str(draft_dir), use_tuned=False), target_path,
                     prompts_file, budget, kernel, "the distilled draft")


# -- tuning ---------------------------------------------------------------------------------------------------
def tune_all(out: Path, results: dict[str, dict[str, Any]], target_path: Path, prompts_file: Path,
              budget: Any, threads: int | None, kernel: str) -> dict[str, dict[str, Any]]:
    """Measure this machine's cost profile once, then tune every drafter from its default eval (the calibration)
    and evaluate it at the tuned setting; writes tuned.json beside each head/draft (exports pick it up)."""
    target = load_target(target_path)
    prompts = load_prompts([prompts_file])
    sources: dict[str, DrafterSource] = {}
    for name, result in results.items():
        if result["head_dir"] is not None:
            source = load_head_source(target, result["head_dir"], require_search=False)
            if source.kind is None:
                print(f"[demo] {name}: `specgraft tune` has no search for this family yet; it stays at its "
                      "defaults", flush=True)
                continue
            sources[name] = source
        else:
            sources[name] = load_draft_source(target, result["drafter_dir"], dtype="float32", device="cpu")
    apply_attention_kernel("auto", target.model)
    kernel = apply_linear_kernel(kernel, "cpu", "float32", target.model, *(s.module for s in sources.values()))
    kv_length = profile_kv_length(target, prompts, budget.max_new_tokens)
    print(f"[demo] measuring this machine's cost profile (KV length {kv_length})", flush=True)
    profile = measure_cost_profile(target, list(sources.values()), prompts, device="cpu", dtype="float32",
                                   threads=threads or torch.get_num_threads(), max_new_tokens=budget.max_new_tokens,
                                   kv_length=kv_length, linear_kernel=kernel,
                                   token_counts=budget.profile_token_counts, repeats=budget.profile_repeats,
                                   draft_calls=budget.draft_calls)
    profile.save(out / "cost_profile.json")
    tuned: dict[str, dict[str, Any]] = {}
    for name, source in sources.items():
        result = results[name]
        kind = str(source.kind)
        print(f"[demo] tuning {name} for this machine", flush=True)
        outcome = tune_drafter(source, prompts, out / "tune" / name.replace(" ", "_"), profile=profile,
                               settings=_eval_settings(budget),
                               calibration=(result["report"], str(result["report_dir"] / "report.json")),
                               calibration_is_default=True, linear_kernel=kernel)
        label = setting_label(kind, outcome.chosen.setting)
        if is_plain(outcome.chosen.setting):  # say what drafting would have done
            best, measured_best = outcome.fastest_drafting
            label += (f"; the best drafting setting, {setting_label(kind, best.setting)}, predicted "
                      f"{_num(best.speedup)}x, measured {_num((measured_best or {}).get('speedup_ratio_of_totals'))}x")
        tuned[name] = {"setting": label,
                       "default": setting_label(kind, outcome.default.setting) if outcome.default else
                       _drafter_label(result["report"]["drafter"]),
                       "predicted": outcome.chosen.speedup,
                       "predicted_default": outcome.default.speedup if outcome.default else None,
                       "measured": (outcome.measured.get("tuned") or {}).get("speedup_ratio_of_totals"),
                       "measured_default": (outcome.measured.get("default") or {}).get("speedup_ratio_of_totals"),
                       "tau": (outcome.measured.get("tuned") or {}).get("tau"),
                       "tau_default": (outcome.measured.get("default") or {}).get("tau"),
                       "lossless": (outcome.measured.get("tuned") or {}).get("lossless_check"),
                       "report_dir": outcome.report_dir("tuned") or out / "tune" / name.replace(" ", "_") / "tuned"}
    return tuned


def export_heads(out: Path, results: dict[str, dict[str, Any]]) -> dict[str, Path]:
    """Export the demo's heads for the engines that serve them (through :func:`export_head`, as `specgraft export`
    does); the export folders by "head -> format"."""
    exports: dict[str, Path] = {}
    for kind in results:
        if kind not in family_names():
            continue  # the distilled draft is served as a model, not exported here
        formats = [fmt for fmt in DEMO_EXPORT_FORMATS if fmt in get_family(kind).formats][:2]
        for fmt in formats:
            dest = out / "exports" / f"demo-{kind}-{fmt}"
            result = export_head(results[kind]["head_dir"], fmt, dest, report=results[kind]["report_dir"],
                                 overwrite=True)
            exports[f"{kind} -> {fmt}"] = Path(getattr(result, "path", dest))
            print(f"[demo] exported {kind} for {fmt} -> {exports[f'{kind} -> {fmt}']}", flush=True)
    return exports


# -- summary --------------------------------------------------------------------------------------------------



def write_summary(out: Path, results: dict[str, dict[str, Any]], exports: dict[str, Path], elapsed: float,
                  target_line: str, tuning: dict[str, dict[str, Any]] | None = None, *,
                  title: str, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Write summary.md, summary.png and summary.json: first each drafter's default and tuned setting with their
    measured speedups side by side, then the per-domain figures; returns the printed text and the JSON data."""
    tuning = tuning or {}
    seen = {d for r in results.values() for d in r["report"]["domains"]}
    # the corpus's order (most to least predictable by design), then anything else
    domains = [d for d in DOMAINS if d in seen] + sorted(seen - set(DOMAINS))
    headline = [_headline_row(name, result, tuning.get(name)) for name, result in results.items()]
    lines = ["# specgraft demo", "",
             f"Target: {target_line}.",
             f"Total time: {elapsed / 60:.1f} min. Every speedup is wall-clock on this CPU against plain decoding "
             "of the same target in the same process (ratio of total times); every answer is in the drafter's "
             "answers.jsonl.", "",
             "## Speedup on this machine: default and tuned settings", "",
             "Each drafter ran first at its family's default setting (sized for a GPU, where verifying many tokens "
             "costs about one forward). `specgraft tune` then measured this machine's costs (`cost_profile.json`), "
             "predicted every setting's speed from the default run's acceptance statistics, and measured the "
             "setting it chose the same way (plain and speculative decoding interleaved per prompt). The tuned "
             "setting is what `specgraft eval` and the exports use from now on (`tuned.json` beside each drafter).",
             "",
             "| drafter | default setting | tau | speedup | tuned setting | tau | speedup (predicted) | lossless "
             "(tuned) |", "|---|---|---:|---:|---|---:|---:|---|"]
    for row in headline:
        tuned = f"**{_num(row['tuned_speedup'])}x** ({_num(row['tuned_predicted'])}x)" \
            if row["tuned_setting"] else "-"
        setting = row["tuned_setting"] or "not tuned (no search for this family)"
        lines.append(f"| {row['drafter']} | {row['default_setting']} | {_num(row['default_tau'])} | "
                     f"{_num(row['default_speedup'])}x | {setting} | {_num(row['tuned_tau'])} | {tuned} | "
                     f"{str(row['tuned_lossless'] or '-').split(' (')[0]} |")
    lines += ["", "## Per domain, default settings", "",
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
    lines += ["", "## Where things are", ""]
    for name, result in results.items():
        lines.append(f"- {name}: report `{result['report_dir'] / 'report.md'}`"
                     + (f", head `{result['head_dir']}`" if result["head_dir"] else "")
                     + (f", tuned run `{tuning[name]['report_dir']}`" if name in tuning else ""))
    for name, path in exports.items():
        lines.append(f"- export {name}: `{path}`")
    lines += [f"- {note}" for note in notes]
    plot = _plot(out, results, tuning, headline, domains, title)
    if plot is not None:
        lines += ["", f"![default and tuned speedups, tuned speedup per domain]({plot.name})"]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "summary.md", text)
    data = {"elapsed_s": elapsed, "headline": headline,
            "rows": [dict(zip(("drafter", "domain", "tau", "speedup_mean_of_ratios",
                               "speedup_ratio_of_totals", "lossless"), r)) for r in table],
            "exports": {k: str(v) for k, v in exports.items()},
            "tuning": {k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()}
                       for k, v in tuning.items()}}
    atomic_write_json(out / "summary.json", data)
    printed = text + f"\nsummary: {out / 'summary.md'}" + (f"\nplot: {plot}" if plot else "")
    return {"text": printed, **data}


def _headline_row(name: str, result: dict[str, Any], tuned: dict[str, Any] | None) -> dict[str, Any]:
    """One drafter's default and tuned setting with their measured tau and speedup (overall)."""
    overall = result["report"]["overall"]
    tuned = tuned or {}
    return {"drafter": name,
            "default_setting": tuned.get("default") or _drafter_label(result["report"]["drafter"]),
            "default_tau": tuned.get("tau_default", overall.get("tau")),
            "default_speedup": tuned.get("measured_default", overall.get("speedup_ratio_of_totals")),
            "tuned_setting": tuned.get("setting"), "tuned_tau": tuned.get("tau"),
            "tuned_speedup": tuned.get("measured"), "tuned_predicted": tuned.get("predicted"),
            "tuned_lossless": tuned.get("lossless")}


def _drafter_label(drafter: dict[str, Any]) -> str:
    """A setting as report.json's ``drafter`` section records it: ``tree of 64 tokens, depth 2`` / ``chain of 4``."""
    if drafter.get("mode") == "chain":
        return f"chain of {drafter.get('k')}"
    label = f"tree of {drafter.get('tree_size')} tokens, depth {drafter.get('k')}"
    return label + (f", top-{drafter['top_k']}" if drafter.get("top_k") else "")


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def _tuned_domains(tuned: dict[str, Any] | None) -> dict[str, Any] | None:
    """The per-domain figures of a drafter's tuned run (its report.json), or None when it has none."""
    report = Path(tuned["report_dir"]) / "report.json" if tuned and tuned.get("report_dir") else None
    if report is None or not report.is_file():
        return None
    return json.loads(report.read_text(encoding="utf-8")).get("domains")


def _plot(out: Path, results: dict[str, dict[str, Any]], tuning: dict[str, dict[str, Any]],
          headline: list[dict[str, Any]], domains: list[str], title: str) -> Path | None:
    """summary.png: overall speedup at the default and the tuned setting per drafter (left), and the speedup per
    domain at the setting the drafter now uses (right: the tuned one, or the default when it was not tuned)."""
    if not results or not domains:
        return None
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (overall_ax, domain_ax) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    xs = range(len(headline))
    highest = 1.0
    for offset, key, label, color in ((-0.2, "default_speedup", "default setting", "#b0b0b0"),
                                      (0.2, "tuned_speedup", "tuned for this machine", "#2b7bba")):
        values = [float(row[key]) if isinstance(row[key], (int, float)) else 0.0 for row in headline]
        highest = max(highest, *values)
        bars = overall_ax.bar([x + offset for x in xs], values, 0.4, label=label, color=color)
        overall_ax.bar_label(bars, labels=[f"{v:.2f}x" if v else "" for v in values], fontsize=8)
    # the plain-decoding choice reads "plain decoding (no drafting); the best drafting setting, ...": keep its head
    tuned = [(row["tuned_setting"] or "not tuned").split(";")[0].replace(" (no drafting)", "") for row in headline]
    ticks = [f"{row['drafter']}\n" + textwrap.fill(f"default: {row['default_setting']}", 20) + "\n"
             + textwrap.fill(f"tuned: {setting}", 20) for row, setting in zip(headline, tuned)]
    overall_ax.set_xticks(list(xs), ticks, fontsize=7)
    overall_ax.set_ylim(0, highest * 1.3)  # room for the legend above the bars
    overall_ax.set_ylabel("speedup vs plain decoding (overall)")
    overall_ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    overall_ax.legend(fontsize=8, loc="upper left", ncol=2)

    names = list(results)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        per_domain = _tuned_domains(tuning.get(name)) or results[name]["report"]["domains"]
        values = [float((per_domain.get(d) or {}).get("speedup_ratio_of_totals") or 0.0) for d in domains]
        positions = [j + (i - (len(names) - 1) / 2) * width for j in range(len(domains))]
        bars = domain_ax.bar(positions, values, width, label=name)
        domain_ax.bar_label(bars, fmt="%.2f", fontsize=7)
    domain_ax.set_xticks(range(len(domains)), domains)
    domain_ax.set_ylabel("speedup per domain, tuned setting\n(the best drafting one where plain was chosen)")
    domain_ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    domain_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "summary.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
