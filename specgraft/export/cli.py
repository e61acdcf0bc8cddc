"""Export a head for vLLM, SGLang, TensorRT-LLM or llama.cpp.

``specgraft export HEAD_DIR --format F --out DIR`` writes a folder the engine serves as is (safetensors weights,
``config.json`` consistent with the target), plus a ``README.md`` model card and ``specgraft_export.json``.

Formats: ``llamacpp`` (EAGLE-3: one GGUF, ``draft.gguf``, for ``llama-server -md ... --spec-type draft-eagle3``;
needs ``--target-gguf``), ``vllm`` (Medusa: MedusaModel; EAGLE-1: EagleLlamaForCausalLM; EAGLE-3: speculators layout, so
``vllm serve DIR`` needs no flags), ``sglang`` (EAGLE-1, EAGLE-3), ``trtllm`` (Medusa: FasterDecoding layout for
the Medusa converter; EAGLE-3: PyTorch backend), ``native`` (specgraft's own folder). vLLM exports of EAGLE heads
get ``-eagle-1`` / ``-eagle3`` appended to the folder name when it lacks the marker vLLM's name detection needs
(``--keep-name`` keeps it as given).
"""

from __future__ import annotations

import argparse
import sys

from specgraft.export.exporter import export_head


def run(args: argparse.Namespace) -> int:
    """Run ``specgraft export``."""
    result = export_head(
        args.head_dir, args.format, args.out, target=args.target, overwrite=args.overwrite, report=args.report,
        repo_id=args.repo_id, base_model=args.base_model, dtype=args.dtype, keep_name=args.keep_name,
        speculative_tokens=args.speculative_tokens, license=args.license, target_gguf=args.target_gguf,
    )
    print(f"exported the {result.head_type} head as {result.format} to {result.path}")
    for name in result.files:
        print(f"  {name}")
    for note in result.notes:
        print(f"note: {note}")
    for warning in result.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    return 0
