"""What one drafting call of a trained head costs, in target forwards, timed as decoding runs it.

For each setting, ``propose`` + ``accept`` (a one-pair catch-up, then the setting's draft) is timed interleaved with
the target's one-token forward on the same KV length, and the ratio of the sums is printed: load drift between the
two cancels. Each setting is timed twice: back to back (the drafter's weights and activations stay in the CPU's
caches) and right after a target forward (as in decoding, and as ``specgraft profile`` now times it).

    python benchmarks/bench_draft_call.py --head runs/demo/eagle3/head \
        --settings '{"mode": "chain", "depth": 1}' '{"mode": "chain", "depth": 3}'
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_draft_call.py ...   # compare two versions

The target is the head's own (``head.target`` after loading onto ``--target``, default the embedded demo target).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from benchlib.results import add_result_arguments, write_result

from specgraft.decoding import kv
from specgraft.heads.base import load_head
from specgraft.heads.registry import family_of
from specgraft.target import load_target
from specgraft.tuning import cost

DEFAULT_TARGET = Path(__file__).resolve().parents[1] / "specgraft" / "defaults" / "model"


def draft_call_ratios(head, setting: dict, kv_length: int, calls: int) -> dict[str, float]:
    """``{"back_to_back": r, "after_target_forward": r}``: one drafting call / one one-token target forward."""
    model = head.target.model
    drafter = family_of(head).drafter(head, setting)
    prompt = cost._random_prompt(int(kv.text_config(model).vocab_size), kv_length)
    needs = tuple(int(i) for i in drafter.needs_hidden_states)
    drafter.bind(model)
    drafter.reset()
    drafter.propose(cost._draft_context(model, prompt, needs, full=True))
    ctx = cost._draft_context(model, prompt, needs, full=False)
    target_forward = cost._Reference(model, kv_length, calls).forward  # the profile's one-token forward

    def draft_call() -> None:
        drafter.propose(ctx)
        drafter.accept([], 0)

    for _ in range(max(10, calls // 10)):  # warm-up
        draft_call()
        target_forward()
    out = {}
    for label in ("back_to_back", "after_target_forward"):
        draft_s = target_s = 0.0
        for _ in range(calls):
            if label == "back_to_back":
                t0 = time.perf_counter()
                draft_call()
                t1 = time.perf_counter()
                draft_call()  # untimed: the next timed call again follows a draft call
                t2 = time.perf_counter()
                target_forward()
                t3 = time.perf_counter()
                draft_s += t1 - t0
                target_s += t3 - t2
            else:
                t0 = time.perf_counter()
                target_forward()
                t1 = time.perf_counter()
                draft_call()
                t2 = time.perf_counter()
                target_s += t1 - t0
                draft_s += t2 - t1
        out[label] = draft_s / target_s
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="a trained head folder")
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="the head's target (default: the demo's)")
    parser.add_argument("--settings", nargs="+", required=True, help="drafter settings as JSON objects")
    parser.add_argument("--kv-length", type=int, default=113)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    add_result_arguments(parser, "draft-call-cost")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    head = load_head(load_target(args.target, dtype="float32", device="cpu"), args.head)
    head.eval()
    rows = []
    print(f"{'setting':<60} {'back to back':>13} {'after a target forward':>23}")
    for text in args.settings:
        setting = json.loads(text)
        ratios = draft_call_ratios(head, setting, args.kv_length, args.calls)
        rows.append({"setting": json.dumps(setting), **ratios})
        print(f"{json.dumps(setting):<60} {ratios['back_to_back']:>12.3f}x {ratios['after_target_forward']:>22.3f}x")
    write_result(args.result_name, rows,
                 title="One drafting call of a trained head in one-token target forwards (ratio of summed times)",
                 dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 details={"head": args.head, "target": args.target, "kv_length": args.kv_length, "calls": args.calls})
    return 0


if __name__ == "__main__":
    sys.exit(main())
