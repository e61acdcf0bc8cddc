"""benchmarks/bench_domain_adaptation.py's logic: the coding prompts it writes, the adaptation command (warm start,
replay, budget), the before/after table with its noise estimate, the refusals, and the plot."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_domain_adaptation.py"
spec = importlib.util.spec_from_file_location("bench_domain_adaptation", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


def test_write_code_prompts_reads_humaneval_and_writes_conversations(tmp_path):
    source = tmp_path / "HumanEval.jsonl.gz"
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n"}
             for i in range(5)]
    with gzip.open(source, "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(t) + "\n" for t in tasks))
    out = tmp_path / "code" / "prompts.jsonl"
    assert bench.main(["--write-code-prompts", str(out), "--code-prompts", "3", "--humaneval", str(source)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    (message,) = rows[1]["messages"]
    assert message["role"] == "user" and tasks[1]["prompt"] in message["content"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["prompts.jsonl"]

    heldout = tmp_path / "code" / "heldout.jsonl"
    assert bench.main(["--write-heldout-code", str(heldout), "--code-prompts", "3", "--heldout-code", "9",
                       "--humaneval", str(source)]) == 0
    from specgraft.evaluation.prompts import load_prompts

    prompts = load_prompts([heldout])  # the eval's own reader: FastChat questions of domain humaneval
    assert [(p.id, p.domain) for p in prompts] == [("HumanEval/3", "humaneval"), ("HumanEval/4", "humaneval")]
    assert prompts[0].turns == [bench.CODE_REQUEST.format(prompt=tasks[3]["prompt"])]  # asked as the training rows
    assert bench.main(["--write-heldout-code", str(heldout), "--code-prompts", "5", "--humaneval", str(source)]) == 2


def test_adapt_command_warm_starts_with_replay_and_the_budget(tmp_path):
    args = bench.parse_args(["--base-head", "h", "--target", "t", "--adapt-data", "code.jsonl", "--replay-data",
                             "sg.jsonl", "--work", str(tmp_path), "--steps", "30", "--learning-rate", "0.0003",
                             "--override", "data.max_length=256"])
    cmd = bench.adapt_command(args, tmp_path / "adapted")
    assert cmd[1:4] == ["-m", "specgraft", "train"]
    for item in ("head.init_from=h", "data.path=code.jsonl", "data.replay_path=sg.jsonl", "data.replay_share=0.5",
                 "training.max_steps=30", "training.learning_rate=0.0003", f"output.dir={tmp_path / 'adapted'}",
                 "data.max_length=256"):
        assert item in cmd
    before = bench.eval_command(Path("h"), Path("t"), tmp_path / "a", args)
    after = bench.eval_command(Path("h2"), Path("t"), tmp_path / "b", args)
    differ = [(x, y) for x, y in zip(before, after) if x != y]
    assert differ == [("h", "h2"), (str(tmp_path / "a"), str(tmp_path / "b"))]  # identical eval settings
    assert "--mode" not in before  # the head's default setting
    chained = bench.eval_command(Path("h"), Path("t"), tmp_path / "a", bench.parse_args(["--chain", "3"]))
    assert chained[chained.index("--mode"):chained.index("--mode") + 4] == ["--mode", "chain", "--k", "3"]


def test_domain_table_change_and_noise():
    before = {"overall": {"tau": 2.0}, "domains": {"coding": {"tau": 2.0, "speedup_ratio_of_totals": 1.1},
                                                   "writing": {"tau": 1.8}, "math": {"tau": None}}}
    after = {"overall": {"tau": 2.2}, "domains": {"coding": {"tau": 2.6, "lossless_passed": True},
                                                  "writing": {"tau": 1.75}, "math": {"tau": 2.0}}}
    spread = {"coding": [1.9, 2.1], "writing": [1.5, 2.1, 1.8]}
    rows = {r["domain"]: r for r in bench.domain_table(before, after, spread)}
    assert list(rows) == ["coding", "writing", "overall"]  # a domain without tau is left out
    assert rows["coding"]["change"] == 0.6 and rows["coding"]["relative_change"] == 0.3
    assert rows["coding"]["turn_tau_stderr"] == pytest.approx(0.1) and rows["coding"]["beyond_noise"] is True
    assert rows["writing"]["beyond_noise"] is False and rows["coding"]["lossless_after"] is True
    assert rows["overall"]["turn_tau_stderr"] is not None
    assert bench.standard_error([2.0]) is None

    # Paired per-turn changes: writing's -0.05 is tiny next to its prompts' spread but every turn lost about as much,
    # so it is beyond noise; coding's +0.6 came from one turn of two and is not.
    paired = {r["domain"]: r for r in bench.domain_table(before, after, spread,
                                                         {"coding": [1.2, 0.0], "writing": [-0.04, -0.05, -0.06]})}
    assert paired["writing"]["change_stderr"] == 0.006  # sd 0.01 over 3 turns, rounded
    assert paired["writing"]["beyond_noise"] is True and paired["coding"]["beyond_noise"] is False


def test_paired_changes_match_turns_by_prompt_and_turn(tmp_path):
    def answers(folder, rows):
        folder.mkdir()
        (folder / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    before = answers(tmp_path / "b", [{"domain": "coding", "prompt_id": "1", "turn": 0, "tau": 1.5},
                                      {"domain": "coding", "prompt_id": "1", "turn": 1, "tau": 1.2},
                                      {"domain": "math", "prompt_id": "2", "turn": 0, "tau": 1.1}])
    after = answers(tmp_path / "a", [{"domain": "coding", "prompt_id": "1", "turn": 1, "tau": 1.4},
                                     {"domain": "coding", "prompt_id": "1", "turn": 0, "tau": 1.5},
                                     {"domain": "math", "prompt_id": "3", "turn": 0, "tau": 2.0}])
    assert bench.paired_changes(before, after) == {"coding": [pytest.approx(0.0), pytest.approx(0.2)]}


def test_refusals_are_one_line(tmp_path, capsys):
    assert bench.main(["--base-head", str(tmp_path / "nope"), "--target", str(tmp_path), "--adapt-data",
                       str(tmp_path), "--replay-data", str(tmp_path), "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: not found: --base-head") and "\n" not in err
    assert bench.main(["--target", str(tmp_path)]) == 2
    assert "--base-head, --adapt-data, --replay-data, --work required" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_plot_writes_a_png(tmp_path):
    rows = [{"domain": "coding", "tau_before": 2.0, "tau_after": 2.5, "change": 0.5, "turn_tau_stderr": 0.1,
             "change_stderr": 0.05, "beyond_noise": True},
            {"domain": "overall", "tau_before": 2.0, "tau_after": 2.1, "change": 0.1, "turn_tau_stderr": None,
             "change_stderr": None, "beyond_noise": None}]
    path = bench.plot(rows, tmp_path / "domain_adaptation.png", "t")
    assert path.read_bytes()[:4] == b"\x89PNG" and [p.name for p in tmp_path.iterdir()] == [path.name]
