"""specgraft vs SpecForge (0.2, offline EAGLE-3) on one target at one budget: the protocol every
``bench_specforge_<target>.py`` script runs once it has its target and data (:func:`side_by_side`).

1. The training rows are built once with specgraft's data pipeline at the recipe's data section and written as
   ``{input_ids, loss_mask}`` JSONL; both trainers train on exactly these rows.
2. SpecForge (installed by ``../shared/peers``' ``install_needed.sh`` into ``PEERS/specforge/venv``): its feature
   files from the rows (``specforge/prep_offline.py``, fp32: this CPU runs bf16 GEMMs several times slower), then
   ``specforge/train_cpu.py`` (the official ``specforge train`` on CPU) with ``--steps`` x ``--micro-batch`` rows
   (as many epochs as that takes: SpecForge stops after ``num_epochs``, default 1, even before ``max_steps``),
   ``ttt_length`` = the recipe's ``ttt_steps``, the recipe's learning rate, warmup share and gradient clipping, the
   same fused target layers and draft vocabulary size (each trainer picks its draft tokens from the rows' loss
   tokens). Its checkpoint (SGLang's EAGLE-3 layout) is read into a specgraft EAGLE-3 head through the ``sglang``
   export's reader (the frozen embedding copy it saves is checked against the target's and dropped), and the
   imported head's draft forward is compared with SpecForge's own on the same inputs.
3. specgraft: ``specgraft train --recipe`` at the same steps and batch (the recipe's ``training.features``), then
   each ``--lever`` (``NAME:key=value,key=value``: recipe overrides) at the same budget. Each ``--peer-lever``
   (``NAME:key=value``: keys of SpecForge's ``training`` section) trains SpecForge again on the same feature files,
   so a schedule a lever changes is tried on the peer too; ``ratio_to_best_peer`` divides by the best peer run.
4. Every head is decoded by specgraft's lossless decoder on the held-out prompts at the EAGLE family's default tree
   and default chain: tau, speedup, lossless check. A head decoded by an earlier run in the same ``--work`` with the
   same head files, prompts and settings keeps that decode (``reused_decode``; ``--redecode`` decodes again).

CPU seconds are each training process's user + system time; SpecForge's feature files are a separate process
(``features_cpu_s``), specgraft's offline feature cache is built inside its training process. Building the rows is
shared and not counted."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchlib.results import add_result_arguments, save_png, write_result
from benchlib.stages import ROOT, fmt, lossless_label, train_one
from benchlib.stories import evaluate_heads

MODES = ("tree", "chain")
BASELINE = "specgraft"
PEER = "specforge"
#: SpecForge ``training`` keys a ``--peer-lever`` may set (the rest is the shared budget and architecture)
PEER_TRAINING_KEYS = ("learning_rate", "warmup_ratio", "lr_scheduler", "max_grad_norm", "ttt_length", "seed")
#: SpecForge draft-config keys a ``--peer-lever`` may set (a specgraft lever that changes the head's size is then
#: tried on the peer at the same size)
PEER_DRAFT_KEYS = ("draft_vocab_size",)
PEER_LEVER_KEYS = PEER_TRAINING_KEYS + PEER_DRAFT_KEYS


def add_side_by_side_arguments(parser: argparse.ArgumentParser, *, recipe: str, steps: int, micro_batch: int,
                               max_new_tokens: int, result_name: str) -> None:
    """The options every side-by-side script shares, at that target's defaults."""
    parser.add_argument("--peers", type=Path, required=True, help="the copy of ../shared/peers with specforge/venv")
    parser.add_argument("--out", type=Path, required=True, help="JSON file with every number")
    parser.add_argument("--work", type=Path, help="scratch folder (default: <out without .json>_work)")
    parser.add_argument("--recipe", default=recipe, help=f"specgraft's recipe (default {recipe})")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps of every training run")
    parser.add_argument("--micro-batch", type=int, default=micro_batch,
                        help="rows (of at most the recipe's data.max_length tokens) per step")
    parser.add_argument("--lever", action="append", default=[], metavar="NAME:key=value[,key=value]",
                        help="an extra specgraft run with these recipe overrides (repeatable)")
    parser.add_argument("--peer-lever", action="append", default=[], metavar="NAME:key=value[,key=value]",
                        help="an extra SpecForge run with these training settings (repeatable; keys: "
                             f"{', '.join(PEER_LEVER_KEYS)})")
    parser.add_argument("--specforge-ttt", type=int, default=0,
                        help="SpecForge's ttt_length (default 0: the recipe's head.ttt_steps)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the 2 cores are shared)")
    parser.add_argument("--redecode", action="store_true",
                        help="decode every head again (default: a head decoded before in this --work with the same "
                             "files, prompts and settings keeps that decode's tau; its row says reused)")
    add_result_arguments(parser, result_name)


