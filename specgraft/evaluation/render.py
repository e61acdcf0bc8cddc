"""Renderers of an evaluation report (see :mod:`specgraft.evaluation.report`, which runs the evaluation and writes
report.json): ``report.md`` (:func:`render_markdown`) and the plots (:func:`write_plots`). They read only the
report dict, so a report.json can be re-rendered without re-running anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgraft.utils.io import atomic_path

#: File of the per-prompt answers in the report folder (written with the report, named in report.md).
ANSWERS_JSONL = "answers.jsonl"
#: Plot key in report.json -> file name in the report folder.
PLOTS = {"tau_by_domain": "tau_by_domain.png", "acceptance_by_depth": "acceptance_by_depth.png",
         "speedup_by_domain": "speedup_by_domain.png"}
#: Key of the all-domains metrics in report.json.
OVERALL = "overall"
#: Plot size (inches; bar charts widen by PLOT_WIDTH_PER_BAR per domain beyond PLOT_MIN_BARS) and resolution.
PLOT_SIZE = (8.0, 4.5)
PLOT_WIDTH_PER_BAR = 0.75
PLOT_MIN_BARS = 8
PLOT_DPI = 120


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _lossless_cell(values: dict[str, Any]) -> str:
    passed = values.get("lossless_passed")
    if passed is None:
        return "n/a (sampling)"
    counts = f"{values.get('lossless_identical')}/{values.get('lossless_checked')}"
    if not passed and values.get("lossless_up_to_rounding"):
        return f"up to rounding ({counts} identical)"
    return f"{'passed' if passed else 'FAILED'} {counts}"


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: settings, then one table with a row per domain and the overall row."""
    s, d, t = report.get("settings", {}), report.get("drafter", {}), report.get("target", {})
    extra = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("type", "path", "mode") and v is not None)
    lines = [
        "# Speculative decoding evaluation",
        "",
        f"- target: `{t.get('name_or_path')}` ({t.get('architecture')}, {t.get('num_hidden_layers')} layers, "
        f"vocab {t.get('vocab_size')})",
        f"- drafter: {d.get('type')} ({d.get('mode')}{', ' + extra if extra else ''})"
        + (f", `{d.get('path')}`" if d.get("path") else ""),
        f"- decoding: temperature {s.get('temperature')}, top_p {s.get('top_p')}, top_k {s.get('top_k')}, "
        f"max_new_tokens {s.get('max_new_tokens')}, seed {s.get('seed')}"
        + (", ignore EOS" if s.get("ignore_eos") else ""),
        f"- verification: {'LOSSY' if s.get('lossy') else 'lossless'}; prompts rendered as "
        f"{report.get('prompt_format', 'text')}",
        f"- timing: baseline = plain decoding of the same target in the same process; {s.get('warmup')} warm-up "
        f"run(s), baseline and speculative interleaved per turn, median of {s.get('repeats')} repeat(s)",
        _baseline_line(report),
        "",
        "| domain | prompts | tau | alpha_exact | acceptance by depth | tok/s spec | tok/s base | speedup (mean of "
        "ratios) | speedup (ratio of totals) | speedup/tau | lossless |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    rows = list((report.get("domains") or {}).items())
    if report.get(OVERALL):
        rows.append(("**overall**", report[OVERALL]))
    for name, v in rows:
        depth = " ".join(_fmt(x, 2) for x in v.get("acceptance_by_depth") or []) or "-"
        lines.append(
            f"| {name} | {_fmt(v.get('num_prompts'))} | {_fmt(v.get('tau'))} | {_fmt(v.get('alpha_exact'), 3)} | "
            f"{depth} | {_fmt(v.get('tokens_per_s'), 1)} | {_fmt(v.get('baseline_tokens_per_s'), 1)} | "
            f"{_fmt(v.get('speedup_mean_of_ratios'))}x | {_fmt(v.get('speedup_ratio_of_totals'))}x | "
            f"{_fmt(v.get('speedup_over_tau'))} | {_lossless_cell(v)} |")
    overall = report.get(OVERALL) or {}
    lines += ["", f"Lossless check: {overall.get('lossless_check', '-')}.", ""]
    lines += ["tau = mean over verification steps of (accepted drafts + 1). Acceptance by depth d = P(a depth-d "
              "draft is accepted | the path reached depth d-1). speedup/tau uses the ratio of totals: 1.0 would mean "
              "drafting and verifying cost no more than one plain decoding step.", ""]
    skipped = report.get("skipped_turns") or []
    if skipped:
        lines += [f"{len(skipped)} conversation(s) stopped early: a later turn with its history exceeded the "
                  "target's context.", ""]
    for key, file in (report.get("plots") or {}).items():
        lines += [f"![{key.replace('_', ' ')}]({file})", ""]
    lines.append(f"Answers: `{report.get('answers', ANSWERS_JSONL)}` (one line per prompt and turn).")
    return "\n".join(lines) + "\n"


def _baseline_line(report: dict[str, Any]) -> str:
    """Which plain decoding the speedups are against, and the kernels' own effect on plain decoding."""
    overall = report.get(OVERALL) or {}
    kernels = (report.get("measurement") or {}).get("kernels", "stock")
    chosen = overall.get("baseline_kernels", "stock")
    line = (f"- baseline kernels: {'stock (the model’s own attention, nn.Linear)' if chosen == 'stock' else chosen}; "
            f"plain decoding with the stock kernels took {_fmt(overall.get('plain_stock_s'), 2)} s "
            f"({_fmt(overall.get('plain_stock_tokens_per_s'), 1)} tok/s)")
    if kernels != "stock" and overall.get("plain_kernel_s") is not None:
        line += (f", with the eval's kernels ({kernels}) {_fmt(overall.get('plain_kernel_s'), 2)} s "
                 f"({_fmt(overall.get('plain_kernel_over_stock'))}x the stock time); speedup against stock plain "
                 f"decoding {_fmt(overall.get('speedup_vs_stock_ratio_of_totals'))}x (ratio of totals)")
    return line


# -- plots ----------------------------------------------------------------------------------------------------------
def _value(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else float("nan")


def _save(fig: Any, path: Path) -> None:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=PLOT_DPI)


def _bar_labels(ax: Any, bars: Any, values: Sequence[float], fmt: str, fontsize: float = 8) -> None:
    for bar, v in zip(bars, values):
        label = fmt.format(v) if math.isfinite(v) else "n/a"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height() if math.isfinite(v) else 0),
                    ha="center", va="bottom", fontsize=fontsize, xytext=(0, 2), textcoords="offset points")


