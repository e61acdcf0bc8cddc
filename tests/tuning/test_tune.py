"""Hardware-aware tuning: the cost profile, reach rates, the optimal tree DP, `specgraft tune` and its bad inputs."""

from __future__ import annotations

import itertools
import json

import pytest

from specgraft.cli import main
from specgraft.decoding.acceptance import AcceptanceRecorder, optimal_tree, rank_probabilities, reach_rates, tree_value
from specgraft.errors import SpecgraftError
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer
from specgraft.tuning.cost import CostProfile, check_profile
from specgraft.tuning.tune import (
    Candidate,
    calibration_numbers,
    candidates_for,
    draft_model_candidates,
    predict_setting,
    prefill_per_token,
    step_overhead,
)

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku."]},
    {"question_id": 2, "category": "math", "turns": ["What is 2+2?"]},
]
TARGET = {"name_or_path": "tiny", "architecture": "LlamaForCausalLM", "hidden_size": 64, "vocab_size": 320,
          "num_hidden_layers": 2}


def synthetic_profile(**overrides) -> CostProfile:
    """A CPU-like profile: verifying n tokens costs 1 + 0.1 (n - 1) ms; a draft token 0.3 ms."""
    counts = (1, 2, 3, 4, 6, 8, 12, 16)
    fields = dict(device="cpu", device_name="test-cpu", dtype="float32", threads=1, torch_version="x",
                  target=dict(TARGET), kv_length=64,
                  step_s={"chain": {n: 1e-3 * (1 + 0.1 * (n - 1)) for n in counts},
                          "tree": {n: 1e-3 * (1 + 0.15 * (n - 1)) for n in counts if n >= 3}},
                  forward_s={n: 1e-3 for n in counts},
                  drafters={"draft": {"kind": "draft_model", "chain_s": {str(k): 3e-4 * k for k in range(1, 7)}}})
    fields.update(overrides)
    return CostProfile(**fields)


# -- cost profile --------------------------------------------------------------------------------------------------
def test_cost_profile_json_round_trip(tmp_path):
    profile = synthetic_profile(bookkeeping_s={"chain": {1: 1e-4, 16: 3e-4}})
    path = profile.save(tmp_path / "p.json")
    loaded = CostProfile.load(path)
    assert loaded == profile  # integer keys survive the string keys of JSON
    assert loaded.bookkeeping_cost(4, tree=False) == pytest.approx(1e-4 + 2e-4 * 3 / 15)
    assert loaded.bookkeeping_cost(4, tree=True) is None  # not measured (profiles before the split: none at all)
    assert loaded.step_cost(5, tree=False) == pytest.approx((profile.step_s["chain"][4]
                                                             + profile.step_s["chain"][6]) / 2)
    assert loaded.step_cost(2, tree=True) == profile.step_s["chain"][2]  # 2 tokens are always a chain
    with pytest.raises(SpecgraftError, match="measured tokens verified 1..16, not 17"):
        loaded.step_cost(17, tree=False)


