"""The stories260K target (llama2.c's 260K-parameter TinyStories model, converted to transformers) and the held-out
TinyStories prompts every stories260K benchmark evaluates on.

Held-out prompts are the first sentences of lines at the END of ``tinystories_train.txt``, in three domains by how
the line starts; the training text is the file up to the blank line before the first held-out line, so no
held-out paragraph is trained on."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchlib.stages import answered_turns

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("SPECGRAFT_SHARED_DATA", ROOT.parent / "shared" / "data"))
STORIES_DIR = SHARED / "models" / "stories260K"
TINYSTORIES = SHARED / "tinystories" / "tinystories_train.txt"
DOMAINS = ("once_upon", "dialogue", "narrative")
QUOTES = ('"', "\u201c", "\u2018", "'")


def require_shared_data(*paths: Path) -> None:
    """Exit with one ``error:`` line (status 2) when a ../shared/data input is absent."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"error: {', '.join(missing)} absent; this benchmark needs ../shared/data "
              "(or SPECGRAFT_SHARED_DATA pointing at a copy)", file=sys.stderr)
        raise SystemExit(2)


def stories260k_target(dest: Path, source: Path = STORIES_DIR) -> Path:
    """``dest``: the transformers copy of stories260K, converted from ``source`` (stories260K.bin + tok512.bin) unless
    ``dest`` already holds it."""
    if not (dest / "config.json").is_file():
        require_shared_data(source / "stories260K.bin", source / "tok512.bin")
        from specgraft.llama2c import convert_llama2c

        convert_llama2c(source / "stories260K.bin", source / "tok512.bin", dest)
    return dest


def domain_of(paragraph: str) -> str:
    """once_upon / dialogue / narrative, from how a paragraph starts."""
    if paragraph.startswith("Once upon a time"):
        return "once_upon"
    if paragraph.startswith(QUOTES):
        return "dialogue"
    return "narrative"


