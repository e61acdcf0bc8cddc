"""``specgraft regenerate``'s arguments; the command is :func:`specgraft.data.regenerate.run`."""

from __future__ import annotations

import argparse

from specgraft.utils.args import DTYPE_NAMES
from specgraft.utils.threads import add_threads_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft regenerate``."""
    parser.add_argument("--model", required=True, help="Target model: a local folder (save_pretrained) or Hub id.")
    parser.add_argument("--data", required=True, help="Conversations: ShareGPT/messages JSON(L), or a saved dataset.")
    parser.add_argument("--out", required=True, help="Output JSONL file (resumable: rerun the same command).")
    parser.add_argument("--format", default="auto", choices=("auto", "sharegpt", "messages", "disk"),
                        help="Input format (default: detected).")
    parser.add_argument("--batch-size", type=int, default=8, help="Conversations generated together (default 8).")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="Longest reply in tokens (default 512).")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples.")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass when sampling (default 1).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for --num-samples selection and sampling.")
    parser.add_argument("--num-samples", type=int, default=None, help="Regenerate only this many (seeded) rows.")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES),
                        help="Weights dtype (auto: bfloat16 on a GPU that supports it, float32 otherwise).")
    parser.add_argument("--system-prompt", default=None, help="Prepended as a system turn where none exists.")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="Use plain User:/Assistant: lines even if the tokenizer has a chat template.")
    parser.add_argument("--first-reply-only", action="store_true",
                        help="Rewrite only each conversation's first assistant reply and drop the turns after it "
                             "(they answered the old reply); one generation per conversation instead of one per turn.")
    parser.add_argument("--no-progress", action="store_true",
                        help="Hide the progress bar (per-batch timings still show with `specgraft -v`).")
    add_threads_argument(parser)


def run(args: argparse.Namespace) -> int:
    """The command itself, in :mod:`specgraft.data.regenerate` (imported only now: it loads torch)."""
    from specgraft.data.regenerate import run as regenerate

    return regenerate(args)
