"""The SpecForge side-by-side benchmarks' argument handling, refusals and decode reuse
(benchmarks/bench_specforge_*.py and benchlib.specforge); the runs themselves need the SpecForge venv and are not
part of the suite."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchlib import specforge

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


stories = load_script("bench_specforge_stories260k")
smol = load_script("bench_specforge_smollm2")


def test_levers_are_named_override_lists():
    got = specforge.parse_levers(["ttt5:head.ttt_steps=5", "both:head.loss_decay=1.0,training.learning_rate=6e-3"])
    assert got == [("ttt5", ["head.ttt_steps=5"]), ("both", ["head.loss_decay=1.0", "training.learning_rate=6e-3"])]
    # a bracketed list keeps its commas
    got = specforge.parse_levers(["layers:head.feature_layers=[2,4,5],training.adam_betas=[0.9,0.95]"])
    assert got == [("layers", ["head.feature_layers=[2,4,5]", "training.adam_betas=[0.9,0.95]"])]


@pytest.mark.parametrize("item", ["head.ttt_steps=5", "ttt5:", "ttt5:head.ttt_steps", "specforge:head.ttt_steps=5",
                                  "two words:head.ttt_steps=5"])
def test_a_malformed_lever_is_one_error_line(item, capsys):
    with pytest.raises(SystemExit) as exit_info:
        specforge.parse_levers([item])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --lever")


def test_peer_levers_are_specforge_training_settings_with_typed_numbers():
    got = specforge.parse_peer_levers(["lr3e3:learning_rate=3e-3,ttt_length=2", "const:lr_scheduler=constant",
                                       "v49k:draft_vocab_size=49152", "seed1:seed=1"])
    assert got == [("lr3e3", {"learning_rate": 0.003, "ttt_length": 2}), ("const", {"lr_scheduler": "constant"}),
                   ("v49k", {"draft_vocab_size": 49152}), ("seed1", {"seed": 1})]


@pytest.mark.parametrize("item, named", [("lr:batch_size=8", "batch_size"), ("lr:max_steps=10", "max_steps"),
                                         ("lr3e3", "--peer-lever"), ("specforge_x:learning_rate=1", "--peer-lever")])
def test_a_peer_lever_that_changes_the_budget_or_is_malformed_is_one_error_line(item, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        specforge.parse_peer_levers([item])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --peer-lever") and named in err


def test_each_head_is_compared_with_the_best_peer_run_in_its_mode():
    taus = {("specforge", "tree"): 1.5, ("specforge", "chain"): 1.2, ("specforge_lr", "tree"): 1.6,
            ("specforge_lr", "chain"): 1.1, ("specgraft", "tree"): 1.76, ("specgraft", "chain"): 1.32,
            ("lever", "tree"): 1.84, ("lever", "chain"): 1.2}
    decoded = [{"head": h, "mode": m, "reused": False,
                "turns": {f"{i}/0": {"new_tokens": 60, "steps": round(60 / t)} for i in range(4)},
                "overall": {"tau": t, "speedup_ratio_of_totals": 1.0, "lossless_passed": True,
                            "lossless_identical": 8, "lossless_checked": 8}} for (h, m), t in taus.items()]
    runs = [{"head": h, "cpu_s": cpu, "wall_s": cpu} for h, cpu in
            (("specforge", 100.0), ("specforge_lr", 100.0), ("specgraft", 200.0), ("lever", 400.0))]
    figures = {(f["head"], f["mode"]): f for f in specforge.side_by_side_figures(runs, decoded,
                                                                                 {"specforge", "specforge_lr"})}
    assert figures["specgraft", "tree"]["ratio_to_specforge"] == pytest.approx(1.76 / 1.5)
    assert figures["specgraft", "tree"]["ratio_to_best_peer"] == pytest.approx(1.76 / 1.6)  # the variant is best
    assert figures["specgraft", "chain"]["ratio_to_best_peer"] == pytest.approx(1.32 / 1.2)  # the default is best
    assert figures["specforge_lr", "tree"]["ratio_to_best_peer"] == pytest.approx(1.0)
    assert figures["specgraft", "tree"]["best_peer"] == "specforge_lr"
    tree = figures["specgraft", "tree"]
    low, high = tree["ratio_to_best_peer_low"], tree["ratio_to_best_peer_high"]
    assert low == high == pytest.approx((60 / 34) / (60 / 38))  # the same gain on every turn (steps rounded)
    assert figures["lever", "chain"]["lossless"] == "passed 8/8"
    assert figures["lever", "tree"]["gain_per_cpu_s"] == pytest.approx((1.84 - 1.76) / 400)
    assert figures["lever", "tree"]["extra_cpu_s"] == pytest.approx(200)
    assert all(figures[p, m]["gain_per_cpu_s"] is None and figures[p, m]["extra_cpu_s"] is None
               for p in ("specforge", "specforge_lr") for m in ("tree", "chain"))


def test_the_paired_interval_tracks_the_prompts_not_each_heads_own_spread():
    # prompt turns of very different difficulty: the peer's tau per turn runs from 1.1 to 2.5
    peer = {f"{i}/0": {"new_tokens": 64, "steps": steps} for i, steps in enumerate((58, 50, 40, 32, 26, 58, 45, 30))}
    better = {t: {"new_tokens": 64, "steps": round(v["steps"] / 1.1)} for t, v in peer.items()}  # 1.1x on every turn
    low, high = specforge.paired_ratio_interval(better, peer)
    assert 1.07 < low <= high < 1.13  # every turn agrees: a narrow interval around 1.1 despite the turns' spread
    # negative control: the same overall gain from one turn alone is not a consistent lead
    lucky = {**peer, "4/0": {"new_tokens": 64, "steps": 12}}
    low, high = specforge.paired_ratio_interval(lucky, peer)
    assert low <= 1.0 + 1e-9 and high > 1.1
    assert specforge.paired_ratio_interval(peer, peer) == (1.0, 1.0)
    assert specforge.paired_ratio_interval({"0/0": peer["0/0"]}, peer) is None  # one shared turn: no interval


@pytest.fixture
def smol_inputs(tmp_path: Path) -> dict[str, Path]:
    """A target folder, a data file and an MT-bench-style question file (two turns, two categories)."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}", encoding="utf-8")
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n", encoding="utf-8")
    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": 81 + i, "category": category, "turns": [f"first {i}", f"second {i}"]}
            for i, category in enumerate(["writing", "writing", "math", "math", "math"])]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"target": target, "data": data, "questions": questions, "out": tmp_path / "out.json"}


