"""``specgraft export``: its arguments, and the command as a call of :func:`specgraft.export.exporter.export_head`.

``specgraft export HEAD_DIR --format F --out DIR`` writes a folder the engine serves as is (safetensors weights,
``config.json`` consistent with the target), plus a ``README.md`` model card and ``specgraft_export.json``.

Formats: ``llamacpp`` (EAGLE-3: one GGUF, ``draft.gguf``, for ``llama-server -md ... --spec-type draft-eagle3``;
needs ``--target-gguf``), ``vllm`` (Medusa: MedusaModel; EAGLE-1: EagleLlamaForCausalLM; EAGLE-3: speculators layout,
so ``vllm serve DIR`` needs no flags), ``sglang`` (EAGLE-1, EAGLE-3), ``trtllm`` (Medusa: FasterDecoding layout for
the Medusa converter; EAGLE-3: PyTorch backend), ``native`` (specgraft's own folder). vLLM exports of EAGLE heads
get ``-eagle-1`` / ``-eagle3`` appended to the folder name when it lacks the marker vLLM's name detection needs
(``--keep-name`` keeps it as given).
"""

from __future__ import annotations

import argparse

from specgraft.export.options import DEFAULT_SPECULATIVE_TOKENS, FORMATS, FORMATS_PER_FAMILY
from specgraft.utils.args import DTYPE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specgraft export``."""
    parser.add_argument("head_dir", metavar="HEAD_DIR", help="A head folder written by `specgraft train`.")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="Target layout; a format that cannot hold the head's family is refused, naming the "
                             f"formats that can ({FORMATS_PER_FAMILY}; native holds every family).")
    parser.add_argument("--out", required=True, metavar="DIR", help="Output folder (created; must be empty).")
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty output folder.")
    parser.add_argument("--target", metavar="PATH",
                        help="The target model (folder or Hub id) when the path recorded in the head is not "
                             "available here; only its config (and a shared Medusa lm_head) is read.")
    parser.add_argument("--report", metavar="DIR",
                        help="Eval report folder (or report.json) for the card; default: the newest one found "
                             "beside the head.")
    parser.add_argument("--repo-id", metavar="ORG/NAME", help="Hub repo the export is for (used in the card).")
    parser.add_argument("--base-model", metavar="NAME",
                        help="Hub id of the target written into configs and the card (default: the recorded name; "
                             "a head trained on a .gguf needs it unless the file records its Hub source).")
    parser.add_argument("--dtype", choices=DTYPE_NAMES,
                        help="Cast the weights (default: keep the head's dtype).")
    parser.add_argument("--keep-name", action="store_true",
                        help="Do not append vLLM's method marker (-eagle-1/-eagle3) to --out.")
    parser.add_argument("--speculative-tokens", type=int, metavar="N",
                        help="Draft length written into EAGLE-3's speculators_config (vllm format; default: the "
                             f"tuned depth from the head's tuned.json, else {DEFAULT_SPECULATIVE_TOKENS}).")
    parser.add_argument("--license", default="other", help="License field of the model card (a Hub license id).")
    parser.add_argument("--target-gguf", metavar="T.gguf",
                        help="llamacpp format: the target's GGUF as llama.cpp serves it; its tokenizer is copied into "
                             "the draft and its sizes and tokens must match the head's target (default: the "
                             "recorded target when it is a .gguf file).")


def run(args: argparse.Namespace) -> int:
    """Export the head and print where its files went, with the exporter's notes and warnings."""
    import sys

    from specgraft.export.exporter import export_head

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
