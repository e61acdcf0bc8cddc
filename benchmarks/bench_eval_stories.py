"""`specgraft eval` on the real stories260K target with held-out TinyStories prompts, grouped in three domains.

Builds, in a scratch folder, (1) the transformers copy of llama2.c stories260K (``convert_llama2c``) and (2) a JSONL
prompt file from the LAST paragraphs of ``tinystories_train.txt`` (held out from the head of the file that training
uses): the first sentence of each paragraph (line) is a prompt, in domain ``once_upon`` (it starts with "Once upon a
time"), ``dialogue`` (it starts with a quote) or ``narrative`` (anything else). Then runs the real command line::

    specgraft eval --target <stories260K> --drafter self --k 4 --prompts <prompts.jsonl> --out <out>

and prints the per-domain table. stories260K has no chat template, so prompts are plain text + BOS.

    python benchmarks/bench_eval_stories.py --out /tmp/eval_stories
    python benchmarks/bench_eval_stories.py --out /tmp/eval_stories --per-domain 10 --max-new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

SHARED = Path(os.environ.get("SPECGRAFT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
DOMAINS = ("once_upon", "dialogue", "narrative")
QUOTES = ('"', "\u201c", "\u2018", "'")


def domain_of(paragraph: str) -> str:
    """once_upon / dialogue / narrative, from how a paragraph starts."""
    if paragraph.startswith("Once upon a time"):
        return "once_upon"
    if paragraph.startswith(QUOTES):
        return "dialogue"
    return "narrative"


def held_out_prompts(path: Path, per_domain: int) -> list[dict]:
    """Up to ``per_domain`` prompts per domain: the first sentence of paragraphs taken from the END of the file."""
    # Lines, not blank-line paragraphs: a new story's "Once upon a time" often follows the last one's final line.
    paragraphs = [" ".join(line.split()) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows: list[dict] = []
    counts = dict.fromkeys(DOMAINS, 0)
    for index in range(len(paragraphs) - 1, -1, -1):
        para = paragraphs[index]
        match = re.match(r"(.+?[.!?][\"\u201d]?)(\s|$)", para)
        domain = domain_of(para)
        if not match or counts[domain] >= per_domain or len(match.group(1)) < 12:
            continue
        counts[domain] += 1
        rows.append({"id": f"para{index}", "domain": domain, "prompt": match.group(1)})
        if all(c >= per_domain for c in counts.values()):
            break
    return rows[::-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="scratch folder (model, prompts, report)")
    parser.add_argument("--per-domain", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a tiny model gains nothing)")
    parser.add_argument("--drafter", default="self", help="self or random (or use the CLI directly for others)")
    args = parser.parse_args()

    src = SHARED / "models" / "stories260K"
    if not src.is_dir():
        print(f"error: {src} is absent; this benchmark needs ../shared/data", file=sys.stderr)
        return 2
    from specgraft.cli import main as cli_main
    from specgraft.llama2c import convert_llama2c

    model_dir = args.out / "stories260K"
    if not (model_dir / "config.json").is_file():
        convert_llama2c(src / "stories260K.bin", src / "tok512.bin", model_dir)
    rows = held_out_prompts(SHARED / "tinystories" / "tinystories_train.txt", args.per_domain)
    prompts = args.out / "tinystories_prompts.jsonl"
    prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts in {prompts}")
    return cli_main(["eval", "--target", str(model_dir), "--drafter", args.drafter, "--k", str(args.k),
                     "--prompts", str(prompts), "--out", str(args.out / "report"),
                     "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats), "--warmup", "2",
                     "--device", "cpu", "--threads", str(args.threads)])


if __name__ == "__main__":
    sys.exit(main())