def _title(report: dict[str, Any], what: str) -> str:
    d = report.get("drafter", {})
    name = str((report.get("target") or {}).get("name_or_path", ""))
    short = name.rstrip("/").rsplit("/", 1)[-1] if name else "target"
    return f"{what}: {d.get('type')} drafter ({d.get('mode')}) on {short}"


def write_plots(report: dict[str, Any], out_dir: Path) -> None:
    """tau_by_domain.png, acceptance_by_depth.png and speedup_by_domain.png (matplotlib, no pyplot state)."""
    import matplotlib
    from matplotlib.figure import Figure

    domains_ = list((report.get("domains") or {}).items())
    rows = domains_ + ([("overall", report[OVERALL])] if report.get(OVERALL) else [])
    names = [n for n, _ in rows]
    colors = ["tab:blue"] * len(domains_) + ["tab:gray"] * (len(rows) - len(domains_))
    rotate = 30 if len(names) > 4 else 0
    ha = "right" if rotate else "center"
    bar_size = (PLOT_SIZE[0] + PLOT_WIDTH_PER_BAR * max(0, len(names) - PLOT_MIN_BARS), PLOT_SIZE[1])
    label_size = 8 if len(names) <= PLOT_MIN_BARS else 6.5

    # tau by domain
    fig = Figure(figsize=bar_size, layout="constrained")
    ax = fig.add_subplot()
    taus = [_value(v.get("tau")) for _, v in rows]
    bars = ax.bar(names, [0.0 if math.isnan(x) else x for x in taus], color=colors)
    _bar_labels(ax, bars, taus, "{:.2f}", label_size)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.annotate("1 = no draft accepted", (0, 1.0), xycoords=("axes fraction", "data"), xytext=(4, 3),
                textcoords="offset points", fontsize=7)
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_ylim(0, max([x for x in taus if math.isfinite(x)] + [1.0]) * 1.15)
    ax.set_title(_title(report, "tau by domain"), fontsize=10)
    ax.tick_params(axis="x", labelrotation=rotate)
    for label in ax.get_xticklabels():
        label.set_ha(ha)
    _save(fig, out_dir / PLOTS["tau_by_domain"])

    # acceptance by depth
    fig = Figure(figsize=PLOT_SIZE, layout="constrained")
    ax = fig.add_subplot()
    max_depth = 0
    # tab10 repeats colours after ten lines; tab20 keeps up to twenty domains apart.
    palette = matplotlib.colormaps["tab10" if len(domains_) <= 10 else "tab20"]
    for index, (name, v) in enumerate(rows):
        rates = [_value(x) for x in v.get("acceptance_by_depth") or []]
        if not rates:
            continue
        max_depth = max(max_depth, len(rates))
        depth = list(range(1, len(rates) + 1))
        if name == "overall":
            ax.plot(depth, rates, color="black", linewidth=2.5, marker="o", label="overall", zorder=3)
        else:
            ax.plot(depth, rates, linewidth=1.2, marker=".", alpha=0.8, label=name, color=palette(index % palette.N))
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate (given the parent was accepted)")
    ax.set_ylim(0, 1.05)
    if max_depth:
        ax.set_xticks(list(range(1, max_depth + 1)))
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    else:
        ax.text(0.5, 0.5, "no drafts were verified", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(_title(report, "acceptance by depth"), fontsize=10)
    _save(fig, out_dir / PLOTS["acceptance_by_depth"])

    # speedup by domain
    fig = Figure(figsize=bar_size, layout="constrained")
    ax = fig.add_subplot()
    width = 0.4
    xs = list(range(len(names)))
    mean_r = [_value(v.get("speedup_mean_of_ratios")) for _, v in rows]
    totals = [_value(v.get("speedup_ratio_of_totals")) for _, v in rows]
    b1 = ax.bar([x - width / 2 for x in xs], [0.0 if math.isnan(x) else x for x in mean_r], width,
                label="mean of per-prompt ratios", color="tab:orange")
    b2 = ax.bar([x + width / 2 for x in xs], [0.0 if math.isnan(x) else x for x in totals], width,
                label="ratio of totals", color="tab:green")
    _bar_labels(ax, b1, mean_r, "{:.2f}", label_size)
    _bar_labels(ax, b2, totals, "{:.2f}", label_size)
    for bars_ in (b1, b2):
        for bar in list(bars_)[len(domains_):]:
            bar.set_hatch("//")  # the overall pair stands apart from the domains
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="no speedup")
    ax.set_xticks(xs, names)
    ax.tick_params(axis="x", labelrotation=rotate)
    for label in ax.get_xticklabels():
        label.set_ha(ha)
    ax.set_ylabel("speedup over plain decoding (x)")
    ax.set_ylim(0, max([x for x in mean_r + totals if math.isfinite(x)] + [1.0]) * 1.2)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(_title(report, "wall-clock speedup by domain"), fontsize=10)
    _save(fig, out_dir / PLOTS["speedup_by_domain"])
