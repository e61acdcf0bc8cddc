"""Speculative-decoder overhead on stories260K: greedy tau, tokens/s, wall speedup and speedup/tau.

Target: the llama2.c stories260K model (converted with ``specgraft.llama2c.convert_llama2c``). Prompts: the first
sentence of the last ``--prompts`` paragraphs of ``tinystories_train.txt`` (held out from the head of the file that
training uses). Methods, all greedy and all checked token-for-token against plain decoding:

* ``plain``: the decoder with no drafter (the baseline; same code path, same token counting);
* ``self-k4``: SelfDrafter(k=4), the target drafting for itself: tau = 5 by construction, and each step costs 4 draft
  forwards + 1 verification forward, so the forward-count model predicts speedup = tau / (k c + 1) = 1 (c = 1);
  the measured speedup divided by that prediction is the decoder's efficiency (1 = no overhead);
* ``draft-k4``: DraftModelDrafter(--draft, k=4), a separate small draft model (only with ``--draft PATH``).

All methods run in one process after a warm-up; each repeat runs every method on every prompt (interleaved, so
drift hits all alike) and the per-prompt time is the median over repeats.

    python benchmarks/bench_decoder_overhead.py
    python benchmarks/bench_decoder_overhead.py --draft runs/draft/final --max-new-tokens 200 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specgraft.eval import metrics
from specgraft.eval.decoder import GenerationResult, SpeculativeDecoder
from specgraft.eval.drafters import DraftModelDrafter, SelfDrafter
from specgraft.utils.io import atomic_write_json

SHARED = Path(os.environ.get("SPECGRAFT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
K = 4


def held_out_prompts(path: Path, count: int) -> list[str]:
    """First sentence of each of the last ``count`` paragraphs (blank-line separated) of a TinyStories file."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if p.strip()]
    prompts = []
    for para in reversed(paragraphs):
        match = re.match(r"(.+?[.!?])(\s|$)", " ".join(para.split()))
        if match:
            prompts.append(match.group(1))
        if len(prompts) == count:
            break
    return prompts[::-1]


def forward_cost(model, length: int, repeats: int, device: torch.device) -> float:
    """Seconds of one single-token forward with ``length`` cached tokens (decoding cost); the minimum over
    ``repeats`` runs, which is the least noisy estimate on a shared machine."""
    from specgraft.eval import kv

    ids = torch.randint(3, 100, (1, length + 1), device=device)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            cache = kv.new_cache()
            model(input_ids=ids[:, :length], cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(input_ids=ids[:, length:], cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stories-dir", type=Path, default=SHARED / "models" / "stories260K",
                        help="folder with stories260K.bin and tok512.bin")
    parser.add_argument("--tinystories", type=Path, default=SHARED / "tinystories" / "tinystories_train.txt")
    parser.add_argument("--draft", type=Path, help="a transformers draft model folder with the same vocab")
    parser.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models: 1 is fastest)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    from specgraft.llama2c import convert_llama2c

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    prompts = held_out_prompts(args.tinystories, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = convert_llama2c(args.stories_dir / "stories260K.bin", args.stories_dir / "tok512.bin",
                                 Path(tmp) / "stories260K")
        target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        tok = AutoTokenizer.from_pretrained(folder)

    methods: dict[str, SpeculativeDecoder] = {"plain": SpeculativeDecoder(target, tok)}
    methods[f"self-k{K}"] = SpeculativeDecoder(target, tok, drafter=SelfDrafter(k=K))
    cost = {"plain": 0.0, f"self-k{K}": 1.0}
    if args.draft is not None:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).to(device).eval()
        draft_tok = AutoTokenizer.from_pretrained(args.draft) if (args.draft / "tokenizer_config.json").exists() \
            else None
        methods[f"draft-k{K}"] = SpeculativeDecoder(target, tok, drafter=DraftModelDrafter(draft, k=K,
                                                                                           tokenizer=draft_tok))
        mid = min(64, target.config.max_position_embeddings // 2)
        cost[f"draft-k{K}"] = forward_cost(draft, mid, 100, device) / forward_cost(target, mid, 100, device)

    for dec in methods.values():  # warm-up
        dec.generate(prompts[0], 16)
    runs: dict[str, list[list[GenerationResult]]] = {name: [[] for _ in prompts] for name in methods}
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, dec in methods.items():
                runs[name][i].append(dec.generate(prompt, args.max_new_tokens))

    baseline = [(r[0].num_new_tokens, statistics.median(x.wall_time_s for x in r)) for r in runs["plain"]]
    rows, lossless = [], True
    for name, per_prompt in runs.items():
        first = [r[0] for r in per_prompt]
        lossless &= all(a.generated_ids == b[0].generated_ids for a, b in zip(first, runs["plain"]))
        timed = [(r[0].num_new_tokens, statistics.median(x.wall_time_s for x in r)) for r in per_prompt]
        summary = metrics.summarize(first)
        sp = metrics.speedup(baseline, timed)
        tau = summary["tau"]
        predicted = metrics.simulated_speedup(tau, K, cost[name]) if name != "plain" else 1.0
        rows.append({
            "method": name, "tau": tau, "tokens": sum(t for t, _ in timed),
            "tokens_per_s": sum(t for t, _ in timed) / sum(s for _, s in timed),
            "speedup_mean_of_ratios": sp["mean_of_ratios"], "speedup_ratio_of_totals": sp["ratio_of_totals"],
            "speedup_per_tau": sp["ratio_of_totals"] / tau, "cost_ratio_c": cost[name],
            "predicted_speedup": predicted, "efficiency": sp["ratio_of_totals"] / predicted,
            "target_forwards_per_token": summary["target_forwards"] / max(summary["new_tokens"], 1),
            "acceptance_by_depth": summary["acceptance_by_depth"],
        })

    print(f"stories260K on {device} ({args.threads} thread(s)), {len(prompts)} held-out prompts, "
          f"max_new_tokens={args.max_new_tokens}, {args.repeats} repeats (median time per prompt), greedy")
    header = (f"{'method':<10} {'tau':>5} {'tok/s':>8} {'speedup':>8} {'(totals)':>8} {'spd/tau':>8} {'c':>5} "
              f"{'pred.':>6} {'effic.':>6} {'fwd/tok':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['method']:<10} {r['tau']:>5.2f} {r['tokens_per_s']:>8.1f} {r['speedup_mean_of_ratios']:>8.3f} "
              f"{r['speedup_ratio_of_totals']:>8.3f} {r['speedup_per_tau']:>8.3f} {r['cost_ratio_c']:>5.2f} "
              f"{r['predicted_speedup']:>6.3f} {r['efficiency']:>6.3f} {r['target_forwards_per_token']:>7.3f}")
    print("speedup = mean of per-prompt tokens/s ratios vs plain; (totals) = ratio of total tokens/s; "
          "pred. = tau / (k c + 1); effic. = speedup(totals) / pred.")
    print(f"lossless (every method's tokens == plain greedy): {lossless}")
    if args.draft is None:
        print(f"draft-k{K}: not run (no --draft PATH given; pass a transformers draft model folder with the "
              "target's 512-token vocabulary)")
    if args.json:
        atomic_write_json(args.json, {"device": str(device), "threads": args.threads, "prompts": prompts,
                                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                                      "lossless": lossless, "rows": rows, "draft": str(args.draft or "")})
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