def check_budget(args: argparse.Namespace) -> None:
    """One ``error:`` line (status 2) for a budget that trains nothing."""
    for flag, value in (("--steps", args.steps), ("--micro-batch", args.micro_batch),
                        ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if value < 1:
            print(f"error: {flag} must be a positive integer, got {value}", file=sys.stderr)
            raise SystemExit(2)


#: Commas between overrides, not those inside a bracketed list value.
OVERRIDE_SEPARATOR = re.compile(r",(?![^\[]*\])")


def parse_levers(items: list[str], flag: str = "--lever") -> list[tuple[str, list[str]]]:
    """``NAME:key=value,key=value`` -> (name, overrides); a value may be a bracketed list (``key=[1,2,3]``); one
    ``error:`` line (status 2, naming ``flag``) for a malformed item."""
    out = []
    for item in items:
        name, sep, rest = item.partition(":")
        overrides = [o for o in OVERRIDE_SEPARATOR.split(rest) if o]
        if not sep or not name.isidentifier() or name in (BASELINE, PEER) or name.startswith(f"{PEER}_") or \
                not overrides or any("=" not in o for o in overrides):
            print(f"error: {flag} {item!r} must be NAME:key=value[,key=value] (NAME an identifier other than "
                  f"{BASELINE}/{PEER}, not starting with {PEER}_)", file=sys.stderr)
            raise SystemExit(2)
        out.append((name, overrides))
    return out


def parse_peer_levers(items: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``NAME:key=value,key=value`` -> (name, SpecForge settings, numbers typed); one ``error:`` line (status 2) for a
    malformed item or a key outside :data:`PEER_LEVER_KEYS`."""
    out = []
    for name, overrides in parse_levers(items, "--peer-lever"):
        settings: dict[str, Any] = {}
        for item in overrides:
            key, _, text = item.partition("=")
            if key not in PEER_LEVER_KEYS:
                print(f"error: --peer-lever {name}: {key!r} is not a SpecForge setting this benchmark "
                      f"varies; use one of {', '.join(PEER_LEVER_KEYS)}", file=sys.stderr)
                raise SystemExit(2)
            settings[key] = number_or_text(text)
        out.append((name, settings))
    return out


def number_or_text(text: str) -> int | float | str:
    """``"3"`` -> 3, ``"3e-3"`` -> 0.003, anything else as written (not the recipes' YAML override parsing,
    :func:`specgraft.config.apply_overrides`: YAML 1.1 reads ``3e-3`` as text, and SpecForge's config wants a
    number)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def common_overrides(model_dir: Path, split: Mapping[str, Any], work: Path) -> list[str]:
    """The overrides :func:`benchlib.stages.train_one` applies that decide the data (so building the rows here and
    training there read the same cached data set)."""
    return [f"model.name_or_path={model_dir}", f"data.path={split['train_text']}", f"data.cache_dir={work / 'cache'}"]


def build_rows(model_dir: Path, split: Mapping[str, Any], work: Path, recipe: str) -> tuple[Path, dict[str, Any]]:
    """The recipe's training rows (the specgraft data pipeline, cached) as JSONL ``{input_ids, loss_mask}``."""
    from specgraft.config import load_recipe
    from specgraft.data.dataset import build_dataset
    from specgraft.target import load_target

    path = work / "rows.jsonl"
    recipe_obj = load_recipe(ROOT / recipe, common_overrides(model_dir, split, work))
    target = load_target(model_dir)
    started = time.process_time()
    model = target.model if recipe_obj.data.regenerate else None
    splits = build_dataset(recipe_obj.data, target.tokenizer, model=model)
    facts = {"rows": 0, "tokens": 0, "loss_tokens": 0, "build_cpu_s": round(time.process_time() - started, 1)}
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as sink:
        for row in splits["train"]:
            real = int(sum(row["attention_mask"]))
            ids, mask = list(row["input_ids"][:real]), list(row["loss_mask"][:real])
            sink.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            facts["rows"] += 1
            facts["tokens"] += real
            facts["loss_tokens"] += int(sum(mask))
    tmp.replace(path)
    return path, facts


def trained(name: str, overrides: list[str], model_dir: Path, split: Mapping[str, Any], work: Path,
            args: argparse.Namespace, features: str) -> dict[str, Any]:
    """:func:`benchlib.stages.train_one` of ``--recipe`` + ``overrides`` in ``work/runs/NAME``, or its record from an
    earlier run of this benchmark in the same ``--work`` with the same recipe, overrides, steps and batch (a rerun
    that adds levers retrains nothing else)."""
    key = {"recipe": args.recipe, "overrides": overrides, "steps": args.steps, "micro_batch": args.micro_batch,
           "threads": args.threads, "features": features}
    record = work / "runs" / f"{name}.record.json"
    if record.is_file():
        kept = json.loads(record.read_text(encoding="utf-8"))
        if kept.get("key") == key and Path(kept["run"]["head_dir"]).is_dir():
            return kept["run"]
    run = train_one(name, args.recipe, features, model_dir, split, work, args, tuple(overrides), run_name=name)
    run = {**{k: v for k, v in run.items() if k != "curves"}, "overrides": overrides}
    record.write_text(json.dumps({"key": key, "run": run}, default=str), encoding="utf-8")
    return run


def timed_child(cmd: list[str], log: Path, env: Mapping[str, str], cwd: Path) -> dict[str, float]:
    """Run ``cmd`` (output to ``log``); its wall and CPU (user + system) seconds. Exits naming the log on failure."""
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env), stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"error: {' '.join(cmd[:3])} failed with exit status {code}; see {log}")
    return {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}


