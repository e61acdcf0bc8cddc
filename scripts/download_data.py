"""Download training conversations and evaluation prompt sets (where the internet is reachable).

    python scripts/download_data.py --list
    python scripts/download_data.py sharegpt ultrachat --out data/        # training data for the recipes
    python scripts/download_data.py spec_bench mt_bench --out data/eval/  # evaluation prompt sets

Training sets are written as JSONL that `specgraft train` reads directly (ShareGPT keeps its `conversations`
format; UltraChat is converted to OpenAI-style `messages`); `sharegpt_ultrachat` concatenates both (what the
EAGLE-3 recipes name). Prompt sets keep FastChat's `question.jsonl` format (`question_id`, `category`, `turns`),
which `specgraft eval --prompts` reads. Every file is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

#: name -> (kind, source, output file name, what it is)
SOURCES: dict[str, tuple[str, str, str, str]] = {
    "sharegpt": ("hub-file", "anon8231489123/ShareGPT_Vicuna_unfiltered:ShareGPT_V3_unfiltered_cleaned_split.json",
                 "sharegpt.jsonl", "ShareGPT (~68k conversations), the Medusa/EAGLE training set"),
    "ultrachat": ("hub-dataset", "HuggingFaceH4/ultrachat_200k:train_sft", "ultrachat.jsonl",
                  "UltraChat-200k SFT split (messages), used by EAGLE-3"),
    "sharegpt_ultrachat": ("concat", "sharegpt.jsonl+ultrachat.jsonl", "sharegpt_ultrachat.jsonl",
                           "both of the above in one file (run after downloading them)"),
    "spec_bench": ("url", "https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl",
                   "spec_bench/question.jsonl", "Spec-Bench prompts (480; MT-bench, translation, summarization, "
                                                "qa, math_reasoning, rag)"),
    "mt_bench": ("url", "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/"
                        "question.jsonl", "mt_bench/question.jsonl", "MT-bench (80 two-turn questions)"),
}


def _atomic_lines(path: Path, lines: Iterable[str]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line.rstrip("\n") + "\n")
                count += 1
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def ultrachat_to_messages(rows: Iterable[dict]) -> Iterator[str]:
    """UltraChat rows (``messages`` of role/content, ``prompt_id``) as JSONL lines of OpenAI-style messages."""
    for row in rows:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        yield json.dumps({"id": row.get("prompt_id"), "messages": messages}, ensure_ascii=False)


def sharegpt_to_lines(records: list[dict]) -> Iterator[str]:
    """ShareGPT's JSON array as JSONL lines (the ``conversations`` format is kept)."""
    for row in records:
        if row.get("conversations"):
            yield json.dumps({"id": row.get("id"), "conversations": row["conversations"]}, ensure_ascii=False)


def download(name: str, out: Path) -> Path:
    kind, source, filename, _ = SOURCES[name]
    dest = out / filename
    if kind == "url":
        with urllib.request.urlopen(source, timeout=60) as response:  # noqa: S310 (fixed https URLs)
            text = response.read().decode("utf-8")
        n = _atomic_lines(dest, (line for line in text.splitlines() if line.strip()))
    elif kind == "hub-file":
        from huggingface_hub import hf_hub_download

        repo, file = source.split(":")
        local = hf_hub_download(repo_id=repo, filename=file, repo_type="dataset")
        n = _atomic_lines(dest, sharegpt_to_lines(json.loads(Path(local).read_text(encoding="utf-8"))))
    elif kind == "hub-dataset":
        import datasets

        repo, split = source.split(":")
        n = _atomic_lines(dest, ultrachat_to_messages(datasets.load_dataset(repo, split=split)))
    else:  # concat
        parts = [out / p for p in source.split("+")]
        missing = [str(p) for p in parts if not p.is_file()]
        if missing:
            raise SystemExit(f"error: {', '.join(missing)} missing; download {source.replace('+', ' and ')} first")

        def lines() -> Iterator[str]:
            for part in parts:
                with open(part, encoding="utf-8") as fh:
                    yield from fh

        n = _atomic_lines(dest, lines())
    print(f"{name}: {n} rows -> {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"What to download: {', '.join(SOURCES)}.")
    parser.add_argument("--out", type=Path, default=Path("data"), help="Output folder (default: data/).")
    parser.add_argument("--list", action="store_true", help="List what can be downloaded.")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SOURCES]
    if unknown:
        print(f"error: unknown data set(s) {', '.join(unknown)}; choose from {', '.join(SOURCES)}", file=sys.stderr)
        return 2
    if args.list or not args.names:
        for name, (_, source, filename, what) in SOURCES.items():
            print(f"{name:<20} {what}\n{'':<20} from {source} -> {filename}")
        return 0
    if shutil.disk_usage(args.out if args.out.exists() else Path.cwd()).free < 2 * 2**30:
        print("error: less than 2 GiB free for the downloads; free space or pass --out elsewhere", file=sys.stderr)
        return 2
    for name in args.names:
        try:
            download(name, args.out)
        except OSError as exc:
            print(f"error: could not download {name} ({exc}); check the internet connection (and `hf auth "
                  "login` for gated sets)", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
