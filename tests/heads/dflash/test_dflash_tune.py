"""`specgraft tune` for DFlash: the search over chain lengths and per-slot top-k trees picks the analytically best
setting from a cost profile and calibration statistics, and the tuned setting reaches eval, the vLLM export and the
card through the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from specgraft.cli import main
from specgraft.errors import SpecgraftError
from specgraft.heads.dflash.tune import setting_paths
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer
from specgraft.tuning.cost import CostProfile
from specgraft.tuning.tune import candidates_for, predict_setting, same_setting, setting_label
from tests.heads.dflash.helpers import make_head

TARGET = {"name_or_path": "tiny", "architecture": "Qwen3ForCausalLM", "hidden_size": 64, "vocab_size": 320,
          "num_hidden_layers": 2}
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24)
#: Calibration rates p[d][r] for depths 1..7 and ranks 0..2 (slot d's rank-r token accepted, given the spine
#: reached depth d - 1), as counts over 1000 attempts each.
RATES = [[0.8, 0.1, 0.05], [0.7, 0.1, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.05], [0.4, 0.1, 0.05],
         [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]
ATTEMPTS = 1000
DRAFT_S = {1: 2e-4, 2: 2.5e-4, 3: 3e-4}  # one block forward: chain (width 1) and trees of width 2, 3


def profile(chain_per_token: float, tree_per_token: float) -> CostProfile:
    """A plain step of 1 ms; verifying n tokens costs 1 + per_token (n - 1) ms; the DFlash block forward costs
    DRAFT_S whatever the depth."""
    return CostProfile(
        device="cpu", device_name="test-cpu", dtype="float32", threads=1, torch_version="x", target=dict(TARGET),
        kv_length=64, step_s={"chain": {n: 1e-3 * (1 + chain_per_token * (n - 1)) for n in COUNTS},
                              "tree": {n: 1e-3 * (1 + tree_per_token * (n - 1)) for n in COUNTS if n >= 3}},
        drafters={"d": {"kind": "dflash", "block_size": 8, "chain_s": {"7": DRAFT_S[1]},
                        "tree_s": {"2": DRAFT_S[2], "3": DRAFT_S[3]}}})


def calibration(rates=RATES) -> dict:
    stats = {"rank_attempts": [[ATTEMPTS] * len(row) for row in rates],
             "rank_accepts": [[round(p * ATTEMPTS) for p in row] for row in rates]}
    return {"reach": [], "statistics": stats, "drafter": {"mode": "tree", "top_k": 3, "depth": 7}}


def reference_speeds(prof: CostProfile) -> dict[tuple[int, int], float]:
    """(width, depth) -> tokens/s computed directly: E = sum_d (prod_{j<d} p[j][0]) * sum_{r<k} p[d][r]."""
    speeds = {}
    for width in (1, 2, 3):
        for depth in range(1, 8):
            tokens = 1 + width * depth
            if tokens > max(COUNTS):
                continue
            expected, spine = 0.0, 1.0
            for d in range(depth):
                expected += spine * sum(RATES[d][:width])
                spine *= RATES[d][0]
            step = prof.step_cost(tokens, tree=width > 1)
            speeds[(width, depth)] = (1 + expected) / (DRAFT_S[width] + step)
    return speeds


def as_key(setting: dict) -> tuple[int, int]:
    return (setting["top_k"] if setting["mode"] == "tree" else 1, setting["depth"])


@pytest.mark.parametrize(("chain_per_token", "tree_per_token", "expected_best"), [
    (0.3, 0.35, (1, 2)),  # a CPU: verifying costs grow with the tokens, so a 2-token chain beats the full block
    (0.005, 0.0, (3, 7)),  # a GPU-like flat tree curve: the widest, deepest tree wins
])
def test_search_picks_the_analytically_best_setting(chain_per_token, tree_per_token, expected_best):
    prof = profile(chain_per_token, tree_per_token)
    ranked = candidates_for("dflash", prof, prof.drafters["d"], calibration())
    speeds = reference_speeds(prof)
    best = max(speeds, key=speeds.get)
    assert best == expected_best
    assert as_key(ranked[0].setting) == best
    assert ranked[0].tokens_per_s == pytest.approx(speeds[best])
    assert ranked[0].speedup == pytest.approx(speeds[best] * prof.plain_step_s)
    # Every measurable setting is a candidate exactly once, predicted as the direct formula, ranked by speed.
    assert sorted(as_key(c.setting) for c in ranked) == sorted(speeds)
    for c in ranked:
        assert c.tokens_per_s == pytest.approx(speeds[as_key(c.setting)])
    assert [c.tokens_per_s for c in ranked] == sorted((c.tokens_per_s for c in ranked), reverse=True)


def test_default_is_predicted_like_its_candidate_and_the_shorter_chain_beats_it():
    prof = profile(0.3, 0.35)
    calib = calibration()
    default = predict_setting("dflash", {"mode": "chain", "depth": 7}, prof, prof.drafters["d"], calib)
    unset = predict_setting("dflash", {"mode": "chain"}, prof, prof.drafters["d"], calib)  # depth: every slot
    speeds = reference_speeds(prof)
    assert default.tokens_per_s == pytest.approx(speeds[(1, 7)]) == pytest.approx(unset.tokens_per_s)
    best = candidates_for("dflash", prof, prof.drafters["d"], calib)[0]
    assert best.tokens_per_s > default.tokens_per_s and best.setting == {"mode": "chain", "depth": 2}
    assert setting_label("dflash", best.setting) == "chain of 2"
    assert setting_label("dflash", {"mode": "tree", "top_k": 3, "depth": 7}) == \
        "tree top-3 per slot, depth 7 (22 tokens)"
    assert same_setting("dflash", {"mode": "chain", "depth": 2, "top_k": 9}, {"mode": "chain", "depth": 2})
    assert not same_setting("dflash", {"mode": "tree", "depth": 2, "top_k": 2},
                            {"mode": "tree", "depth": 2, "top_k": 3})


def test_a_chain_calibration_predicts_chains_only():
    prof = profile(0.005, 0.01)
    chain_only = calibration([row[:1] for row in RATES])
    ranked = candidates_for("dflash", prof, prof.drafters["d"], chain_only)
    assert {as_key(c.setting) for c in ranked} == {(1, d) for d in range(1, 8)}


def test_tree_paths_hang_every_slot_below_the_spine():
    assert setting_paths(3, 2) == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1)]
    assert setting_paths(2, 1) == [(0,), (0, 0)]


def test_incomplete_profile_section_and_unprofiled_width_are_one_error():
    prof = profile(0.3, 0.35)
    with pytest.raises(SpecgraftError, match="lacks block_size/chain_s; re-run `specgraft profile"):
        candidates_for("dflash", prof, {"kind": "dflash", "tree_s": {}}, calibration())
    with pytest.raises(SpecgraftError, match=r"no DFlash tree cost for top-k 4 \(it has \[2, 3\]\)"):
        predict_setting("dflash", {"mode": "tree", "top_k": 4, "depth": 2}, prof, prof.drafters["d"],
                        calibration())


# -- end to end through the CLI ----------------------------------------------------------------------------------
def test_profile_tune_eval_export_end_to_end(tmp_path, capsys):
    tok = tiny_tokenizer()
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    head_dir = tmp_path / "head"
    make_head(Target(model, tok, name_or_path=str(tmp_path / "target")), block_size=4).save_pretrained(head_dir)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "toy", "turns": [t]}) + "\n"
                               for i, t in enumerate(["Once upon a time", "The cat sat"])), encoding="utf-8")

    def cli(*args) -> tuple[int, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert code == 0, err
        return code, out

    profile_file = tmp_path / "profile.json"
    cli("profile", "--target", tmp_path / "target", "--head", head_dir, "--out", profile_file, "--kv-length", "16",
        "--token-counts", "1,2,3,4,8,13", "--repeats", "1")
    section = json.loads(profile_file.read_text(encoding="utf-8"))["drafters"][str(head_dir)]
    assert section["kind"] == "dflash" and section["block_size"] == 4
    assert set(section["chain_s"]) == {"3"} and set(section["tree_s"]) == {"2", "3", "4"}
    assert section["chain_s"]["3"] <= section["tree_s"]["2"] <= section["tree_s"]["3"] <= section["tree_s"]["4"]

    # An untrained head on a tiny target may not beat plain decoding; the bar is set below any measured speedup so
    # that a drafting setting is kept and its path through eval and export is pinned (plain decoding has its own
    # test in tests/tuning/test_tune.py).
    _, out = cli("tune", "--target", tmp_path / "target", "--head", head_dir, "--prompts", prompts,
                 "--cost-profile", profile_file, "--max-new-tokens", "8", "--out", tmp_path / "tune",
                 "--min-speedup", "1e-9")
    tuned = json.loads((head_dir / "tuned.json").read_text(encoding="utf-8"))
    assert tuned["kind"] == "dflash" and tuned["device"]["device"] == "cpu"
    # the calibration (the widest tree at full depth) is a measured setting too, unless a confirming eval already
    # measured that setting
    assert {"best", "tuned", "default"} <= set(tuned["measured"]) <= \
        {"best", "tuned", "default", "calibration", "alternative"}
    assert tuned["default"]["setting"] == {"mode": "chain", "depth": 3}
    widest = {"mode": "tree", "top_k": 4, "depth": 3}
    confirmed = [tuned[key]["setting"] for key in ("default", "alternative") if key in tuned]
    if widest in [tuned["candidates"][0]["setting"], *confirmed]:
        assert "calibration" not in tuned["measured"] and "calibrated" not in tuned
    else:
        assert "calibration" in tuned["measured"] and tuned["calibrated"]["setting"] == widest
    setting = tuned["setting"]
    # the fastest by measurement of the predicted best, the default, the calibration (and a second opinion)
    by = tuned["measured_by"]
    assert tuned["measured"]["tuned"] == tuned["measured"][by]
    speeds = {k: v["speedup_ratio_of_totals"] for k, v in tuned["measured"].items() if k != "tuned"}
    assert speeds[by] == max(speeds.values())
    # ... and the eval folder that measured it drafted exactly that setting
    folder = {"best": "tuned", "alternative": "alternative", "default": "default", "calibration": "calibration"}[by]
    measured_at = json.loads((tmp_path / "tune" / folder / "report.json").read_text(encoding="utf-8"))["drafter"]
    assert {k: measured_at[k] for k in setting} == setting
    assert setting["mode"] in ("chain", "tree")
    assert "predicted" in out and "measured" in out
    calib = json.loads((tmp_path / "tune" / "calibration" / "report.json").read_text(encoding="utf-8"))
    assert calib["drafter"]["mode"] == "tree" and calib["drafter"]["top_k"] == 4  # one run predicts every width
    assert (tmp_path / "tune" / "default" / "report.json").is_file()  # the default chain measured on its own
    for name in ("tuned", "default"):
        report = json.loads((tmp_path / "tune" / name / "report.json").read_text(encoding="utf-8"))
        assert report["overall"]["lossless_passed"] is True

    # simulate predicts the calibration's own tree on the profile's device: its tau exactly (its reach rates)
    _, out = cli("simulate", "--report", tmp_path / "tune" / "calibration", "--cost-profile", profile_file, "--json")
    predicted = json.loads(out)
    assert predicted["setting"] == {"mode": "tree", "depth": 3, "top_k": 4}
    assert predicted["tau"] == pytest.approx(calib["overall"]["tau"])
    assert predicted["draft_s"] == pytest.approx(section["tree_s"]["4"])

    # eval drafts the tuned setting by default; a flag wins
    cli("eval", "--target", tmp_path / "target", "--head", head_dir, "--prompts", prompts, "--out", tmp_path / "e1",
        "--max-new-tokens", "4", "--warmup", "0", "--no-progress")
    drafter = json.loads((tmp_path / "e1" / "report.json").read_text(encoding="utf-8"))["drafter"]
    assert drafter["setting_source"].startswith("tuned (") and drafter["depth"] == setting["depth"]
    assert drafter["mode"] == setting["mode"]
    cli("eval", "--target", tmp_path / "target", "--head", head_dir, "--prompts", prompts, "--out", tmp_path / "e2",
        "--max-new-tokens", "4", "--warmup", "0", "--no-progress", "--k", "2")
    drafter = json.loads((tmp_path / "e2" / "report.json").read_text(encoding="utf-8"))["drafter"]
    assert drafter["setting_source"] == "flags" and drafter["k"] == 2

    # the vLLM export drafts the tuned depth, and the card says so
    from specgraft.export.exporter import export_head

    result = export_head(head_dir, "vllm", tmp_path / "x", report=tmp_path / "e1")
    config = json.loads((result.path / "config.json").read_text(encoding="utf-8"))
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == setting["depth"]
    card = (result.path / "README.md").read_text(encoding="utf-8")
    assert "Chosen by `specgraft tune` on cpu" in card and f'"num_speculative_tokens": {setting["depth"]}' in card
    untuned = tmp_path / "untuned"
    shutil.copytree(head_dir, untuned)
    (untuned / "tuned.json").unlink()
    config = json.loads((export_head(untuned, "vllm", tmp_path / "y").path / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # block_size - 1
