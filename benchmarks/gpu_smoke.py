"""GPU smoke test: train EAGLE-3 and DFlash heads on ~1B-parameter random targets and decode losslessly with them.

For each target shape (``llama``: TinyLlama-1.1B's, ``qwen3``: a Qwen3 of 16 layers at hidden 2048, ~1.1B with
its 151,936-token tied embeddings; built from transformers configs with random weights, nothing downloaded):

1. the target (``--dtype``, default bf16 on a GPU, fp32 on a CPU) writes its own training data: random prompts and
   its greedy continuations (what greedy speculative decoding verifies against), saved beside it;
2. each head family is trained ``--steps`` optimizer steps by the library's trainer (``HeadTrainer``) in a child
   process started by ``accelerate launch`` (``--launcher python`` starts it with this interpreter instead; the
   trainer runs on accelerate either way), bf16 mixed precision on a GPU;
3. the trained head (in the target's dtype, as engines serve it) drafts at its family's default setting in the
   lossless speculative decoder on held-out random prompts; the answers are compared token by token with plain
   transformers ``generate`` (greedy) and with the decoder's own plain path, and all three are timed.

Prints and writes (``benchmarks/results/gpu_smoke.json``; ``gpu_smoke-tiny.json`` with ``--tiny``) per target and
family: training tokens/s, the decoder's tau, wall-clock speedups over ``generate`` and over plain decoding, and the
token-identity counts; ``lossless`` is true when every speculative answer equals ``generate``'s (fp32), or in bf16
equals it up to rounding ties (``specgraft.kernels.rounding``: a differing answer emits only tokens within 2 ulps of
the top logit or within plain decoding's own gap; ``token_identical`` says whether all were identical). Exits 1 when
not lossless.

``--tiny`` runs the same pipeline at tiny sizes (a few seconds of training on a CPU) so CI exercises it
(``tests/scripts/test_gpu_smoke.py``); its numbers measure nothing.

    python benchmarks/gpu_smoke.py                       # one GPU, about ten minutes
    python benchmarks/gpu_smoke.py --tiny --results-dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, write_result

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("eagle3", "dflash")

#: ~1B-parameter shapes (transformers config fields); max_position_embeddings covers prompt + continuation.
SHAPES: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B's shape.
    "llama": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048),
    # Qwen3-1.7B's width, heads and vocabulary with 16 of its 28 layers.
    "qwen3": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, tie_word_embeddings=True,
                  max_position_embeddings=2048),
}
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=256),
    "qwen3": dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, max_position_embeddings=256),
}
#: (training rows, prompt tokens, continuation tokens, steps, micro-batch, held-out prompts, new tokens per prompt)
FULL_SIZES = dict(rows=256, prompt_len=32, gen_len=224, steps=300, micro_batch=8, prompts=8, max_new_tokens=128)
TINY_SIZES = dict(rows=32, prompt_len=8, gen_len=40, steps=12, micro_batch=8, prompts=2, max_new_tokens=24)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_target(arch: str, tiny: bool, dtype: str, device: str, seed: int = 0):
    """A random-weight causal LM of ``arch``'s shape (its own transformers classes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specgraft.testing import tiny_config
    from specgraft.utils.models import resolve_dtype

    torch.manual_seed(seed)
    config = tiny_config(arch, **(TINY_SHAPES if tiny else SHAPES)[arch])
    config.attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))
    return model.eval()


def make_rows(model: Any, rows: int, prompt_len: int, gen_len: int, seed: int) -> list[dict[str, list[int]]]:
    """Random prompts (ids >= 3: pad/bos/eos never prompted) and the target's greedy continuations of them."""
    import torch

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=gen)
    out = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for chunk in prompts.split(64):
            ids = model.generate(chunk.to(device), attention_mask=torch.ones_like(chunk, device=device),
                                 do_sample=False, max_new_tokens=gen_len, min_new_tokens=gen_len,
                                 pad_token_id=0).cpu()
            for row in ids.tolist():
                out.append({"input_ids": row, "attention_mask": [1] * len(row),
                            "loss_mask": [0] * prompt_len + [1] * (len(row) - prompt_len)})
    return out


def head_section(family: str, vocab: int) -> dict[str, Any]:
    if family == "eagle3":
        return {"type": "eagle3", "ttt_steps": 3}
    # The mask token is a training/drafting marker; the random target may emit it, which only costs acceptance.
    return {"type": "dflash", "block_size": 8, "mask_token_id": vocab - 1}


