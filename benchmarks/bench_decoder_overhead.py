"""The speculative decoder's own loop overhead per step on stories260K, with a zero-cost oracle drafter.

Target: the llama2.c stories260K model (converted by ``benchlib.stories``; ``--target`` another one). Prompts: the
first sentence of the last ``--prompts`` paragraphs of ``tinystories_train.txt`` (held out from the head of the file
that training uses). A zero-cost oracle drafter proposes exactly
the target's greedy continuation (precomputed by plain decoding), as a chain of ``k`` tokens or as a tree with one
wrong sibling after each right node (``2k`` nodes, so the accepted rows are not a prefix of the verified ones and
the KV rollback has to move rows). The target's forwards are timed by hooks; overhead per step = (wall time -
time inside target forwards) / steps: everything the decoder does between forwards (tree inputs, masks,
verification, statistics, KV rollback, drafter bookkeeping).

    python benchmarks/bench_decoder_overhead.py
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_decoder_overhead.py   # compare two versions

A drafter's tau and end-to-end speedup on the same target (self-drafting, a draft model) is
``benchmarks/bench_eval_stories.py``'s question (`specgraft eval`, one script per question). ``--oracle`` is accepted
for older command lines: the oracle is the only mode.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib.results import add_result_arguments, write_result
from benchlib.stories import STORIES_DIR, TINYSTORIES, stories260k_target

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree
from specgraft.target import load_target

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


class OracleDrafter(Drafter):
    """Drafts the precomputed greedy continuation of the current prompt (set :attr:`continuation` before each
    ``generate``): every draft is accepted under greedy decoding and drafting costs nothing but a slice.

    ``tree=False``: a chain of ``k`` right tokens. ``tree=True``: at each depth the right token (first child, so it
    is tried first) and one wrong sibling (``right + 1`` mod V), both children of the previous right node.
    """

    def __init__(self, k: int, vocab_size: int, tree: bool) -> None:
        self.k, self.vocab_size, self.tree = k, vocab_size, tree
        self.continuation: list[int] = []

    def propose(self, ctx: DraftContext) -> DraftTree:
        done = ctx.length - ctx.prompt_length  # continuation tokens already emitted (the root is the last one)
        depth = min(self.k, ctx.max_depth, max(ctx.remaining_tokens - 1, 0))
        right = self.continuation[done : done + depth]
        device = ctx.token_ids.device
        if not right:
            return DraftTree.empty(device)
        if not self.tree:
            return DraftTree.chain(torch.tensor(right, dtype=torch.long, device=device))
        tokens, parents = [], []
        for d, tok in enumerate(right):
            parent = 2 * (d - 1) if d else -1  # the previous right node
            tokens += [tok, (tok + 1) % self.vocab_size]
            parents += [parent, parent]
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                         parents=torch.tensor(parents, dtype=torch.long, device=device))


class ForwardTimer:
    """Accumulates wall time spent inside ``model.forward`` (forward pre/post hooks on the top-level module)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device, self.seconds, self._start = device, 0.0, 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pre(self, module, args) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._start


def set_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Switch ``model``'s linear layers to ``kernel`` (see specgraft.kernels.linear)."""
    from specgraft.kernels.linear import use_stock_linears, use_weight_major_linears

    use_stock_linears(model)
    if kernel == "weight-major":
        use_weight_major_linears(model)