def test_cost_profile_with_missing_fields_is_one_error(tmp_path):
    data = synthetic_profile().to_dict()
    del data["step_s"], data["dtype"]
    (tmp_path / "bad.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(SpecgraftError, match=r"lacks dtype, step_s; re-run `specgraft profile`"):
        CostProfile.load(tmp_path / "bad.json")


def test_step_curves_are_made_monotone():
    from specgraft.tuning.search import monotone

    assert monotone({1: 1.0, 2: 1.6, 4: 1.2, 8: 2.0}) == pytest.approx({1: 1.0, 2: 1.4, 4: 1.4, 8: 2.0})
    assert monotone({1: 1.0, 3: 2.0}) == {1: 1.0, 3: 2.0}


def test_profile_from_another_device_or_target_warns_naming_both():
    profile = synthetic_profile(device="cuda:0", device_name="NVIDIA H200")
    other = {**TARGET, "name_or_path": "big", "hidden_size": 4096}
    warnings = check_profile(profile, other, "cpu", threads=1)
    assert len(warnings) == 2
    assert "target tiny but this target is big" in warnings[0] and "hidden_size 64 vs 4096" in warnings[0]
    assert "measured on cuda:0 (NVIDIA H200, 1 threads) but this run is on cpu" in warnings[1]
    assert check_profile(synthetic_profile(device_name=profile_device_name()), dict(TARGET), "cpu", 1) == []


def profile_device_name() -> str:
    from specgraft.tuning.cost import device_description

    return device_description("cpu")


# -- reach rates and simulate ------------------------------------------------------------------------------------
def tree_report(tmp_path):
    """A tree run with a known answer: 100 steps, depth 1 accepted 80 times, depth 2 30 times but attempted only
    40 times (the other 40 accepted depth-1 nodes were leaves). True tau = 1 + 0.8 + 0.3 = 2.1; the conditional
    product 1 + 0.8 + 0.8 * 0.75 = 2.4 overstates it."""
    overall = {"acceptance_by_depth": [0.8, 0.75], "depth_accepted": [80, 30], "depth_attempted": [100, 40],
               "steps": 100, "tau": 2.1, "speedup_ratio_of_totals": 1.2, "draft_cost_per_step": 0.1,
               "verify_cost_per_step": 1.5, "alpha_exact": None}
    report = {"drafter": {"type": "medusa", "mode": "tree", "k": 2, "tree_size": 4}, "overall": overall}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    return path


def test_reach_rates():
    assert reach_rates([80, 30], 100) == [0.8, 0.3]
    assert reach_rates([], 0) == []
    with pytest.raises(SpecgraftError):
        reach_rates([101], 100)


def test_simulate_uses_reach_rates_for_trees(tmp_path, capsys):
    path = tree_report(tmp_path)
    code = main(["simulate", "--report", str(path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["tau"] == pytest.approx(2.1)  # not 2.4 (the conditional product)
    assert data["speedup"] == pytest.approx(2.1 / (0.1 + 1.5))
    assert data["acceptance_by_depth"] == pytest.approx([0.8, 0.3])


# -- acceptance recording ----------------------------------------------------------------------------------------
def test_recorder_counts_depth_rank_and_nodes():
    # root -> nodes 0 (rank 0), 1 (rank 1); node 0 -> node 2; node 1 -> node 3
    parents = [-1, -1, 0, 1]
    rec = AcceptanceRecorder(static_paths=[[0], [1], [0, 0], [1, 0]])
    rec.reset()
    rec.record(parents, [1, 3])  # rank-1 child, then its child
    rec.record(parents, [0])  # rank-0 child, its child rejected
    rec.record(parents, [])  # nothing accepted
    assert rec.attempts == [[3, 3], [2]] and rec.accepts == [[1, 1], [1]]
    assert rec.to_dict()["node_accepted"] == [1, 1, 0, 1]
    assert rec.to_dict()["node_reach"] == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    probs = rank_probabilities(rec.to_dict(), prior=[[0.9, 0.5, 0.2]], min_attempts=2)
    assert probs[0] == pytest.approx([1 / 3, 1 / 3, 0.2])  # the unmeasured rank 2 takes the prior
    assert probs[1] == pytest.approx([0.5])


# -- the optimal tree --------------------------------------------------------------------------------------------
def all_trees(max_depth: int, max_rank: int, size: int, widths=None):
    """Every prefix-closed set of ``size`` rank paths (brute force); ``widths[d]`` limits the ranks per depth."""
    ranks = [range(widths[d] if widths else max_rank) for d in range(max_depth)]
    universe = [p for d in range(1, max_depth + 1) for p in itertools.product(*ranks[:d])]
    for combo in itertools.combinations(universe, size):
        chosen = set(combo)
        if all(len(p) == 1 or p[:-1] in chosen for p in combo):
            yield combo


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_optimal_tree_matches_brute_force(size):
    # Depth-dependent rates that are NOT monotone in rank at depth 2 (so a greedy by rank would be wrong).
    probs = [[0.6, 0.25, 0.1], [0.3, 0.5, 0.05], [0.7, 0.1, 0.1]]
    best = max(tree_value(t, probs) for t in all_trees(3, 3, size))
    value, paths = optimal_tree(probs, size)
    assert len(paths) == size and value == pytest.approx(best)
    assert tree_value(paths, probs) == pytest.approx(value)
    assert all(len(p) == 1 or p[:-1] in set(paths) for p in paths)


def test_optimal_tree_respects_depth_and_rank_limits():
    probs = [[0.9, 0.8], [0.9, 0.8], [0.9, 0.8]]
    value, paths = optimal_tree(probs, 3, max_depth=1)
    assert paths == [(0,), (1,)] and value == pytest.approx(1.7)  # only two depth-1 slots exist
    _, chain = optimal_tree(probs, 3, max_rank=1)
    assert chain == [(0,), (0, 0), (0, 0, 0)]


# -- choosing --------------------------------------------------------------------------------------------------------
def test_tune_picks_the_known_best_draft_length():
    # reach 0.9, 0.8, 0.4, 0.1, ...: speed (1 + sum reach[:k]) / (0.3k + 1 + 0.1k) ms is best at k=2.
    reach = [0.9, 0.8, 0.4, 0.1, 0.05, 0.01]
    profile = synthetic_profile()
    ranked = candidates_for("draft_model", profile, profile.drafters["draft"],
                            {"reach": reach, "drafter": {"mode": "chain"}, "statistics": None})
    speeds = {k: (1 + sum(reach[:k])) / (3e-4 * k + 1e-3 * (1 + 0.1 * k)) for k in range(1, 7)}
    assert ranked[0].setting == {"mode": "chain", "k": max(speeds, key=speeds.get)} == {"mode": "chain", "k": 2}
    assert ranked[0].tokens_per_s == pytest.approx(speeds[2])
    assert ranked[0].speedup == pytest.approx(speeds[2] * 1e-3)
    assert [c.setting["k"] for c in ranked] == sorted(speeds, key=speeds.get, reverse=True)
    assert len(draft_model_candidates(profile, profile.drafters["draft"], reach[:3])) == 3  # no extrapolation


def test_calibrated_step_overhead_is_charged_to_every_candidate():
    reach = [0.9, 0.8, 0.4, 0.1, 0.05, 0.01]
    profile = synthetic_profile()
    costs = profile.drafters["draft"]
    calibration = {"reach": reach, "drafter": {"mode": "chain"}, "statistics": None}
    at_k4 = predict_setting("draft_model", {"mode": "chain", "k": 4}, profile, costs, calibration)
    # The calibration ran at k=4 on a machine twice as slow as the profile's, each step 1 ms (profile time) over.
    drift, tau = 2.0, 1 + at_k4.expected_accepted
    step = (at_k4.draft_s + at_k4.step_s + 1e-3) * drift
    measured = {"tau": tau, "tokens_per_s": tau / step, "baseline_tokens_per_s": 1 / (profile.plain_step_s * drift)}
    assert step_overhead(measured, at_k4, profile) == pytest.approx(1e-3)
    calibration["step_overhead_s"] = 1e-3
    ranked = candidates_for("draft_model", profile, costs, calibration)
    speeds = {k: (1 + sum(reach[:k])) / (3e-4 * k + 1e-3 * (1 + 0.1 * k) + 1e-3) for k in range(1, 7)}
    # A per-step cost favours longer drafts: k=3 now, k=2 without it (test above).
    assert ranked[0].setting["k"] == max(speeds, key=speeds.get) == 3
    assert [c.setting["k"] for c in ranked] == sorted(speeds, key=speeds.get, reverse=True)
    assert all(c.overhead_s == 1e-3 for c in ranked)
    again = predict_setting("draft_model", {"mode": "chain", "k": 4}, profile, costs, calibration)
    assert again.tokens_per_s == pytest.approx(speeds[4]) and again.speedup == pytest.approx(speeds[4] * 1e-3)
    # A run faster than its prediction charges nothing; so do missing or non-finite numbers.
    assert step_overhead({**measured, "tokens_per_s": 10 * measured["tokens_per_s"]}, at_k4, profile) == 0.0
    assert step_overhead({**measured, "tau": float("nan")}, at_k4, profile) == 0.0
    assert step_overhead({"tau": tau}, at_k4, profile) == 0.0


def calibration_run(profile, at, *, drift, overhead, prefill, verify_error=0.0, steps=100):
    """The overall metrics an eval at ``at``'s setting reports when every part of its steps is as the model says,
    on a machine ``drift`` times slower than the profile's: the verification forward costs ``verify_error`` more
    per step than the profile's (timing noise at that token count), a step ``overhead`` more beyond that, and each
    answer's prefill ``prefill`` seconds (profile speed)."""
    tokens = steps * (1 + at.expected_accepted)
    verify = at.step_s - profile.bookkeeping_cost(at.verified_tokens, at.tree) + verify_error
    step = at.draft_s + at.step_s + verify_error + overhead
    wall = drift * (steps * step + prefill)
    base_wall = drift * (tokens * profile.plain_step_s + prefill)
    return {"steps": steps, "new_tokens": tokens, "tau": 1 + at.expected_accepted, "wall_time_s": wall,
            "tokens_per_s": tokens / wall, "prefill_time_s": drift * prefill, "verify_time_s": drift * steps * verify,
            "baseline_new_tokens": tokens, "baseline_prefill_time_s": drift * prefill,
            "baseline_tokens_per_s": tokens / base_wall, "speedup_ratio_of_totals": base_wall / wall}


def test_calibration_predicts_its_own_run_and_keeps_verify_noise_out_of_the_overhead():
    reach = [0.9, 0.8, 0.4, 0.1, 0.05, 0.01]
    profile = synthetic_profile(bookkeeping_s={"chain": {n: 2e-4 for n in (1, 2, 3, 4, 6, 8, 12, 16)}})
    costs = profile.drafters["draft"]
    calibration = {"reach": reach, "drafter": {"mode": "chain"}, "statistics": None}
    at_k4 = predict_setting("draft_model", {"mode": "chain", "k": 4}, profile, costs, calibration)
    assert (at_k4.verified_tokens, at_k4.tree) == (5, False)
    run = calibration_run(profile, at_k4, drift=1.5, overhead=4e-4, prefill=6e-3)
    assert step_overhead(run, at_k4, profile) == pytest.approx(4e-4)
    assert prefill_per_token(run, profile.plain_step_s) == pytest.approx(6e-3 / run["new_tokens"])
    calibration.update(step_overhead_s=step_overhead(run, at_k4, profile),
                       prefill_s_per_token=prefill_per_token(run, profile.plain_step_s))
    again = predict_setting("draft_model", {"mode": "chain", "k": 4}, profile, costs, calibration)
    # Its own run is predicted exactly: tokens/s at the profile's speed, and the speedup both runs measured
    # (the prefill, paid by plain decoding alike, narrows it).
    assert again.tokens_per_s == pytest.approx(run["tokens_per_s"] * 1.5)
    assert again.speedup == pytest.approx(run["speedup_ratio_of_totals"])
    # The verification forward ran 0.3 ms slower than the profile's value at 5 tokens: that noise belongs to this
    # one token count, so it is not charged to every candidate as overhead; a slower rest of the step is.
    noisy = calibration_run(profile, at_k4, drift=1.5, overhead=4e-4, prefill=6e-3, verify_error=3e-4)
    assert step_overhead(noisy, at_k4, profile) == pytest.approx(4e-4)
    assert step_overhead({k: v for k, v in noisy.items() if k != "verify_time_s"}, at_k4, profile) == \
        pytest.approx(7e-4)  # without the measured part: the profile's step_s, noise and all
    # A profile without the bookkeeping part (older files) falls back to its step_s alike.
    assert step_overhead(noisy, at_k4, synthetic_profile()) == pytest.approx(7e-4)


def test_tune_medusa_trades_tree_size_for_verify_cost():
    stats = {"rank_attempts": [[100, 100, 100], [80, 80], [60]], "rank_accepts": [[60, 20, 5], [48, 8], [30]]}
    # A call costs 0.1 ms per head plus 0.01 ms per node (measured at 1 and 31 nodes, linear between).
    per_call = {str(h): {str(n): 1e-4 * h + 1e-5 * n for n in (1, 31)} for h in (1, 2, 3)}
    profile = synthetic_profile(drafters={"m": {"kind": "medusa", "per_call_s": per_call}})
    calibration = {"reach": [], "statistics": stats, "drafter": {}}
    ranked = candidates_for("medusa", profile, profile.drafters["m"], calibration)
    best = ranked[0]
    # Brute force over every tree (up to all 15 nodes with a measured rate) with the same cost model.
    probs = rank_probabilities(stats)

    def speed(tree) -> float:
        depth = max(len(p) for p in tree)
        chain = all(r == 0 for p in tree for r in p) and len(tree) == depth
        draft = 1e-4 * depth + 1e-5 * len(tree)
        return (1 + tree_value(tree, probs)) / (draft + profile.step_cost(len(tree) + 1, tree=not chain))

    brute = max(speed(t) for n in range(1, 16) for t in all_trees(3, 3, n, widths=[3, 2, 1]))
    assert best.tokens_per_s == pytest.approx(brute)
    again = predict_setting("medusa", best.setting, profile, profile.drafters["m"], calibration)
    assert isinstance(again, Candidate) and again.tokens_per_s == pytest.approx(best.tokens_per_s)


def test_calibration_report_with_missing_fields_is_one_error():
    with pytest.raises(SpecgraftError, match=r"lacks overall.steps, overall.depth_accepted; re-run"):
        calibration_numbers({"overall": {"tau": 2.0}}, "r.json")
    with pytest.raises(SpecgraftError, match="verified no drafts"):
        calibration_numbers({"overall": {"steps": 0, "depth_accepted": []}}, "r.json")


# -- end to end on a tiny target ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    tok = tiny_tokenizer()
    target = tiny_model("llama")
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    from specgraft.heads.medusa.model import MedusaConfig, MedusaHead

    wrapped = Target(target, tok, name_or_path=str(root / "target"))
    MedusaHead.build(wrapped, MedusaConfig(num_heads=2, hidden_size=64, vocab_size=320)).save_pretrained(
        root / "medusa")
    (root / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    (root / "empty.jsonl").write_text("", encoding="utf-8")
    return root


def cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def tune_a_copy(disk, tmp_path, profile, min_speedup: str, capsys):
    """`specgraft tune` on a copy of the tiny Medusa head (8 tokens per calibration turn): (head, code, out, err)."""
    import shutil

    head = tmp_path / "medusa"
    shutil.copytree(disk / "medusa", head)
    code, out, err = cli(["tune", "--target", disk / "target", "--head", head, "--prompts", disk / "q.jsonl",
                          "--cost-profile", profile, "--max-new-tokens", "8", "--out", tmp_path / "tune",
                          "--min-speedup", min_speedup], capsys)
    return head, code, out, err


@pytest.mark.slow
def test_profile_tune_eval_export_end_to_end(disk, tmp_path, capsys):
    profile = tmp_path / "profile.json"
    code, out, err = cli(["profile", "--target", disk / "target", "--head", disk / "medusa", "--out", profile,
                          "--kv-length", "16", "--token-counts", "1,2,3,4,8,16,24,32,48,64", "--repeats", "1"],
                         capsys)
    assert code == 0, err
    data = json.loads(profile.read_text(encoding="utf-8"))
    assert set(data["step_s"]) == {"chain", "tree"} and "64" in data["step_s"]["tree"]
    for mode, table in data["bookkeeping_s"].items():  # the part of each step outside the verification forward
        assert table.keys() <= data["step_s"][mode].keys()
        assert all(0 <= s <= data["step_s"][mode][n] for n, s in table.items())
    per_call = data["drafters"][str(disk / "medusa")]["per_call_s"]
    assert per_call.keys() == {"1", "2"} and set(per_call["2"]) == {"3", "7", "15", "31", "63"}
    assert data["target"]["hidden_size"] == 64 and data["threads"] >= 1

    # --min-speedup below any measurement: a drafting setting is kept whatever the untrained head measures, so its
    # path through eval and export is pinned (plain decoding: test_tuned_plain_decoding_end_to_end).
    head, code, out, err = tune_a_copy(disk, tmp_path, profile, "1e-9", capsys)
    assert code == 0, err
    tuned = json.loads((head / "tuned.json").read_text(encoding="utf-8"))
    assert tuned["kind"] == "medusa" and tuned["device"]["device"] == "cpu"
    assert set(tuned["measured"]) == {"best", "tuned", "default"} and tuned["setting"]["paths"]
    assert "predicted" in out and "measured" in out
    calibration = json.loads((tmp_path / "tune" / "calibration" / "report.json").read_text(encoding="utf-8"))
    stats = calibration["acceptance_statistics"]
    assert len(stats["node_reach"]) == 63 and stats["verdicts"] > 0
    overall = calibration["overall"]
    # reach rates are the unconditional depth counts: tau = 1 + sum(reach) exactly
    assert overall["tau"] == pytest.approx(1 + sum(overall["reach_by_depth"]))

    # eval uses tuned.json by default, and an explicit flag wins
    code, _, err = cli(["eval", "--target", disk / "target", "--head", head, "--prompts", disk / "q.jsonl",
                        "--out", tmp_path / "e1", "--max-new-tokens", "4", "--no-progress"], capsys)
    assert code == 0, err
    drafter = json.loads((tmp_path / "e1" / "report.json").read_text(encoding="utf-8"))["drafter"]
    assert drafter["setting_source"].startswith("tuned (") and drafter["tree_size"] == tuned["setting"]["tree_size"]
    code, _, err = cli(["eval", "--target", disk / "target", "--head", head, "--prompts", disk / "q.jsonl",
                        "--out", tmp_path / "e2", "--max-new-tokens", "4", "--no-progress", "--tree-size", "5"],
                       capsys)
    drafter = json.loads((tmp_path / "e2" / "report.json").read_text(encoding="utf-8"))["drafter"]
    assert code == 0 and drafter["setting_source"] == "flags" and drafter["tree_size"] == 5

    # exports carry the tuned setting: TRT-LLM medusa_choices, vLLM num_speculative_tokens in the card
    from specgraft.export.exporter import export_head

    result = export_head(head, "trtllm", tmp_path / "x", report=tmp_path / "e1")
    config = json.loads((result.path / "config.json").read_text(encoding="utf-8"))
    assert config["medusa_choices"] == tuned["setting"]["paths"]
    card = (result.path / "README.md").read_text(encoding="utf-8")
    # vLLM's Medusa runs every head: its num_speculative_tokens stays the head count whatever the tuned depth.
    heads = json.loads((head / "head_config.json").read_text(encoding="utf-8"))["config"]["num_heads"]
    assert "Chosen by `specgraft tune` on cpu" in card and f'"num_speculative_tokens": {heads}' in card
    # auto measured nothing to switch on the tiny target: stock, and the card says so
    assert tuned["device"]["linear_kernel"] == "stock" and "stock linear kernel" in card
    meta = json.loads((result.path / "specgraft_export.json").read_text(encoding="utf-8"))
    assert "vllm" not in meta["tuned"]["engines"]
    assert meta["tuned"]["engines"]["trtllm"]["max_draft_len"] == tuned["setting"]["depth"]

    # simulate predicts the calibration's setting on the profile's device
    code, out, err = cli(["simulate", "--report", tmp_path / "tune" / "calibration", "--cost-profile", profile,
                          "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["tau"] == pytest.approx(overall["tau"], rel=0.05)


@pytest.mark.parametrize("case", ["no_prompts", "empty_prompts", "bad_calibration", "tree_over_context",
                                  "bad_profile", "profile_needs_report"])
def test_bad_input_exits_2_with_one_error_line(disk, tmp_path, capsys, case):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"overall": {"tau": 2.0}}), encoding="utf-8")
    base = ["tune", "--target", disk / "target", "--head", disk / "medusa"]
    args, fragment = {
        "no_prompts": (base, "tuning needs calibration prompts"),
        "empty_prompts": (base + ["--prompts", disk / "empty.jsonl"], "prompt"),
        "bad_calibration": (base + ["--prompts", disk / "q.jsonl", "--calibration", bad],
                            "lacks overall.steps, overall.depth_accepted"),
        "tree_over_context": (["profile", "--target", disk / "target", "--out", tmp_path / "p.json",
                               "--kv-length", "100000"], "but the target's context is"),
        "bad_profile": (base + ["--prompts", disk / "q.jsonl", "--cost-profile", bad], "lacks version"),
        "profile_needs_report": (["simulate", "--alpha", "0.5", "--draft-length", "2", "--cost-profile", bad],
                                 "pass --report too"),
    }[case]
    code, out, err = cli(args, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and fragment in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "p.json").exists() and not (disk / "medusa" / "tuned.json").exists()


def test_draft_model_cost_charges_the_expected_catch_up():
    from specgraft.tuning.tune import draft_model_cost

    drafter = {"kind": "draft_model", "chain_s": {"2": 1e-3}, "catchup_s": {"1": 1e-4, "2": 2e-4, "3": 4e-4}}
    # 1.5 accepted drafts + the bonus = 2.5 tokens to catch up on: 3e-4 by interpolation, 1e-4 already in chain_s
    assert draft_model_cost(drafter, 2, 1.5) == pytest.approx(1e-3 + 3e-4 - 1e-4)
    assert draft_model_cost({"kind": "draft_model", "chain_s": {"2": 1e-3}}, 2, 1.5) == pytest.approx(1e-3)


# -- plain decoding as the tuned outcome -------------------------------------------------------------------------
def _result_with(best_speedup: float, default_speedup: float | None = None):
    from specgraft.tuning.tune import TuneResult, finish_candidate

    profile = synthetic_profile()
    plain = profile.plain_step_s
    best = finish_candidate(Candidate({"mode": "chain", "k": 2}, 0.5, 3e-4, profile.step_cost(3, tree=False)), plain)
    default = finish_candidate(Candidate({"mode": "chain", "k": 4}, 0.6, 1.2e-3, profile.step_cost(5, tree=False)),
                               plain)
    result = TuneResult("draft_model", best, default, [best, default])
    if default_speedup is not None:
        result.measured = {"best": {"tau": 1.5, "tokens_per_s": 30.0 * best_speedup, "baseline_tokens_per_s": 30.0,
                                    "speedup_ratio_of_totals": best_speedup},
                           "default": {"tau": 1.6, "tokens_per_s": 30.0 * default_speedup,
                                       "baseline_tokens_per_s": 30.0, "speedup_ratio_of_totals": default_speedup}}
    return result, profile


def test_tune_chooses_plain_decoding_when_nothing_measured_beats_it():
    from specgraft.tuning.tune import choose, is_plain, tuned_record

    # Measured: the predicted best 0.93x, the default 0.81x -> plain decoding, 1.00x by definition.
    result, profile = _result_with(0.93, 0.81)
    choose(result, profile.plain_step_s)
    assert is_plain(result.chosen.setting) and result.chosen.speedup == pytest.approx(1.0)
    assert result.chosen.tokens_per_s == pytest.approx(1 / profile.plain_step_s)
    assert result.measured["tuned"]["speedup_ratio_of_totals"] == 1.0
    assert result.measured["tuned"]["tokens_per_s"] == 30.0
    assert result.measured["best"]["speedup_ratio_of_totals"] == 0.93
    record = tuned_record(result, profile, "calib.json")
    assert record["setting"] == {"mode": "plain"} and record["predicted"]["tau"] == 1.0
    assert record["best_drafting"]["setting"] == {"mode": "chain", "k": 2}
    assert record["best_drafting"]["measured"]["speedup_ratio_of_totals"] == 0.93
    # Measured wins over predicted: the default measured faster than the predicted best is kept.
    result, profile = _result_with(0.95, 1.12)
    choose(result, profile.plain_step_s)
    assert result.chosen.setting == {"mode": "chain", "k": 4}
    assert result.measured["tuned"]["speedup_ratio_of_totals"] == 1.12
    # The predicted best measured fastest and over the bar: chosen; a higher bar turns it down.
    result, profile = _result_with(1.10, 0.90)
    assert choose(result, profile.plain_step_s).chosen.setting == {"mode": "chain", "k": 2}
    assert is_plain(choose(result, profile.plain_step_s, min_speedup=1.2).chosen.setting)
    # Unconfirmed (--no-confirm), the prediction decides.
    result, profile = _result_with(0.0)
    assert result.candidates[0].speedup > 1  # the synthetic costs predict a gain
    assert choose(result, profile.plain_step_s).chosen.setting == {"mode": "chain", "k": 2}
    assert is_plain(choose(result, profile.plain_step_s, min_speedup=10.0).chosen.setting)
    assert "tuned" not in result.measured
    with pytest.raises(SpecgraftError, match="--min-speedup must be a positive number"):
        choose(result, profile.plain_step_s, min_speedup=float("nan"))


def _measurement(speedup: float) -> dict:
    return {"tau": 2.0, "tokens_per_s": 30.0 * speedup, "baseline_tokens_per_s": 30.0,
            "speedup_ratio_of_totals": speedup}


def test_a_best_that_falls_short_gets_a_second_opinion_of_the_other_shape():
    from specgraft.tuning.tune import (
        SECOND_OPINION_SHORTFALL,
        TuneResult,
        choose,
        finish_candidate,
        is_plain,
        second_opinion,
        tuned_record,
    )

    profile = synthetic_profile()
    plain = profile.plain_step_s

    def candidate(setting: dict, accepted: float, tokens: int, tree: bool) -> Candidate:
        return finish_candidate(Candidate(setting, accepted, 2e-4, profile.step_cost(tokens, tree=tree),
                                          verified_tokens=tokens, tree=tree), plain)

    # Ranked as the tuner ranks them: two trees predicted ahead of the best chain; a slow chain last.
    tree_a = candidate({"mode": "tree", "tokens": 12}, 5.5, 12, True)
    tree_b = candidate({"mode": "tree", "tokens": 8}, 3.8, 8, True)
    chain = candidate({"mode": "chain", "depth": 3}, 1.8, 4, False)
    slow_chain = finish_candidate(Candidate({"mode": "chain", "depth": 1}, 0.05, 8e-4,
                                            profile.step_cost(2, tree=False), verified_tokens=2), plain)
    ranked = [tree_a, tree_b, chain, slow_chain]
    assert tree_a.speedup > tree_b.speedup > chain.speedup > 1.0 > slow_chain.speedup

    # The best delivered (within the shortfall): no second opinion; nothing measured: none either.
    assert second_opinion(ranked, _measurement(tree_a.speedup * (1 - SECOND_OPINION_SHORTFALL / 2))) is None
    assert second_opinion(ranked, None) is None
    # It fell short: the best chain (not the runner-up tree) is confirmed too; a chain below the bar never is.
    short = _measurement(tree_a.speedup * (1 - 2 * SECOND_OPINION_SHORTFALL))
    assert second_opinion(ranked, short) is chain
    assert second_opinion(ranked, short, min_speedup=chain.speedup + 0.01) is None
    assert second_opinion([chain, slow_chain, tree_b], _measurement(0.5)) is tree_b  # and the reverse

    # choose() weighs the second opinion's measurement like the others': here it is the fastest.
    default = candidate({"mode": "tree", "tokens": 16}, 3.2, 16, True)
    result = TuneResult("eagle3", tree_a, default, ranked, alternative=chain,
                        measured={"best": _measurement(0.9), "alternative": _measurement(1.2),
                                  "default": _measurement(0.8)})
    choose(result, plain)
    assert result.chosen is chain and result.measured["tuned"]["speedup_ratio_of_totals"] == 1.2
    record = tuned_record(result, profile, "calib.json")
    assert record["setting"] == chain.setting and record["alternative"]["setting"] == chain.setting
    assert record["measured"]["alternative"]["speedup_ratio_of_totals"] == 1.2
    # Nothing beats plain decoding: the record names the fastest drafting setting measured, the second opinion.
    result.measured = {"best": _measurement(0.85), "alternative": _measurement(0.95), "default": _measurement(0.8)}
    choose(result, plain)
    assert is_plain(result.chosen.setting)
    best_drafting = tuned_record(result, profile, "calib.json")["best_drafting"]
    assert best_drafting["setting"] == chain.setting and best_drafting["measured"]["speedup_ratio_of_totals"] == 0.95


def test_a_calibration_measured_fastest_is_chosen_and_its_eval_folder_named(tmp_path):
    """The calibration run at a non-default setting (DFlash's widest tree) is measured like the confirming evals:
    when it is the fastest it is the tuned setting, and report_dir names the folder that measured it (a bench once
    read the predicted best's folder for a second opinion's setting, and the calibration's for the default)."""
    from specgraft.tuning.tune import TuneResult, choose, finish_candidate, tuned_record

    profile = synthetic_profile()
    plain = profile.plain_step_s

    def candidate(setting: dict, accepted: float, tokens: int) -> Candidate:
        return finish_candidate(Candidate(setting, accepted, 2e-4, profile.step_cost(tokens, tree=True),
                                          verified_tokens=tokens, tree=True), plain)

    best = candidate({"mode": "chain", "depth": 4}, 1.3, 5)
    tree = candidate({"mode": "tree", "top_k": 2, "depth": 4}, 1.5, 9)
    widest = candidate({"mode": "tree", "top_k": 3, "depth": 4}, 1.8, 13)
    dirs = {key: tmp_path / key for key in ("best", "alternative", "default", "calibration")}
    result = TuneResult("dflash", best, best, [best, tree, widest], alternative=tree, calibrated=widest,
                        measured={"best": _measurement(1.08), "alternative": _measurement(1.15),
                                  "default": _measurement(1.08), "calibration": _measurement(1.28)},
                        report_dirs=dirs)
    choose(result, plain)
    assert result.chosen is widest and result.chosen_from == "calibration"
    assert result.measured["tuned"]["speedup_ratio_of_totals"] == 1.28
    assert result.report_dir() == dirs["calibration"] and result.report_dir("default") == dirs["default"]
    record = tuned_record(result, profile, "calib.json")
    assert record["setting"] == widest.setting and record["measured_by"] == "calibration"
    assert record["calibrated"]["setting"] == widest.setting
    # Slower than the second opinion: the second opinion is chosen, from its own folder.
    result.measured["calibration"] = _measurement(1.10)
    choose(result, plain)
    assert result.chosen is tree and result.report_dir() == dirs["alternative"]
    # Unconfirmed: no folder measured anything.
    result.measured = {}
    choose(result, plain)
    assert result.chosen is best and result.chosen_from is None and result.report_dir() is None


def test_tuned_plain_decoding_end_to_end(disk, tmp_path, capsys, caplog):
    """--min-speedup above anything reachable: tune measures the best setting, stores plain decoding; eval then
    decodes plainly (token-identical, tau 1) and the export carries no tuned engine hints, saying why."""
    profile = tmp_path / "profile.json"
    code, _, err = cli(["profile", "--target", disk / "target", "--head", disk / "medusa", "--out", profile,
                        "--kv-length", "16", "--token-counts", "1,2,3,4,8,16,32,64", "--repeats", "1"], capsys)
    assert code == 0, err
    head, code, out, err = tune_a_copy(disk, tmp_path, profile, "1000", capsys)
    assert code == 0, err
    tuned = json.loads((head / "tuned.json").read_text(encoding="utf-8"))
    assert tuned["setting"] == {"mode": "plain"} and tuned["best_drafting"]["setting"]["paths"]
    assert tuned["measured"]["best"]["speedup_ratio_of_totals"] > 0  # the best drafting setting WAS measured
    assert "tuned: plain decoding (no drafting): 1.00x" in out and "predicted best:" in out
    assert "no drafting setting is faster than plain decoding" in out

    code, _, err = cli(["eval", "--target", disk / "target", "--head", head, "--prompts", disk / "q.jsonl",
                        "--out", tmp_path / "e", "--max-new-tokens", "6", "--no-progress"], capsys)
    assert code == 0, err
    assert "no drafting setting was faster than plain decoding" in caplog.text
    report = json.loads((tmp_path / "e" / "report.json").read_text(encoding="utf-8"))
    assert report["drafter"]["mode"] == "plain" and report["drafter"]["setting_source"].startswith("tuned (")
    overall = report["overall"]
    assert overall["tau"] == pytest.approx(1.0) and overall["lossless_passed"]
    assert overall["steps"] == overall["new_tokens"]  # one token per step: nothing drafted

    from specgraft.export.exporter import export_head

    result = export_head(head, "trtllm", tmp_path / "x")
    assert any("no drafting setting faster than plain decoding" in w for w in result.warnings)
    meta = json.loads((result.path / "specgraft_export.json").read_text(encoding="utf-8"))
    assert meta["tuned"]["engines"] == {} and "medusa_choices" not in json.loads(
        (result.path / "config.json").read_text(encoding="utf-8"))
    card = (result.path / "README.md").read_text(encoding="utf-8")
    assert "No drafting setting was faster than plain decoding on that device" in card


def test_min_speedup_must_be_positive(disk, tmp_path, capsys):
    for value in ("nan", "0", "-1"):
        code, _, err = cli(["tune", "--target", disk / "target", "--head", disk / "medusa", "--prompts",
                            disk / "q.jsonl", "--min-speedup", value], capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "--min-speedup must be a positive number" in errors[0], err
    assert not (disk / "medusa" / "tuned.json").exists()