def train_child(work: Path, family: str, sizes: dict[str, int], mixed_precision: str) -> None:
    """Runs inside ``accelerate launch``: train one head on the saved target and rows; write summary.json."""
    import datasets
    from transformers import AutoModelForCausalLM

    from specgraft.config import Recipe, from_dict
    from specgraft.target import load_target
    from specgraft.train.trainer import HeadTrainer

    model = AutoModelForCausalLM.from_pretrained(work / "target", dtype="auto").eval()
    target = load_target(model)
    train = datasets.load_from_disk(str(work / "rows"))
    out = work / family
    recipe = from_dict(Recipe, {
        "model": {"name_or_path": str(work / "target")},
        "data": {"path": str(work / "rows"), "max_length": sizes["prompt_len"] + sizes["gen_len"]},
        "head": head_section(family, model.config.vocab_size),
        "training": {"max_steps": sizes["steps"], "micro_batch_size": sizes["micro_batch"],
                     "learning_rate": 1e-3, "warmup_steps": max(1, sizes["steps"] // 20),
                     "checkpoint_every": 10 * sizes["steps"], "log_every": max(1, sizes["steps"] // 10),
                     "mixed_precision": mixed_precision},
        "output": {"dir": str(out), "overwrite": True},
        "tracking": {"backend": "none"},
    })
    trainer = HeadTrainer(recipe, target=target, dataset=train, show_progress=False)
    started = time.perf_counter()
    trainer.setup()
    summary = trainer.train()
    trainer.cleanup()
    summary["train_s"] = time.perf_counter() - started
    if trainer.accelerator.is_main_process:
        (out / "smoke_summary.json").write_text(json.dumps(summary), encoding="utf-8")


def launch_training(work: Path, family: str, args: argparse.Namespace, sizes: dict[str, int],
                    mixed_precision: str) -> dict[str, Any]:
    child = [__file__, "--train-child", str(work), family, "--sizes", json.dumps(sizes),
             "--mixed-precision", mixed_precision]
    if args.launcher == "accelerate":
        accelerate = shutil.which("accelerate")
        if accelerate is None:
            sys.exit("error: `accelerate` is not on PATH; install accelerate or pass --launcher python")
        cmd = [accelerate, "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
               mixed_precision, "--dynamo_backend", "no", *(["--cpu"] if args.device == "cpu" else []), *child]
    else:
        cmd = [sys.executable, *child]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        sys.exit(f"error: training {family} on {work.name} failed:\n{done.stderr[-3000:]}")
    return json.loads((work / family / "smoke_summary.json").read_text(encoding="utf-8"))


def decode_check(work: Path, family: str, prompts: list[list[int]], max_new_tokens: int,
                 device: str) -> dict[str, Any]:
    """The trained head in the lossless decoder vs transformers ``generate`` and plain decoding (timed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specgraft.decoding.decoder import SpeculativeDecoder
    from specgraft.heads.base import load_head_for_decoding
    from specgraft.heads.registry import get_family
    from specgraft.kernels.rounding import equal_up_to_rounding, greedy_gap_ulps
    from specgraft.target import load_target

    model = AutoModelForCausalLM.from_pretrained(work / "target", dtype="auto").to(device).eval()
    target = load_target(model)
    head = load_head_for_decoding(target, work / family / "head").eval()
    setting = get_family(family).search.default_setting(head)
    spec = SpeculativeDecoder(target, drafter=get_family(family).drafter(head, setting), ignore_eos=True)
    plain = SpeculativeDecoder(target, ignore_eos=True)
    device = model.device  # the torch.device (for synchronising)
    times = {"generate": 0.0, "plain": 0.0, "spec": 0.0}
    same_generate = same_plain = within_rounding = steps = emitted = 0
    gaps: list[float] = []
    for index, ids in enumerate(prompts):
        tensor = torch.tensor([ids], device=device)
        timed = index > 0 or len(prompts) == 1  # the first prompt warms every path up
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            reference = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                       pad_token_id=0)[0, len(ids):].tolist()
        _sync(device)
        generate_s = time.perf_counter() - start
        p = plain.generate(ids, max_new_tokens)
        s = spec.generate(ids, max_new_tokens)
        if timed:
            times["generate"] += generate_s
            times["plain"] += p.wall_time_s
            times["spec"] += s.wall_time_s
        same_generate += int(s.generated_ids == reference)
        if s.generated_ids == reference:
            within_rounding += 1
        else:  # the eval's rule (README, "Lossless in bf16"): a differing answer may only break a rounding tie
            with torch.no_grad():
                spec_gap = greedy_gap_ulps(model, ids, s.generated_ids)
                base_gap = greedy_gap_ulps(model, ids, reference)
            within_rounding += int(equal_up_to_rounding(spec_gap, base_gap))
            gaps.append(spec_gap)
        same_plain += int(s.generated_ids == p.generated_ids)
        steps += s.num_steps
        emitted += sum(a + 1 for a in s.accepted_lengths)
    return {"setting": setting, "tau": emitted / steps if steps else float("nan"),
            "identical_to_generate": same_generate, "identical_to_plain": same_plain, "prompts": len(prompts),
            "equal_up_to_rounding": within_rounding, "max_logit_gap_ulps": max(gaps) if gaps else 0.0,
            "speedup_vs_generate": times["generate"] / times["spec"] if times["spec"] else float("nan"),
            "speedup_vs_plain": times["plain"] / times["spec"] if times["spec"] else float("nan"),
            "seconds": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and budgets (CI on a CPU)")
    parser.add_argument("--archs", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--steps", type=int, help="optimizer steps per head (default 300; --tiny 12)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="target dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--launcher", choices=("accelerate", "python"), default="accelerate",
                        help="start each training run with `accelerate launch` (default) or this interpreter")
    add_result_arguments(parser, "gpu_smoke", default_help="gpu_smoke; gpu_smoke-tiny with --tiny")
    parser.add_argument("--work", type=Path, help="keep targets, data and heads here (default: a temporary folder)")
    parser.add_argument("--train-child", nargs=2, metavar=("WORK", "FAMILY"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--mixed-precision", default="no", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny and args.result_name == "gpu_smoke":
        args.result_name = "gpu_smoke-tiny"  # a CPU check never replaces a GPU run's result
    if args.train_child:
        train_child(Path(args.train_child[0]), args.train_child[1], json.loads(args.sizes), args.mixed_precision)
        return 0

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is visible; pass --device cpu (with --tiny) or run on a GPU",
              file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    mixed_precision = "bf16" if dtype == "bfloat16" and args.device.startswith("cuda") else "no"
    sizes = dict(TINY_SIZES if args.tiny else FULL_SIZES)
    if args.steps is not None:
        if args.steps < 1:
            print(f"error: --steps must be at least 1, got {args.steps}", file=sys.stderr)
            return 2
        sizes["steps"] = args.steps
    started = time.perf_counter()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "dtype": dtype, "mixed_precision": mixed_precision, "tiny": args.tiny, "launcher": args.launcher,
        "sizes": sizes, "command": " ".join([Path(sys.executable).name, *sys.argv]), "targets": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_smoke-") as scratch:
        base = args.work or Path(scratch)
        for arch in args.archs:
            work = base / arch
            work.mkdir(parents=True, exist_ok=True)
            model = build_target(arch, args.tiny, dtype, args.device)
            params = sum(p.numel() for p in model.parameters())
            t0 = time.perf_counter()
            rows = make_rows(model, sizes["rows"], sizes["prompt_len"], sizes["gen_len"], seed=0)
            held_out = [r["input_ids"][: sizes["prompt_len"]]
                        for r in make_rows(model, sizes["prompts"], sizes["prompt_len"], 1, seed=1)]
            data_s = time.perf_counter() - t0
            model.save_pretrained(work / "target")
            import datasets

            datasets.Dataset.from_list(rows).save_to_disk(str(work / "rows"))
            del model
            entry: dict[str, Any] = {"parameters": params, "data_s": data_s, "families": {}}
            for family in args.families:
                summary = launch_training(work, family, args, sizes, mixed_precision)
                decoded = decode_check(work, family, held_out, sizes["max_new_tokens"], args.device)
                entry["families"][family] = {
                    "train_steps": summary["steps"], "train_s": summary["train_s"],
                    "train_tokens_per_s": summary["steady_tokens_per_s"],
                    "peak_memory_bytes": summary["peak_memory_bytes"], **decoded}
                row = entry["families"][family]
                print(f"{arch:6s} {family:7s} train {row['train_tokens_per_s']:9.0f} tok/s  tau {row['tau']:.3f}  "
                      f"speedup {row['speedup_vs_generate']:.2f}x vs generate, {row['speedup_vs_plain']:.2f}x vs "
                      f"plain  identical {row['identical_to_generate']}/{row['prompts']}", flush=True)
            results["targets"][arch] = entry
    rows = [f for t in results["targets"].values() for f in t["families"].values()]
    results["token_identical"] = all(f["identical_to_generate"] == f["prompts"] for f in rows)
    # fp32: token-identical by margin; bf16: identical, or a differing answer emits only rounding-tie tokens
    # (specgraft.kernels.rounding's rule, what `specgraft eval` reports as "passed up to rounding").
    results["lossless"] = (results["token_identical"] if dtype == "float32"
                           else all(f["equal_up_to_rounding"] == f["prompts"] for f in rows))
    results["wall_s"] = time.perf_counter() - started
    figures = [{"target": arch, "family": family, "parameters": entry["parameters"],
                **{key: value for key, value in row.items() if not isinstance(value, (dict, list, tuple))}}
               for arch, entry in results["targets"].items() for family, row in entry["families"].items()]
    path = write_result(args.result_name, figures, title=f"GPU smoke test on {results['device']}: EAGLE-3 and DFlash "
                        "trained on random-init targets, decoded against generate", dtype=dtype,
                        details=results, results_dir=args.results_dir)
    print(f"lossless: {results['lossless']} (token-identical to generate: {results['token_identical']}); "
          f"{results['wall_s']:.0f} s; wrote {path}")
    return 0 if results["lossless"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