def oracle_overhead(target, tok, prompts: list[str], args, device: torch.device) -> int:
    """The ``--oracle`` benchmark: decoder loop overhead per step, plain vs oracle chain vs oracle tree."""
    vocab = int(target.config.vocab_size)
    plain = SpeculativeDecoder(target, tok, ignore_eos=True)
    depths = sorted(set(args.k))
    continuations = [plain.generate(p, args.max_new_tokens + max(depths) + 1).generated_ids for p in prompts]
    oracles = {f"oracle-{kind}-{k}": OracleDrafter(k, vocab, tree=kind == "tree")
               for k in depths for kind in ("chain", "tree")}
    methods = {"plain": plain, **{name: SpeculativeDecoder(target, tok, drafter=o, ignore_eos=True)
                                  for name, o in oracles.items()}}
    timer = ForwardTimer(target, device)
    kernels = list(dict.fromkeys(args.linear_kernels))
    # samples[(kernel, name)][prompt] = list of (wall s, forward s, steps, tokens, generated ids) over repeats
    samples: dict[tuple[str, str], list[list[tuple[float, float, int, int, list[int]]]]] = {
        (kernel, n): [[] for _ in prompts] for kernel in kernels for n in methods}

    def label(kernel: str, name: str) -> str:  # the kernel prefixes the row only when several are compared
        return f"{kernel}/{name}" if len(kernels) > 1 else name

    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
        for i, prompt in enumerate(prompts):
            for kernel in kernels:  # the kernels alternate per prompt, so load drift hits them alike
                set_kernel(target, kernel)
                for name, dec in methods.items():
                    if name in oracles:
                        oracles[name].continuation = continuations[i]
                    timer.seconds = 0.0
                    r = dec.generate(prompt, args.max_new_tokens)
                    if repeat:
                        samples[kernel, name][i].append(
                            (r.wall_time_s, timer.seconds, r.num_steps, r.num_new_tokens, r.generated_ids))
    set_kernel(target, "stock")
    print(f"decoder loop overhead, {args.target or 'stories260K'} on {device} ({args.threads} thread(s)), "
          f"{len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, {args.repeats} repeats (median per "
          f"prompt), greedy, zero-cost oracle drafter, k={depths}, linear kernels {kernels}")
    width = max(len(label(*key)) for key in samples) + 1
    header = (f"{'method':<{width}} {'nodes':>5} {'tau':>5} {'steps':>6} {'wall ms/step':>12} {'fwd ms/step':>11} "
              f"{'overhead ms/step':>16} {'tok/s':>8} {'step/plain':>10} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    lossless, plain_step, plain_rate = True, None, None
    figures = []
    for (kernel, name), per_prompt in samples.items():
        wall = sum(statistics.median(s[0] for s in runs) for runs in per_prompt)
        fwd = sum(statistics.median(s[1] for s in runs) for runs in per_prompt)
        steps = sum(runs[0][2] for runs in per_prompt)
        tokens = sum(runs[0][3] for runs in per_prompt)
        lossless &= all(runs[0][4] == c[: len(runs[0][4])] for runs, c in zip(per_prompt, continuations))
        nodes = 0 if name == "plain" else (2 * oracles[name].k if oracles[name].tree else oracles[name].k)
        if plain_step is None:  # the first kernel's "plain" comes first: the unit of the last two columns
            plain_step, plain_rate = wall / steps, tokens / wall
        print(f"{label(kernel, name):<{width}} {nodes:>5} {tokens / steps:>5.2f} {steps:>6} "
              f"{1e3 * wall / steps:>12.3f} {1e3 * fwd / steps:>11.3f} "
              f"{1e3 * (wall - fwd) / steps:>16.3f} {tokens / wall:>8.1f} "
              f"{wall / steps / plain_step:>10.2f} {tokens / wall / plain_rate:>7.2f}x")
        figures.append({"method": label(kernel, name), "nodes": nodes, "tau": tokens / steps, "steps": steps,
                        "wall_ms_per_step": 1e3 * wall / steps, "forward_ms_per_step": 1e3 * fwd / steps,
                        "overhead_ms_per_step": 1e3 * (wall - fwd) / steps, "tokens_per_s": tokens / wall,
                        "step_over_plain": wall / steps / plain_step, "speedup": tokens / wall / plain_rate})
    print("overhead = wall time outside the target's forwards (prefill included in fwd) per verification step; "
          "step/plain = one verification step's wall time in plain decoding steps (the cost of verifying the "
          "draft on this device); speedup = an ideal zero-cost drafter's ceiling at that draft size; both are "
          f"relative to plain decoding with the {kernels[0]} kernel")
    print(f"lossless (every method's tokens == plain greedy): {lossless}")
    write_result(args.result_name, [row | {"lossless": lossless} for row in figures],
                 title=f"Decoder loop overhead per step on {args.target or 'stories260K'} with a zero-cost oracle "
                       "drafter", dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 details={"device": str(device), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                          "repeats": args.repeats, "k": depths, "linear_kernels": kernels})
    return 0 if lossless else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stories-dir", type=Path, default=STORIES_DIR,
                        help="folder with stories260K.bin and tok512.bin")
    parser.add_argument("--tinystories", type=Path, default=TINYSTORIES)
    parser.add_argument("--target", type=Path,
                        help="another target instead of stories260K: a transformers folder or a .gguf file "
                             "(e.g. SmolLM2-135M-Instruct, whose forward is maths rather than Python overhead)")
    parser.add_argument("--k", type=int, nargs="+", default=[K],
                        help="oracle draft depths (a chain of k and a tree of 2k nodes for each)")
    parser.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny models: 1 is fastest)")
    parser.add_argument("--oracle", action="store_true",
                        help="(the only mode: accepted for older command lines)")
    parser.add_argument("--linear-kernels", nargs="+", choices=("stock", "weight-major"), default=["stock"],
                        help="the decode-time linear kernels to compare side by side, alternating per "
                             "prompt (see specgraft.kernels.linear; e.g. --linear-kernels stock weight-major)")
    add_result_arguments(parser, "", default_help="decoder-loop-overhead, -TARGET_NAME added with --target")
    args = parser.parse_args(argv)
    if not args.result_name:
        args.result_name = "decoder-loop-overhead" + (f"-{args.target.stem}" if args.target is not None else "")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    prompts = held_out_prompts(args.tinystories, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.target or stories260k_target(Path(tmp) / "stories260K", args.stories_dir)
        loaded = load_target(str(folder), dtype=torch.float32, device=device)
    target, tok = loaded.model, loaded.tokenizer
    return oracle_overhead(target, tok, prompts, args, device)

if __name__ == "__main__":
    sys.exit(main())
