"""`specgraft eval` on the real stories260K target with held-out TinyStories prompts, grouped in three domains.

Builds, in a scratch folder, (1) the transformers copy of llama2.c stories260K (``convert_llama2c``) and (2) a JSONL
prompt file from the LAST paragraphs of ``tinystories_train.txt`` (held out from the head of the file that training
uses): the first sentence of each paragraph (line) is a prompt, in domain ``once_upon`` (it starts with "Once upon a
time"), ``dialogue`` (it starts with a quote) or ``narrative`` (anything else). Then runs the real command line::

    specgraft eval --target <stories260K> --drafter self --k 4 --prompts <prompts.jsonl> --out <out>

and prints the per-domain table (tau, speedup, draft and verification cost per step: the decoder's end-to-end
efficiency; ``benchmarks/bench_decoder_overhead.py`` measures its loop overhead alone). ``--draft DIR`` evaluates a
draft model with stories260K's vocabulary instead. stories260K has no chat template, so prompts are plain text + BOS.

    python benchmarks/bench_eval_stories.py --out /tmp/eval_stories
    python benchmarks/bench_eval_stories.py --out /tmp/eval_stories --per-domain 10 --max-new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchlib.results import add_result_arguments, write_result
from benchlib.stages import eval_figures
from benchlib.stories import TINYSTORIES, held_out_prompts, require_shared_data, stories260k_target, write_jsonl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="scratch folder (model, prompts, report)")
    parser.add_argument("--per-domain", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a tiny model gains nothing)")
    parser.add_argument("--drafter", default="self", help="self or random (or use the CLI directly for heads)")
    parser.add_argument("--draft", type=Path, help="a draft model folder with stories260K's vocabulary instead of "
                                                   "--drafter")
    add_result_arguments(parser, "eval-stories260k")
    args = parser.parse_args()

    require_shared_data(TINYSTORIES)
    from specgraft.cli import main as cli_main

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = stories260k_target(args.out / "stories260K")
    prompts = write_jsonl(held_out_prompts(TINYSTORIES, args.per_domain), args.out / "tinystories_prompts.jsonl")
    print(f"{len(prompts.read_text(encoding='utf-8').splitlines())} prompts in {prompts}")
    which = ["--draft", str(args.draft)] if args.draft is not None else ["--drafter", args.drafter]
    code = cli_main(["eval", "--target", str(model_dir), *which, "--k", str(args.k),
                     "--prompts", str(prompts), "--out", str(args.out / "report"),
                     "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats), "--warmup", "2",
                     "--device", "cpu", "--threads", str(args.threads)])
    if code != 0:
        return code
    report = json.loads((args.out / "report" / "report.json").read_text(encoding="utf-8"))
    sections = [*report["domains"].items(), ("overall", report["overall"])]
    drafter = f"{args.draft or args.drafter} k={args.k}"
    write_result(args.result_name,
                 [{"drafter": drafter, "domain": domain, **eval_figures(d)} for domain, d in sections],
                 title=f"`specgraft eval` on stories260K, {'a draft model' if args.draft else args.drafter} "
                       "drafter, held-out TinyStories prompts",
                 dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 details={"max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                          "prompts_per_domain": args.per_domain})
    return 0


if __name__ == "__main__":
    sys.exit(main())
