"""EAGLE-3 acceptance per budget: specgraft vs SpecForge on stories260K, the same rows, steps and tokens, scored by
the same decoder and tree.

stories260K is converted and TinyStories split into ``--work`` (default ``<out stem>_work`` beside ``--out``;
:mod:`benchlib.stories`: the held-out prompts are never trained on); the shipped recipe regenerates (the target's own
greedy continuations of the paragraphs' first sentences) and trains on online features. The rest is
:mod:`benchlib.specforge`'s protocol: the rows built once and given to both trainers, SpecForge 0.2's offline
EAGLE-3 (plus each ``--peer-lever``) and ``specgraft train`` (plus each ``--lever``) at the same steps and batch,
SpecForge's checkpoints imported through the sglang export's reader, every head decoded by specgraft's lossless
decoder at the EAGLE family's default tree and chain.

Prints the tau table with each head's ratio to SpecForge's and to the best SpecForge run, writes ``--out`` (every
number), the benchlib result (``benchmarks/results/<--result-name>.json``) and a PNG beside it::

    python benchmarks/bench_specforge_stories260k.py --peers /scratch/peers --out /tmp/sf260k.json
    python benchmarks/bench_specforge_stories260k.py --peers /scratch/peers --out /tmp/sf260k.json \\
        --lever ttt5:head.ttt_steps=5 --lever hass:head.hass_topk=10
"""

from __future__ import annotations

import argparse
import sys
import time

from benchlib.specforge import add_side_by_side_arguments, check_budget, parse_levers, parse_peer_levers, side_by_side
from benchlib.stages import scratch_folder
from benchlib.stories import prepare_stories260k

RECIPE = "recipes/eagle3/stories260k.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_side_by_side_arguments(parser, recipe=RECIPE, steps=600, micro_batch=8, max_new_tokens=96,
                               result_name="specforge-stories260k")
    parser.add_argument("--per-domain", type=int, default=6, help="held-out prompts per domain (3 domains)")
    args = parser.parse_args()
    check_budget(args)
    parse_levers(args.lever)
    parse_peer_levers(args.peer_lever)
    started = time.perf_counter()
    work = scratch_folder(args)
    model_dir, split = prepare_stories260k(work, args.per_domain)
    return side_by_side(args, "stories260K", model_dir, split, work, "online", started)


if __name__ == "__main__":
    sys.exit(main())