def specforge_python(peers: Path) -> Path:
    """The SpecForge venv's interpreter; one ``error:`` line (status 2) when it is not installed."""
    python = peers / "specforge" / "venv" / "bin" / "python"
    if not python.is_file():
        print(f"error: {python} absent; install SpecForge with ../shared/peers/install_needed.sh (its specforge "
              "lines) into the --peers copy", file=sys.stderr)
        raise SystemExit(2)
    return python


def specforge_target(model_dir: Path, sf: Path, python: Path, peers: Path, env: Mapping[str, str]) -> Path:
    """A copy of the target for SpecForge, which looks the target's lm_head up by name through
    model.safetensors.index.json: with one, and with the lm_head written out (a target that ties it to the
    embedding has none in its save_pretrained file)."""
    dest = sf / "target"
    if not (dest / "model.safetensors.index.json").is_file():
        from safetensors.torch import load_file, save_file

        shutil.copytree(model_dir, dest, dirs_exist_ok=True)
        tensors = load_file(str(dest / "model.safetensors"))
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"].clone())
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
        timed_child([str(python), str(peers / "common" / "add_index_json.py"), str(dest)], sf / "index.log", env,
                    peers / "specforge")
    return dest


def specforge_draft_config(model_dir: Path, head_config: Mapping[str, Any]) -> dict[str, Any]:
    """SpecForge's one-layer Llama EAGLE-3 draft config for this target, at specgraft's draft vocabulary size."""
    target_cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = int(target_cfg["num_attention_heads"])
    rope = target_cfg.get("rope_parameters") or {}
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target_cfg["hidden_size"], "intermediate_size": target_cfg["intermediate_size"],
            "num_attention_heads": heads, "num_key_value_heads": target_cfg.get("num_key_value_heads", heads),
            "head_dim": target_cfg.get("head_dim") or target_cfg["hidden_size"] // heads, "num_hidden_layers": 1,
            "hidden_act": target_cfg.get("hidden_act", "silu"),
            "max_position_embeddings": target_cfg["max_position_embeddings"],
            "rms_norm_eps": target_cfg["rms_norm_eps"],
            "rope_theta": target_cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            "vocab_size": target_cfg["vocab_size"], "draft_vocab_size": int(head_config["draft_vocab_size"]),
            "pad_token_id": 0, "bos_token_id": target_cfg.get("bos_token_id", 1),
            "eos_token_id": target_cfg.get("eos_token_id", 2), "tie_word_embeddings": False}


