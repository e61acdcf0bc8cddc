"""``specgraft regenerate``: its arguments, and the command as a call of
:func:`specgraft.data.regenerate.regenerate`."""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.utils.args import DTYPE_NAMES
from specgraft.utils.outputs import file_lock, refuse_inputs
from specgraft.utils.threads import add_threads_argument, set_torch_threads


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


def _check_out_path(out: Path, inputs: list[Any]) -> None:
    """``--out`` must be a new file (no input), or the output of an unfinished run (its ``.parts`` folder
    exists)."""
    refuse_inputs(out, inputs)
    if out.is_dir():
        raise SpecgraftError(f"--out {out} is a folder; pass the path of the JSONL file to write")
    if out.exists() and not out.with_name(out.name + ".parts").exists():
        raise SpecgraftError(f"--out {out} exists already (a finished regeneration, or another file); delete it or "
                             "choose another --out")


def run(args: argparse.Namespace) -> int:
    """``specgraft regenerate``: load the target and the data, regenerate, report throughput."""
    from specgraft.data.regenerate import partial_state

    set_torch_threads(args.threads)
    for name in ("batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SpecgraftError(f"--{name.replace('_', '-')} is {getattr(args, name)}; use a positive number")
    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1:  # `not` form: NaN fails too
        raise SpecgraftError("--temperature must be a finite number >= 0 and --top-p in (0, 1]; fix the arguments")
    _check_out_path(Path(args.out), [args.model, args.data])
    if args.num_samples is not None and args.num_samples < 1:
        raise SpecgraftError(f"--num-samples is {args.num_samples}; use a positive count")
    state = partial_state()
    # One regeneration per --out at a time (two would each find the other's parts "damaged"); the processes of
    # a multi-process launch share one output and coordinate through its parts.
    out = Path(args.out)
    lock = (file_lock(out, "regenerate", keep=out.with_name(out.name + ".parts")) if state.num_processes == 1
            else contextlib.nullcontext())
    with lock:
        return _regenerate(args, state)


def _regenerate(args: argparse.Namespace, state: Any) -> int:
    from specgraft.data.readers import is_conversations, load_records, subsample
    from specgraft.data.regenerate import generation_dtype, regenerate
    from specgraft.target import load_target

    _check_out_path(Path(args.out), [args.model, args.data])  # again, under the lock
    target = load_target(args.model, dtype=generation_dtype(args.dtype, state.device), device=state.device,
                         flag="--model")
    model, tokenizer = target.model, target.tokenizer
    with state.main_process_first():
        records = load_records(args.data, args.format)
    if not is_conversations(records):
        raise SpecgraftError(f"{args.data} holds plain text; regenerate needs conversations (ShareGPT or messages)")
    records = subsample(records, args.num_samples, args.seed)
    stats = regenerate(
        model,
        tokenizer,
        records,
        args.out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        use_chat_template=not args.no_chat_template,
        system_prompt=args.system_prompt,
        first_reply_only=args.first_reply_only,
        show_progress=not args.no_progress,
        settings={"data": str(Path(args.data).resolve()), "format": args.format, "num_samples": args.num_samples},
    )
    if state.is_main_process:
        print(stats.summary())
        print(f"wrote {args.out}")
    # Tear gloo/NCCL down before interpreter exit: leftover communicator threads can abort the process.
    state.destroy_process_group()
    return 0
