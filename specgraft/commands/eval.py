"""``specgraft eval``: its arguments, and the command as a call of :mod:`specgraft.pipeline.evaluate`.

``specgraft eval --target PATH (--head DIR | --draft DIR | --drafter self|random) --prompts FILE... --out DIR``
decodes every prompt with the drafter and with plain decoding of the same target (the baseline), groups the
results by domain and writes report.json, report.md, answers.jsonl and three PNG plots into ``--out`` (see
:mod:`specgraft.evaluation.report`): a new or empty folder (``--overwrite`` replaces an earlier report), locked
while the run writes so that two evals cannot mix their files. The drafters and their settings:
:mod:`specgraft.pipeline.evaluate`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specgraft.commands.flags import add_attention_kernel_argument, add_linear_kernel_argument
from specgraft.evaluation.settings import BUILTIN_DRAFTERS, DEFAULT_K, EvalSettings
from specgraft.utils.args import int_list
from specgraft.utils.threads import add_threads_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft eval``."""
    parser.add_argument("--target", required=True, help="target model: a transformers folder or Hub id")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--head", type=Path, help="trained head folder (medusa, eagle or eagle3)")
    which.add_argument("--draft", help="draft model folder (same vocabulary and tokenizer as the target)")
    which.add_argument("--drafter", choices=BUILTIN_DRAFTERS, help="built-in drafter: self or random")
    parser.add_argument("--prompts", nargs="+", required=True, type=Path,
                        help="prompt files: FastChat question.jsonl, HumanEval .jsonl.gz, GSM8K, self-instruct or "
                             "any JSONL with a prompt and a domain field")
    parser.add_argument("--out", type=Path, required=True, help="output folder for the report (must be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace the report in a non-empty --out folder")
    parser.add_argument("--domain-field", help="JSON field that names each prompt's domain")
    parser.add_argument("--prompt-field", help="JSON field holding the prompt text (reads files as generic JSONL)")
    parser.add_argument("--limit-per-domain", type=int, help="evaluate only the first N prompts of each domain")
    parser.add_argument("--k", type=int, help=f"draft depth (default {DEFAULT_K} for self/random/--draft, the "
                                              "number of heads for Medusa, 6 for EAGLE)")
    parser.add_argument("--mode", choices=("tree", "chain"),
                        help="draft a tree or a chain (default: tree for heads, chain otherwise)")
    parser.add_argument("--tree-size", type=int,
                        help="tokens verified per step including the root, for head trees (Medusa 64, EAGLE 60)")
    parser.add_argument("--branching", type=int_list,
                        help="children per level for --draft/self trees, e.g. 2,2 (default 2,2 with --mode tree)")
    parser.add_argument("--eagle-top-k", type=int, help="EAGLE-2 tree: children per node and nodes expanded "
                                                        "per depth (default 10)")
    parser.add_argument("--no-tuned", action="store_true",
                        help="ignore the head's/draft's tuned.json (`specgraft tune`) and use the defaults")
    d = EvalSettings()  # the defaults live in the typed settings, saved in every report.json
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help=f"tokens generated per turn at most (default {d.max_new_tokens})")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help=f"0 = greedy (default {d.temperature:g})")
    parser.add_argument("--top-p", type=float, default=d.top_p,
                        help=f"nucleus sampling mass in (0, 1] (default {d.top_p:g})")
    parser.add_argument("--top-k", type=int, default=d.top_k,
                        help=f"sample among the k most likely tokens (0 = all; default {d.top_k})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed of the sampling draws (default {d.seed})")
    parser.add_argument("--repeats", type=int, default=d.repeats,
                        help=f"timed runs per turn; the median counts (default {d.repeats})")
    parser.add_argument("--warmup", type=int, default=d.warmup,
                        help=f"untimed warm-up runs before measuring (default {d.warmup})")
    parser.add_argument("--ignore-eos", action="store_true", help="never stop at EOS (fixed-length runs)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_linear_kernel_argument(parser)
    add_attention_kernel_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Validate the inputs (cheap checks first), load target, drafter and prompts, evaluate, print the table."""
    from specgraft.evaluation.loading import device_and_dtype
    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.report import REPORT_JSON, REPORT_MD
    from specgraft.pipeline.evaluate import DrafterChoice, evaluate, load_drafter
    from specgraft.target import load_target
    from specgraft.utils.outputs import check_output, writing_output

    settings = EvalSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, repeats=args.repeats, warmup=args.warmup,
                            ignore_eos=args.ignore_eos)
    settings.validate()
    inputs = [args.target, args.head, args.draft, *args.prompts]  # an --out containing one is refused
    check_output(args.out, "eval", overwrite=args.overwrite, inputs=inputs)  # before the slow part
    prompts = load_prompts(args.prompts, domain_field=args.domain_field, prompt_field=args.prompt_field,
                           limit_per_domain=args.limit_per_domain)
    device, dtype = device_and_dtype(args.device, args.dtype, args.threads)
    target = load_target(args.target, dtype=dtype, device=device)
    choice = DrafterChoice(head=args.head, draft=args.draft, builtin=args.drafter, k=args.k, mode=args.mode,
                           tree_size=args.tree_size, branching=args.branching, eagle_top_k=args.eagle_top_k,
                           use_tuned=not args.no_tuned)
    loaded = load_drafter(target, choice, dtype=dtype, device=device, linear_kernel=args.linear_kernel,
                          attention_kernel=args.attention_kernel)
    # Checked again under the lock: another run may have finished into it while this one loaded.
    with writing_output(args.out, "eval", overwrite=args.overwrite, inputs=inputs, clear=True):
        report = evaluate(loaded, prompts, args.out, settings=settings, progress=not args.no_progress)
    print_summary(report)
    print(f"wrote {args.out / REPORT_JSON}, {args.out / REPORT_MD}, answers and plots to {args.out}")
    return 0


def print_summary(report: dict[str, Any]) -> None:
    """The report's per-domain table and its lossless check."""
    from specgraft.evaluation.report import render_markdown

    table = [line for line in render_markdown(report).splitlines() if line.startswith("|")]
    print("\n".join(table))
    overall = report.get("overall") or {}
    print(f"lossless check: {overall.get('lossless_check')}")