def train_specforge(peers: Path, model_dir: Path, rows: Path, head_config: Mapping[str, Any], recipe: Any,
                    work: Path, args: argparse.Namespace, run_id: str,
                    variant: tuple[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """SpecForge's offline EAGLE-3 on ``rows`` (features, then training); returns the run facts and its checkpoint.
    ``variant`` (a ``--peer-lever``: name, settings) trains in ``specforge/variants/NAME`` from the same feature files
    with those settings replacing the recipe's (a draft vocabulary size: its own draft config and vocabulary map)."""
    python = specforge_python(peers)
    scripts = peers / "specforge"
    sf = work / "specforge"
    sf.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", "FEAT_DTYPE": "float32", "SPECFORGE_DEVICE": "cpu",
           "SPECFORGE_TARGET_HEAD_FP32": "1", "PYTHONPATH": ""}
    layers = [int(i) for i in head_config["feature_layers"]]
    sf_target = specforge_target(model_dir, sf, python, peers, env)
    features = sf / "features"
    if not (sf / "features.done").is_file():
        timing = timed_child([str(python), str(scripts / "prep_offline.py"), str(model_dir), str(rows),
                              str(features), ",".join(map(str, layers))], sf / "prep.log", env, scripts)
        (sf / "features.done").write_text(json.dumps(timing), encoding="utf-8")
    (sf / "draft.json").write_text(json.dumps(specforge_draft_config(model_dir, head_config), indent=1),
                                   encoding="utf-8")
    run_dir = sf if variant is None else sf / "variants" / variant[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = dict(variant[1]) if variant is not None else {}
    draft_settings = {k: settings.pop(k) for k in PEER_DRAFT_KEYS if k in settings}
    draft_json, vocab_cache = sf / "draft.json", sf / "cache"
    if draft_settings:
        draft_json, vocab_cache = run_dir / "draft.json", run_dir / "cache"
        draft_json.write_text(json.dumps(specforge_draft_config(model_dir, {**head_config, **draft_settings}),
                                         indent=1), encoding="utf-8")
    out_dir = run_dir / "out"
    training = recipe.training
    epochs = peer_epochs(rows, args.steps, args.micro_batch)
    config = {
        "model": {"target_model_path": str(sf_target), "torch_dtype": "float32",
                  "draft_model_config": str(draft_json), "aux_hidden_state_layer_ids": layers},
        # cache_dir: where SpecForge keeps the draft-vocabulary map it counts from the features' loss tokens
        "data": {"hidden_states_path": str(features), "max_length": int(recipe.data.max_length),
                 "dataloader_num_workers": 0, "cache_dir": str(vocab_cache)},
        # SpecForge trains num_epochs (default 1) and stops there even before max_steps: enough epochs that the
        # step budget is what stops it, as it stops specgraft
        "training": {"strategy": "eagle3", "fsdp_sharding": "NO_SHARD", "max_steps": args.steps,
                     "num_epochs": epochs,
                     "batch_size": args.micro_batch, "learning_rate": float(training.learning_rate),
                     # the recipe's warmup steps as a share; SpecForge's cosine needs a step after the warmup
                     "warmup_ratio": min(training.warmup_steps, args.steps - 1) / args.steps,
                     "lr_scheduler": "cosine",
                     "max_grad_norm": float(training.max_grad_norm),
                     "ttt_length": args.specforge_ttt or int(head_config["ttt_steps"]),
                     "attention_backend": "sdpa", "log_interval": 50, **settings},
        "run_id": run_id, "output_dir": str(out_dir),
    }
    import yaml

    (run_dir / "run.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    done = run_dir / "train.done"  # the timing of the training run of exactly this config (else: train again)
    if not done.is_file() or json.loads(done.read_text(encoding="utf-8")).get("config") != config:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(run_dir / "sglang", ignore_errors=True)
        timing = timed_child([str(python), str(scripts / "train_cpu.py"), "--config", str(run_dir / "run.yaml")],
                             run_dir / "train.log", env, scripts)
        done.write_text(json.dumps({**timing, "config": config}), encoding="utf-8")
    facts: dict[str, Any] = {"features": json.loads((sf / "features.done").read_text(encoding="utf-8")),
                             "train": {k: v for k, v in json.loads(done.read_text(encoding="utf-8")).items()
                                       if k != "config"}}
    states = sorted(out_dir.glob("*-step*/training_state.pt"), key=lambda p: p.stat().st_mtime)
    if not states:
        sys.exit(f"error: SpecForge wrote no checkpoint under {out_dir}; see {run_dir / 'train.log'}")
    trained_steps = int(states[-1].parent.name.rsplit("-step", 1)[1])
    if trained_steps != args.steps:
        sys.exit(f"error: SpecForge stopped at step {trained_steps}, not the budget's {args.steps}; see "
                 f"{run_dir / 'train.log'}")
    exported = run_dir / "sglang"
    if not (exported / "model.safetensors").is_file():  # its own `specforge export --to sglang`
        timed_child([str(python), "-c", "import sys; from specforge import cli; sys.exit(cli.main(sys.argv[1:]))",
                     "export", "--to", "sglang", "--checkpoint", str(states[-1].parent), "--draft-config",
                     str(draft_json), "--output-dir", str(exported)], run_dir / "export.log", env, scripts)
    facts["checkpoint"] = str(exported)
    facts["trained_checkpoint"] = str(states[-1].parent)
    facts["config"] = config
    facts["draft_settings"] = draft_settings
    return facts


def peer_epochs(rows: Path, steps: int, micro_batch: int) -> int:
    """SpecForge's ``num_epochs`` for ``steps`` optimizer steps of ``micro_batch`` rows over the rows file: its
    loader drops an epoch's last partial batch, so an epoch is ``rows // micro_batch`` steps."""
    with rows.open(encoding="utf-8") as handle:
        count = sum(1 for line in handle if line.strip())
    per_epoch = count // micro_batch
    if per_epoch == 0:
        sys.exit(f"error: {count} training rows make no batch of {micro_batch}; lower --micro-batch")
    return -(-steps // per_epoch)


def import_specforge(checkpoint: Path, model_dir: Path, head_config: Mapping[str, Any], dest: Path) -> Path:
    """SpecForge's EAGLE-3 checkpoint (SGLang's layout) as a specgraft head folder, through the sglang export's
    reader; the frozen embedding copy SpecForge saves must equal the target's."""
    import torch
    from safetensors.torch import load_file

    from specgraft.export.convert import from_engine
    from specgraft.heads.base import head_config_from_dict, load_checked_state
    from specgraft.target import load_target

    target = load_target(model_dir)
    tensors = dict(load_file(str(checkpoint / "model.safetensors")))
    engine_config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None and not torch.equal(embed.float(), target.model.get_input_embeddings().weight.detach()):
        sys.exit("error: the SpecForge checkpoint's embed_tokens differ from the target's; it was trained on another "
                 "target")
    cls, config = head_config_from_dict("eagle3", dict(head_config), str(checkpoint))
    head = cls(config, target)
    state = from_engine("eagle3", "sglang", tensors, engine_config, dict(head_config), head.state_dict(),
                        target.output_head.weight.detach().cpu())
    load_checked_state(head, state, str(checkpoint))
    head.save_pretrained(dest)
    return dest


#: SpecForge's own draft forward (step 0: fused features and token embeddings -> logits) of its exported checkpoint,
#: run in its venv: ``python -c SPECFORGE_FORWARD CHECKPOINT IO_FILE``.
SPECFORGE_FORWARD = """
import json, sys, torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
checkpoint, io_file = sys.argv[1:3]
config = LlamaConfig(**json.load(open(checkpoint + "/config.json")))
model = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
model.load_state_dict(load_file(checkpoint + "/model.safetensors"), strict=False)
io = torch.load(io_file)
with torch.no_grad():
    io["specforge_logits"] = model.lm_head(model(hidden_states=io["features"], inputs_embeds=io["embeds"]))
torch.save(io, io_file)
"""


def forward_difference(peers: Path, checkpoint: Path, head_dir: Path, model_dir: Path, work: Path) -> float:
    """Max |logit difference| between SpecForge's draft forward (in its venv) and the imported specgraft head's on
    the same random fused features and token embeddings (causal, 16 positions): the import is the same function."""
    import torch

    from specgraft.heads import load_head
    from specgraft.heads.layers import causal_additive_mask
    from specgraft.target import load_target

    head = load_head(load_target(model_dir), head_dir).eval()
    generator = torch.Generator().manual_seed(0)
    length, width = 16, head.fc.in_features
    features = torch.randn(1, length, width, generator=generator)
    embeds = head.embed(torch.randint(0, head.target.vocab_size, (1, length), generator=generator))
    with torch.no_grad():
        hidden = head.fc(features)
        mask = causal_additive_mask(length, None, hidden.dtype, hidden.device)
        ours = head.lm_head(head.norm(head._layers_forward(embeds, hidden, torch.arange(length)[None], mask)))
    io_file = work / "specforge" / "forward_io.pt"
    torch.save({"features": features, "embeds": embeds}, io_file)
    env = {**os.environ, "PYTHONPATH": "", "SPECFORGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    timed_child([str(specforge_python(peers)), "-c", SPECFORGE_FORWARD, str(checkpoint), str(io_file)],
                work / "specforge" / "forward.log", env, peers / "specforge")
    theirs = torch.load(io_file)["specforge_logits"]
    return float((theirs - ours).abs().max())


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Bars: held-out tau of every head in each mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(dict.fromkeys(r["head"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(heads), 3.6))
    width = 0.8 / len(MODES)
    for m, mode in enumerate(MODES):
        values = [next((r["tau"] for r in rows if r["head"] == h and r["mode"] == mode), 0.0) for h in heads]
        bars = ax.bar([i + (m - (len(MODES) - 1) / 2) * width for i in range(len(heads))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(heads)), heads, rotation=20, fontsize=8)
    ax.set_ylabel("held-out tau (specgraft decoder)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def paired_ratio_interval(ours: Mapping[str, Mapping[str, int]], theirs: Mapping[str, Mapping[str, int]],
                          draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of tau(ours) / tau(theirs) over the prompt turns both decoded (``{turn: {new_tokens, steps}}``),
    by a paired bootstrap: turns are resampled together for both heads, so the spread is what the choice of prompts
    makes of the ratio, not each head's own spread. None when fewer than two turns are shared."""
    import random

    shared = sorted(set(ours) & set(theirs))
    if len(shared) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        sample = [rng.choice(shared) for _ in shared]
        ours_tau = sum(ours[t]["new_tokens"] for t in sample) / sum(ours[t]["steps"] for t in sample)
        theirs_tau = sum(theirs[t]["new_tokens"] for t in sample) / sum(theirs[t]["steps"] for t in sample)
        ratios.append(ours_tau / theirs_tau)
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def side_by_side_figures(runs: list[dict[str, Any]], decoded: list[dict[str, Any]],
                         peers: set[str]) -> list[dict[str, Any]]:
    """One figure per (training run, mode): tau, its ratio to SpecForge at the recipe's settings and to the best
    peer run in that mode (with its paired 95% interval over the prompt turns, :func:`paired_ratio_interval`),
    speedup, lossless check, costs; a specgraft lever's tau gain over specgraft's recipe per CPU second of its
    run."""
    tau = {(r["head"], r["mode"]): r["overall"]["tau"] for r in decoded}
    turns = {(r["head"], r["mode"]): r.get("turns", {}) for r in decoded}
    best_peer = {mode: max(peers, key=lambda p: tau[p, mode]) for mode in MODES}
    base_cpu = next(r["cpu_s"] for r in runs if r["head"] == BASELINE)
    figures = []
    for run in runs:
        for mode in MODES:
            row = next(r for r in decoded if r["head"] == run["head"] and r["mode"] == mode)
            overall = row["overall"]
            is_peer = run["head"] in peers
            interval = paired_ratio_interval(turns[run["head"], mode], turns[best_peer[mode], mode])
            figures.append({
                "head": run["head"], "mode": mode, "tau": overall["tau"],
                "ratio_to_specforge": overall["tau"] / tau[PEER, mode],
                "ratio_to_best_peer": overall["tau"] / tau[best_peer[mode], mode],
                "best_peer": best_peer[mode],
                # 95% paired bootstrap over the held-out prompt turns (None without per-turn records)
                "ratio_to_best_peer_low": interval[0] if interval else None,
                "ratio_to_best_peer_high": interval[1] if interval else None,
                "speedup": overall["speedup_ratio_of_totals"], "lossless": lossless_label(overall),
                "train_cpu_s": run["cpu_s"], "train_wall_s": round(run["wall_s"], 1),
                # SpecForge's feature files are a process of their own; specgraft's are inside train_cpu_s
                "features_cpu_s": run.get("features_cpu_s"),
                "overrides": " ".join(run.get("overrides", [])) or "-",
                # None for the peers and specgraft's recipe
                "gain_per_cpu_s": ((tau[run["head"], mode] - tau[BASELINE, mode]) / run["cpu_s"]
                                   if not is_peer and run["head"] != BASELINE else None),
                "extra_cpu_s": None if is_peer else run["cpu_s"] - base_cpu,
                # decoded by an earlier run of this benchmark (same head files, prompts, settings): same tau,
                # its speedup timed then
                "reused_decode": row["reused"],
            })
    return figures


def side_by_side(args: argparse.Namespace, label: str, model_dir: Path, split: Mapping[str, Any], work: Path,
                 features: str, started: float) -> int:
    """Steps 1-4 of this module's protocol on ``model_dir`` with ``split`` (``train_text``: the training data file or
    folder; ``prompts_file``/``num_prompts``: the held-out prompts), specgraft training with ``features``
    (online/offline); prints the tau table, writes ``--out`` and the benchlib result with its PNG. ``label`` names
    the target in titles. Exit status 0 when every decode was lossless, else 1."""
    from specgraft.config import load_recipe

    levers = parse_levers(args.lever)
    peer_levers = parse_peer_levers(args.peer_lever)
    recipe = load_recipe(ROOT / args.recipe, common_overrides(model_dir, split, work))
    rows_path, data = build_rows(model_dir, split, work, args.recipe)
    print(f"data: {data['rows']} rows, {data['tokens']:,} tokens ({data['loss_tokens']:,} loss tokens); "
          f"{split['num_prompts']} held-out prompts", flush=True)

    runs = [trained(BASELINE, [], model_dir, split, work, args, features)]
    head_config = json.loads((Path(runs[0]["head_dir"]) / "head_config.json").read_text(encoding="utf-8"))["config"]
    runs += [trained(name, overrides, model_dir, split, work, args, features) for name, overrides in levers]
    run_id = f"{label.lower().replace(' ', '-')}-eagle3"
    peer_runs, peer_facts = [], {}
    for variant in [None, *peer_levers]:
        head = PEER if variant is None else f"{PEER}_{variant[0]}"
        peer = train_specforge(args.peers, model_dir, rows_path, head_config, recipe, work, args, run_id, variant)
        peer_dir = import_specforge(Path(peer["checkpoint"]), model_dir, {**head_config, **peer["draft_settings"]},
                                    work / "runs" / head / "head")
        peer["forward_max_abs_diff"] = forward_difference(args.peers, Path(peer["checkpoint"]), peer_dir, model_dir,
                                                          work)
        print(f"SpecForge's draft forward ({head}) vs the imported head's: max |logit difference| "
              f"{peer['forward_max_abs_diff']:.2e}", flush=True)
        peer_facts[head] = peer
        peer_runs.append({"head": head, "features": "offline features", "head_dir": str(peer_dir),
                          "cpu_s": peer["train"]["cpu_s"], "wall_s": peer["train"]["wall_s"],
                          "features_cpu_s": peer["features"]["cpu_s"],
                          "overrides": [f"{k}={v}" for k, v in (variant[1] if variant else {}).items()]})
    runs = peer_runs + runs
    for run in runs:
        print(f"  train {run['head']:<10} {run['cpu_s']:>7.0f} CPU s  {run['wall_s']:>6.0f} s", flush=True)

    # evaluate_heads decodes the runs marked online; every head here is decoded the same way.
    decoded = evaluate_heads(model_dir, [{**r, "features": "online"} for r in runs], split, work, args, MODES,
                             reuse=not args.redecode)
    figures = side_by_side_figures(runs, decoded, {r["head"] for r in peer_runs})
    total = time.perf_counter() - started
    budget = (f"{args.steps} steps x {args.micro_batch} rows x <= {recipe.data.max_length} tokens, the same "
              f"{data['rows']} rows ({data['tokens']:,} tokens)")
    print(f"\n## EAGLE-3 on {label}, {budget}; {split['num_prompts']} held-out prompts, greedy, "
          f"{args.max_new_tokens} new tokens, specgraft's decoder\n")
    print("| head | mode | tau | / SpecForge | / best peer [95%] | speedup | lossless | train CPU s | "
          "features CPU s | gain/CPU s | overrides |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for f in figures:
        interval = (f" [{fmt(f['ratio_to_best_peer_low'], 2)}-{fmt(f['ratio_to_best_peer_high'], 2)}]"
                    if f["ratio_to_best_peer_low"] is not None else "")
        print(f"| {f['head']} | {f['mode']} | {fmt(f['tau'])} | {fmt(f['ratio_to_specforge'], 3, 'x')} | "
              f"{fmt(f['ratio_to_best_peer'], 3, 'x')}{interval} | "
              f"{fmt(f['speedup'], 2, 'x')} | {f['lossless']} | {f['train_cpu_s']:.0f} | "
              f"{fmt(f['features_cpu_s'], 0)} | {fmt(f['gain_per_cpu_s'], 5)} | {f['overrides']} |")
    print(f"\ntotal {total:.0f} s")
    png = plot(figures, args.results_dir / f"{args.result_name}.png", f"EAGLE-3 on {label} at one budget")
    record = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "data": {**split, **data}, "specforge": peer_facts[PEER], "specforge_variants": peer_facts,
              "training": runs, "decoding": decoded,
              "figures": figures, "budget": budget, "total_wall_s": total, "plot": str(png)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    write_result(args.result_name, figures, dtype="float32", threads=args.threads, results_dir=args.results_dir,
                 title=f"EAGLE-3 held-out tau, specgraft vs SpecForge 0.2 on {label} at one budget ({budget}), "
                       "both decoded by specgraft's decoder",
                 details={"settings": record["settings"], "budget": budget, "data": data, "plot": png.name,
                          "specgraft_features": features,
                          "specforge_forward_max_abs_diff": max(p["forward_max_abs_diff"]
                                                                for p in peer_facts.values()),
                          "specforge_config": peer_facts[PEER]["config"],
                          "specforge_peer_levers": {h: {**p["config"]["training"], **p["draft_settings"]}
                                                    for h, p in peer_facts.items()
                                                    if h != PEER},
                          "full_record": str(args.out)})
    return 0 if all(f["lossless"].startswith("passed") for f in figures) else 1
