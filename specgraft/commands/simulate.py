"""``specgraft simulate``: its arguments and the command; the predictions are :mod:`specgraft.tuning.simulate`'s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.utils.args import float_list


def _ints(text: str) -> list[int]:
    """Integers written as numbers (``4,2.0`` is accepted, ``2.5`` is not)."""
    values = float_list(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in values]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft simulate``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--alpha", type=float, help="per-draft acceptance probability (e.g. a measured alpha_exact)")
    src.add_argument("--acceptance-profile", type=float_list,
                     help="measured per-depth acceptance rates a1,a2,... (report.json acceptance_by_depth)")
    src.add_argument("--report", type=Path, help="an eval report.json (or its folder): use its measured profile")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--draft-length", type=int, help="chain length g")
    shape.add_argument("--tree-size", type=int, help="tree: tokens verified per step including the root")
    parser.add_argument("--branching", type=_ints, help="tree from --alpha: siblings per depth, e.g. 4,2,2,1")
    parser.add_argument("--cost-ratio", type=float,
                        help="one draft forward's cost over one target decoding step (required unless --report)")
    parser.add_argument("--draft-forwards", type=int,
                        help="draft forwards per step (default: the draft depth; 1 for Medusa heads)")
    parser.add_argument("--verify-cost-ratio", type=float,
                        help="verification forward's cost in target decoding steps (default 1: memory-bound)")
    parser.add_argument("--verify-cost-per-token", type=float,
                        help="CPU/compute-bound: verification costs 1 + s*(n-1) steps for n tokens")
    parser.add_argument("--domain", help="with --report: use this domain's numbers instead of overall")
    parser.add_argument("--cost-profile", type=Path,
                        help="with --report: predict tokens/s and speedup on the device of this `specgraft profile` "
                             "JSON (e.g. a GPU's) instead of the report's measured costs")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")



def run(args: argparse.Namespace) -> int:
    """Print the predicted tau and speedup (and the measured ones when --report is given)."""
    from specgraft.tuning.simulate import predict, predict_on_profile, read_report_profile

    if args.cost_profile is not None:
        if args.report is None:
            raise SpecgraftError("--cost-profile predicts a measured setting on another device; pass --report too")
        out = predict_on_profile(args.report, args.domain, args.cost_profile, args.draft_length)
        if args.json:
            print(json.dumps(out, indent=2))
            return 0
        d = out["device"]
        print(f"device of the profile: {d['device']} ({d['device_name']}), {d['dtype']}, {d['threads']} thread(s)")
        print(f"predicted tau {out['tau']:.3f}; drafting {out['draft_s'] * 1e3:.3f} ms + step "
              f"{out['step_s'] * 1e3:.3f} ms per step -> {out['tokens_per_s']:.1f} tokens/s, "
              f"{out['speedup']:.3f}x over plain decoding on that device")
        return 0
    measured = None
    kwargs: dict[str, Any] = dict(draft_length=args.draft_length, tree_size=args.tree_size, branching=args.branching,
                                  cost_ratio=args.cost_ratio, draft_forwards=args.draft_forwards,
                                  verify_cost=args.verify_cost_ratio,
                                  verify_cost_per_token=args.verify_cost_per_token)
    if args.domain and args.report is None:
        raise SpecgraftError("--domain selects a domain of a --report; pass --report too")
    if args.report is not None:
        measured = read_report_profile(args.report, args.domain)
        if not measured["profile"]:
            raise SpecgraftError(f"{args.report} has no acceptance profile (no drafts were verified); evaluate a "
                                 "drafter first")
        kwargs["mode"] = "tree" if (args.tree_size or measured["mode"] == "tree") else "chain"
        if measured["reach"]:
            kwargs["reach"] = measured["reach"]  # exact for trees; the conditional product overstates tau there
        elif kwargs["mode"] == "tree":
            raise SpecgraftError(f"{args.report} lacks depth_accepted/steps (reach rates), which a tree prediction "
                                 "needs; re-run `specgraft eval` with this version")
        else:
            kwargs["profile"] = measured["profile"]
        kwargs["source"] = f"measured profile of {args.report}" + (f" ({args.domain})" if args.domain else "")
        if args.tree_size is None and kwargs["mode"] == "tree":
            kwargs["tree_size"] = measured.get("tree_size")
        if args.cost_ratio is None:
            if measured["draft_cost"] is None or measured["verify_cost"] is None:
                raise SpecgraftError(f"{args.report} has no measured costs; pass --cost-ratio")
            if args.draft_length is not None and args.draft_length != measured["depth"]:
                raise SpecgraftError("the report's measured costs are for its own draft length; pass --cost-ratio "
                                     "to predict another one")
            kwargs["draft_cost"] = measured["draft_cost"]
            if args.verify_cost_ratio is None and args.verify_cost_per_token is None:
                kwargs["verify_cost"] = measured["verify_cost"]
    elif args.alpha is not None:
        kwargs["alpha"] = args.alpha
    else:
        kwargs["profile"] = args.acceptance_profile
    pred = predict(**kwargs)
    if args.json:
        out = pred.to_dict()
        if measured is not None:
            out["measured"] = {"tau": measured["tau"], "speedup": measured["speedup"]}
        print(json.dumps(out, indent=2))
        return 0
    shape = f"chain of {pred.depth}" if pred.mode == "chain" else f"tree of depth {pred.depth}"
    print(f"setting: {shape}, acceptance from {pred.source}")
    print("acceptance by depth: " + ", ".join(f"{r:.3f}" for r in pred.acceptance_by_depth))
    print(f"cost per step: drafting {pred.draft_cost:.3f} + verification {pred.verify_cost:.3f} target decoding steps")
    print(f"predicted tau: {pred.tau:.3f} tokens per target forward (bonus token included)")
    print(f"predicted speedup: {pred.speedup:.3f}x over plain decoding")
    if measured is not None and measured["tau"] is not None:
        speed = measured["speedup"]
        print(f"measured in the report: tau {measured['tau']:.3f}"
              + (f", speedup {speed:.3f}x (ratio of totals)" if speed is not None else ""))
    for line in pred.assumptions:
        print(f"assumes: {line}")
    return 0
