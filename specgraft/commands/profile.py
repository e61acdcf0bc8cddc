"""``specgraft profile``: its arguments, and the command as a call of :func:`specgraft.tuning.cost.measure_profile`
(``--engine llamacpp``: :func:`specgraft.commands.engine_tuning.run_profile`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specgraft.commands.flags import add_attention_kernel_argument, add_linear_kernel_argument
from specgraft.errors import SpecgraftError
from specgraft.tuning.settings import (
    DEFAULT_KV_LENGTH,
    DEFAULT_REPEATS,
    DEFAULT_TOKEN_COUNTS,
    LLAMACPP_MAX_DRAFT,
    LLAMACPP_NEW_TOKENS,
    LLAMACPP_ROUNDS,
)
from specgraft.utils.args import int_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft profile``."""
    parser.add_argument("--target", required=True, help="target model: a transformers folder or Hub id (with "
                                                        "--engine llamacpp: the target GGUF llama.cpp serves)")
    parser.add_argument("--head", type=Path, action="append", default=[], help="head folder to measure (repeatable)")
    parser.add_argument("--draft", action="append", default=[], help="draft model folder to measure (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    parser.add_argument("--kv-length", type=int, default=DEFAULT_KV_LENGTH,
                        help=f"tokens in the KV cache while measuring (default {DEFAULT_KV_LENGTH}; use your typical "
                             "prompt + answer length)")
    parser.add_argument("--token-counts", type=int_list, default=list(DEFAULT_TOKEN_COUNTS),
                        help="tokens verified at once to measure (default 1,2,3,4,6,8,12,16,24,32,48,64)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timing repeats; the median counts")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing profile file")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's choice); --engine llamacpp: llama.cpp's -t (1)")
    add_linear_kernel_argument(parser)
    add_attention_kernel_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--draft-gguf", type=Path,
                        help="--engine llamacpp: a `specgraft export --format llamacpp` draft.gguf to measure "
                             "(instead of --head/--draft, which are exported now)")
    parser.add_argument("--new-tokens", type=int, default=LLAMACPP_NEW_TOKENS,
                        help=f"--engine llamacpp: tokens generated per request (default {LLAMACPP_NEW_TOKENS})")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``profile`` and ``tune`` share for measuring in a serving engine."""
    parser.add_argument("--engine", choices=("specgraft", "llamacpp"), default="specgraft",
                        help="whose decoding to measure: specgraft's decoder (default), or the pinned llama.cpp "
                             "(llama-server; build it with `bash scripts/build_llamacpp.sh`)")
    parser.add_argument("--max-draft", type=int, default=LLAMACPP_MAX_DRAFT,
                        help=f"--engine llamacpp: the longest draft length measured (1..N; default "
                             f"{LLAMACPP_MAX_DRAFT})")
    parser.add_argument("--rounds", type=int, default=LLAMACPP_ROUNDS,
                        help=f"--engine llamacpp: requests per configuration when measuring costs (default "
                             f"{LLAMACPP_ROUNDS})")


def run(args: argparse.Namespace) -> int:
    """Measure and write the profile (locked, into a new file or over an earlier profile only)."""
    if args.engine != "llamacpp" and args.draft_gguf is not None:
        raise SpecgraftError("--draft-gguf is a llama.cpp draft: add --engine llamacpp (specgraft's decoder takes "
                             "--head/--draft folders)")
    if args.engine == "llamacpp":
        from specgraft.commands.engine_tuning import run_profile

        return run_profile(args)
    from specgraft.utils.outputs import writing_output

    inputs = [args.target, *args.head, *args.draft]
    with writing_output(args.out, "profile", overwrite=args.overwrite, inputs=inputs, file=True):
        return _profile(args)


def _profile(args: argparse.Namespace) -> int:
    import torch

    from specgraft.evaluation.loading import device_and_dtype
    from specgraft.heads.base import read_head_config
    from specgraft.kernels.exact_attention import apply_attention_kernel
    from specgraft.kernels.linear import apply_linear_kernel
    from specgraft.pipeline.tune import load_draft_source, load_head_source
    from specgraft.target import load_target
    from specgraft.tuning.cost import check_measure_args, measure_profile

    check_measure_args(args.kv_length, args.repeats)
    for head_dir in args.head:
        read_head_config(head_dir)  # cheap check before loading the target
    device, dtype = device_and_dtype(args.device, args.dtype, args.threads)
    target = load_target(args.target, dtype=dtype, device=device)
    heads = [load_head_source(target, head_dir, require_search=False) for head_dir in args.head]
    drafts = [load_draft_source(target, path, dtype=dtype, device=device) for path in args.draft]
    apply_attention_kernel(args.attention_kernel, target.model)
    kernel = apply_linear_kernel(args.linear_kernel, device, dtype, target.model, *(s.module for s in heads),
                                 *(s.module for s in drafts))
    profile = measure_profile(target, device=device, dtype=dtype, threads=torch.get_num_threads(),
                              kv_length=args.kv_length, token_counts=args.token_counts, repeats=args.repeats,
                              heads=[(str(s.folder), s.module, s.head_type) for s in heads],
                              drafts=[(str(s.folder), s.module) for s in drafts], linear_kernel=kernel)
    profile.save(args.out)
    print_profile(profile)
    print(f"wrote {args.out}")
    return 0


def print_profile(profile: Any) -> None:
    """The profile's step costs per token count and each drafter's costs."""
    base = profile.plain_step_s
    print(f"device: {profile.device} ({profile.device_name}), {profile.dtype}, {profile.threads} thread(s), "
          f"KV length {profile.kv_length}, {profile.linear_kernel} linear kernel, {profile.attention_kernel} "
          "attention")
    print("tokens verified | chain step (x plain) | tree step (x plain)")
    for n in sorted(profile.step_s["chain"]):
        tree = profile.step_s["tree"].get(n)
        print(f"{n:>15} | {profile.step_s['chain'][n] * 1e3:8.3f} ms ({profile.step_s['chain'][n] / base:4.2f}x) | "
              + (f"{tree * 1e3:8.3f} ms ({tree / base:4.2f}x)" if tree else "-"))
    for label, section in profile.drafters.items():
        cells = []
        for table in ("per_call_s", "chain_s"):
            for key, value in (section.get(table) or {}).items():
                if isinstance(value, dict):  # Medusa: heads -> nodes -> seconds
                    cells += [f"{key} heads/{n} nodes {v * 1e3:.2f} ms" for n, v in value.items()]
                else:
                    cells.append(f"{key} {value * 1e3:.2f} ms")
        print(f"drafter {label} ({section['kind']}): " + ", ".join(cells))