def held_out_prompts(path: Path, per_domain: int) -> list[dict[str, str]]:
    """Up to ``per_domain`` prompts per domain (``{"id", "domain", "prompt"}``): the first sentence of lines taken
    from the END of the file."""
    # Lines, not blank-line paragraphs: a new story's "Once upon a time" often follows the last one's final line.
    paragraphs = [" ".join(line.split()) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows: list[dict[str, str]] = []
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


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def split_tinystories(src: Path, work: Path, per_domain: int) -> dict[str, Any]:
    """Write the held-out prompt file and the training text (the file before the held-out tail) into ``work``."""
    rows = held_out_prompts(src, per_domain)
    lines = src.read_text(encoding="utf-8").splitlines()
    nonblank = [i for i, line in enumerate(lines) if line.strip()]  # held_out_prompts indexes non-blank lines
    cut = min(nonblank[int(r["id"].removeprefix("para"))] for r in rows)
    while cut > 0 and lines[cut - 1].strip():  # back to the blank line that opens the held-out paragraph
        cut -= 1
    train_lines, held_lines = lines[:cut], lines[cut:]
    train_txt = work / "tinystories_train_head.txt"
    train_txt.write_text("\n".join(train_lines) + "\n", encoding="utf-8")
    prompts = write_jsonl(rows, work / "tinystories_heldout_prompts.jsonl")
    train_set = {" ".join(line.split()) for line in train_lines if line.strip()}
    held = [" ".join(line.split()) for line in held_lines if line.strip()]
    return {"train_text": str(train_txt), "prompts_file": str(prompts), "num_prompts": len(rows),
            "train_lines": len(train_lines), "heldout_lines": len(held_lines),
            "train_bytes": train_txt.stat().st_size,
            # TinyStories repeats stock lines ("The end."); full held-out lines found verbatim in the training text.
            "heldout_lines_also_in_train": sum(h in train_set for h in held), "heldout_nonblank_lines": len(held)}


def prepare_stories260k(work: Path, per_domain: int) -> tuple[Path, dict[str, Any]]:
    """stories260K converted into ``work`` and the TinyStories split (:func:`split_tinystories`) written there."""
    require_shared_data(STORIES_DIR, TINYSTORIES)
    work.mkdir(parents=True, exist_ok=True)
    return stories260k_target(work / "stories260K"), split_tinystories(TINYSTORIES, work, per_domain)


def decode_key(head_dir: Path, prompts_file: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """What one decode of a head depends on: the head's files (by content), the prompts, the mode and the settings."""
    from specgraft.utils.io import sha256_file

    return {"head": {p.name: sha256_file(p) for p in sorted(Path(head_dir).iterdir()) if p.is_file()},
            "prompts": sha256_file(prompts_file), "mode": mode,
            **{name: getattr(args, name) for name in ("max_new_tokens", "repeats", "warmup", "threads")}}


def kept_decode(out_dir: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The report an earlier decode with exactly ``key`` left in ``out_dir`` (``decode_key.json`` beside it), else
    None."""
    key_file, report = out_dir / "decode_key.json", out_dir / "report.json"
    if not key_file.is_file() or not report.is_file():
        return None
    kept = json.loads(key_file.read_text(encoding="utf-8"))
    return json.loads(report.read_text(encoding="utf-8")) if kept.get("key") == key else None


def evaluate_heads(model_dir: Path, runs: list[dict[str, Any]], split: Mapping[str, Any], work: Path,
                   args: argparse.Namespace, modes: tuple[str, ...] = ("tree", "chain"),
                   reuse: bool = False) -> list[dict[str, Any]]:
    """The evaluation (:func:`specgraft.pipeline.evaluate.evaluate`) of every online head of ``runs``
    (:func:`benchlib.stages.train_one` records) on the held-out
    prompts in each drafting mode (greedy, ``args.max_new_tokens``, ``args.repeats``, ``args.warmup``,
    ``args.threads``); the report.json facts per (head, mode). ``reuse``: a head whose decode in this mode is on
    record with the same head files, prompts and settings is not decoded again (its row says ``reused``: its tau
    is what a new decode gives, its times are from that earlier run)."""
    import torch

    from specgraft.evaluation.prompts import load_prompts
    from specgraft.evaluation.report import EvalSettings
    from specgraft.pipeline.evaluate import DrafterChoice, evaluate, load_drafter
    from specgraft.target import load_target

    torch.set_num_threads(args.threads)
    target = load_target(model_dir)
    prompts = load_prompts(split["prompts_file"])
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup)
    rows = []
    for run in runs:
        if run["features"] != "online":
            continue
        for mode in modes:
            # any family, through the registry, at its defaults for the mode (as `specgraft eval --mode` drafts)
            out_dir = work / "eval" / f"{run['head']}-{mode}"
            key = decode_key(Path(run["head_dir"]), Path(split["prompts_file"]), mode, args)
            report = kept_decode(out_dir, key) if reuse else None
            reused = report is not None
            start = time.perf_counter()
            if report is None:
                choice = DrafterChoice(head=Path(run["head_dir"]), mode=mode, use_tuned=False)
                loaded = load_drafter(target, choice, dtype="float32", device="cpu", linear_kernel="stock",
                                      attention_kernel="stock")
                report = evaluate(loaded, prompts, out_dir, settings=settings, progress=False)
                (out_dir / "decode_key.json").write_text(json.dumps({"key": key}), encoding="utf-8")
            overall = report["overall"]
            rows.append({"head": run["head"], "mode": mode, "drafter": report["drafter"], "reused": reused,
                         "eval_wall_s": None if reused else time.perf_counter() - start, "overall": overall,
                         # per prompt turn: what a paired comparison of two heads on the same prompts needs
                         "turns": {f"{prompt_id}/{turn}": {"new_tokens": a["new_tokens"], "steps": a["steps"]}
                                   for (prompt_id, turn), a in answered_turns(out_dir).items()},
                         "domains": {d: {k: v.get(k) for k in ("tau", "speedup_ratio_of_totals", "lossless_passed")}
                                     for d, v in report["domains"].items()}})
            print(f"  eval {run['head']:<6} {mode:<5} tau {overall['tau']:.2f}  speedup "
                  f"{overall['speedup_ratio_of_totals']:.2f}x  {overall['lossless_check']}"
                  f"{'  (reused)' if reused else ''}", flush=True)
    return rows