def run_smol(argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", ["bench_specforge_smollm2.py", *argv])
    return smol.main()


@pytest.mark.parametrize("case, expected", [
    ("no_target", "--target-model"), ("no_data", "--data"), ("no_questions", "--questions"),
    ("per_domain", "--per-domain"), ("steps", "--steps"), ("micro_batch", "--micro-batch"),
    ("lever", "--lever"), ("peer_lever", "max_steps"),
])
def test_the_smollm2_bench_refuses_bad_input_in_one_line_before_building_anything(case, expected, smol_inputs,
                                                                                   tmp_path, monkeypatch, capsys):
    inputs = dict(smol_inputs)
    extra: list[str] = []
    if case == "no_target":
        inputs["target"] = tmp_path / "missing"
    elif case == "no_data":
        inputs["data"] = tmp_path / "missing.jsonl"
    elif case == "no_questions":
        inputs["questions"] = tmp_path / "missing.jsonl"
    else:
        extra = {"per_domain": ["--per-domain", "0"], "steps": ["--steps", "0"], "micro_batch": ["--micro-batch", "-1"],
                 "lever": ["--lever", "specgraft:head.ttt_steps=5"],
                 "peer_lever": ["--peer-lever", "lr:max_steps=5"]}[case]
    argv = ["--peers", str(tmp_path / "peers"), "--target-model", str(inputs["target"]), "--data", str(inputs["data"]),
            "--questions", str(inputs["questions"]), "--out", str(inputs["out"]), "--results-dir", str(tmp_path),
            *extra]
    with pytest.raises(SystemExit) as exit_info:
        run_smol(argv, monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "question.jsonl", "target"]  # nothing written


def test_the_held_out_prompts_are_mt_bench_first_turns_per_category(smol_inputs, tmp_path):
    facts = smol.write_first_turns(smol_inputs["questions"], 2, tmp_path / "work" / "prompts.jsonl")
    rows = [json.loads(line) for line in Path(facts["prompts_file"]).read_text(encoding="utf-8").splitlines()]
    assert facts["num_prompts"] == 4 and facts["domains"] == ["math", "writing"]
    assert [(r["category"], r["turns"]) for r in rows] == [
        ("writing", ["first 0"]), ("writing", ["first 1"]), ("math", ["first 2"]), ("math", ["first 3"])]
    from specgraft.evaluation.prompts import load_prompts

    assert [p.turns for p in load_prompts(facts["prompts_file"])] == [r["turns"] for r in rows]  # the eval reads it


def test_the_specforge_draft_config_follows_the_target(tmp_path):
    config = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 49152,
              "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "bos_token_id": 1,
              "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    draft = specforge.specforge_draft_config(tmp_path, {"draft_vocab_size": 16384})
    assert draft["rope_theta"] == 100000.0  # transformers 5 keeps it under rope_parameters
    assert (draft["num_hidden_layers"], draft["draft_vocab_size"], draft["num_key_value_heads"]) == (1, 16384, 3)


def test_a_decode_is_reused_only_for_the_same_head_files_prompts_and_settings(tmp_path):
    from benchlib import stories

    head, prompts, out = tmp_path / "head", tmp_path / "prompts.jsonl", tmp_path / "eval" / "h-tree"
    head.mkdir()
    (head / "head.safetensors").write_bytes(b"weights")
    (head / "head_config.json").write_text("{}")
    prompts.write_text('{"prompt": "p"}\n')
    args = SimpleNamespace(max_new_tokens=64, repeats=1, warmup=0, threads=2)
    key = stories.decode_key(head, prompts, "tree", args)
    assert stories.kept_decode(out, key) is None  # nothing on record
    out.mkdir(parents=True)
    (out / "report.json").write_text(json.dumps({"overall": {"tau": 1.5}}))
    assert stories.kept_decode(out, key) is None  # a report without its key (an older run) is not trusted
    (out / "decode_key.json").write_text(json.dumps({"key": key}))
    assert stories.kept_decode(out, key) == {"overall": {"tau": 1.5}}
    assert stories.kept_decode(out, stories.decode_key(head, prompts, "chain", args)) is None
    assert stories.kept_decode(out, stories.decode_key(head, prompts, "tree",
                                                       SimpleNamespace(**{**vars(args), "max_new_tokens": 32}))) is None
    (head / "head.safetensors").write_bytes(b"retrained")  # same path, other weights
    assert stories.kept_decode(out, stories.decode_key(head, prompts, "tree", args)) is None
    (head / "head.safetensors").write_bytes(b"weights")
    prompts.write_text('{"prompt": "q"}\n')
    assert stories.kept_decode(out, stories.decode_key(head, prompts, "tree", args)) is None


def test_specforge_trains_as_many_epochs_as_the_step_budget_takes(tmp_path):
    """SpecForge stops after num_epochs (default 1) even before max_steps, and drops each epoch's last partial
    batch: 253 rows of 4 are 63 steps an epoch, so 100 steps take 2 epochs and 300 take 5 (one epoch would stop
    the peer at step 63, a third of specgraft's 300)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n" for _ in range(253)))
    assert [specforge.peer_epochs(rows, steps, 4) for steps in (63, 64, 100, 300)] == [1, 2, 2, 5]
    with pytest.raises(SystemExit, match="no batch of 512"):
        specforge.peer_epochs(rows, 100, 512)
