"""`specgraft simulate`: closed forms against hand computations, and a prediction of a measured CPU run.

The measured run: stories260K (the real llama2.c model) drafted by a copy of itself without its third layer (4 of
5 layers: a real, cheaper draft that agrees about 65% of the time), greedy, a chain of 4. Stated tolerances:

* tau predicted from the run's measured alpha_exact with the chain closed form: within 10% of the measured tau;
* tau of a chain of 2, predicted from the chain-of-4 run's alpha and profile, within 10% of a measured chain of 2
  (tau is deterministic under greedy decoding, so this is an out-of-sample check without timing noise);
* speedup predicted from the measured alpha and the run's measured costs (draft forward / decoding step, and
  verification / decoding step): within 20% of the measured wall-clock speedup (ratio of totals).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specgraft.cli import main
from specgraft.errors import SpecgraftError
from specgraft.tuning.simulate import predict, read_report_profile

TAU_TOLERANCE = 0.10
SPEEDUP_TOLERANCE = 0.20


def test_chain_closed_form():
    p = predict(alpha=0.8, draft_length=4, cost_ratio=0.05)
    assert p.tau == pytest.approx((1 - 0.8**5) / (1 - 0.8))
    assert p.speedup == pytest.approx(p.tau / (4 * 0.05 + 1))
    assert p.mode == "chain" and p.depth == 4 and p.acceptance_by_depth == [0.8] * 4
    assert predict(alpha=1.0, draft_length=3, cost_ratio=0.0).tau == 4.0
    assert predict(alpha=0.0, draft_length=3, cost_ratio=0.1).speedup == pytest.approx(1 / 1.3)
    # Medusa-style: all heads in one draft forward.
    assert predict(alpha=0.6, draft_length=4, cost_ratio=0.1, draft_forwards=1).draft_cost == pytest.approx(0.1)


def test_profile_tree_and_verify_cost():
    profile = [0.9, 0.8, 0.5, 0.4]
    tau = 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.5 + 0.9 * 0.8 * 0.5 * 0.4
    assert predict(profile=profile, cost_ratio=0.02).tau == pytest.approx(tau)
    assert predict(profile=profile, draft_length=2, cost_ratio=0.02).tau == pytest.approx(1 + 0.9 + 0.72)
    tree = predict(profile=profile, tree_size=60, cost_ratio=0.02, verify_cost_per_token=0.01)
    assert tree.mode == "tree" and tree.verify_cost == pytest.approx(1 + 0.01 * 59)
    assert tree.speedup == pytest.approx(tau / (4 * 0.02 + 1.59))
    # A tree from one alpha: depth d accepted if any of its b_d siblings is (independence).
    t = predict(alpha=0.5, branching=[4, 2, 1], cost_ratio=0.0)
    assert t.acceptance_by_depth == pytest.approx([1 - 0.5**4, 1 - 0.5**2, 0.5])
    assert t.tau == pytest.approx(1 + 0.9375 + 0.9375 * 0.75 + 0.9375 * 0.75 * 0.5)
    assert predict(alpha=0.7, draft_length=3, draft_cost=0.4, verify_cost=1.2).speedup == pytest.approx(
        (1 - 0.7**4) / 0.3 / 1.6)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(alpha=1.5, draft_length=2, cost_ratio=0.1), "alpha must be in [0, 1]"),
    (dict(alpha=0.5, cost_ratio=0.1), "needs --draft-length"),
    (dict(alpha=0.5, tree_size=10, cost_ratio=0.1), "needs --branching"),
    (dict(profile=[0.5, 0.4], draft_length=3, cost_ratio=0.1), "profile has 2"),
    (dict(profile=[0.5, 1.2], cost_ratio=0.1), "acceptance rates must be in [0, 1]"),
    (dict(alpha=0.5, draft_length=2), "give --cost-ratio"),
    (dict(alpha=0.5, profile=[0.5], draft_length=1, cost_ratio=0.1), "exactly one"),
    (dict(alpha=0.5, draft_length=2, cost_ratio=-1.0), "--cost-ratio must be >= 0"),
    (dict(alpha=0.5, draft_length=2, cost_ratio=0.1, verify_cost=0.0), "must be > 0"),
])
def test_predict_refuses_bad_settings(kwargs, fragment):
    with pytest.raises(SpecgraftError) as err:
        predict(**kwargs)
    assert fragment in str(err.value)


def simulate(args, capsys):
    code = main(["simulate", *[str(a) for a in args]])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_prediction_and_json(capsys):
    code, out, _ = simulate(["--alpha", "0.8", "--draft-length", "4", "--cost-ratio", "0.05"], capsys)
    assert code == 0
    tau = (1 - 0.8**5) / 0.2
    assert f"predicted tau: {tau:.3f}" in out and f"predicted speedup: {tau / 1.2:.3f}x" in out
    assert "assumes: verification costs one target forward (memory-bound target)" in out
    code, out, _ = simulate(["--acceptance-profile", "0.9,0.8", "--cost-ratio", "0.1", "--draft-forwards", "1",
                             "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["tau"] == pytest.approx(1 + 0.9 + 0.72) and data["speedup"] == pytest.approx(2.62 / 1.1)
    code, _, err = simulate(["--alpha", "2", "--draft-length", "4", "--cost-ratio", "0.05"], capsys)
    assert code == 2 and err.strip().startswith("error: alpha must be in [0, 1]")
    code, _, err = simulate(["--alpha", "0.5", "--draft-length", "4"], capsys)
    assert code == 2 and "error: give --cost-ratio" in err


def test_cli_reads_a_report(tmp_path, capsys):
    overall = {"acceptance_by_depth": [0.8, 0.5, None], "alpha_exact": 0.7, "tau": 2.2,
               "speedup_ratio_of_totals": 1.5, "draft_cost_per_step": 0.2, "verify_cost_per_step": 1.1}
    report = {"drafter": {"type": "self", "mode": "chain", "k": 3}, "overall": overall,
              "domains": {"code": {**overall, "acceptance_by_depth": [0.9, 0.9, 0.9]}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report), encoding="utf-8")
    measured = read_report_profile(tmp_path)
    assert measured["profile"] == [0.8, 0.5]  # a null rate (never reached) ends the profile
    code, out, _ = simulate(["--report", path, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["tau"] == pytest.approx(2.2)
    assert data["speedup"] == pytest.approx(2.2 / 1.3) and data["measured"] == {"tau": 2.2, "speedup": 1.5}
    code, out, _ = simulate(["--report", path, "--domain", "code", "--cost-ratio", "0.01", "--json"], capsys)
    data = json.loads(out)
    assert data["tau"] == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    assert data["speedup"] == pytest.approx(data["tau"] / (3 * 0.01 + 1))
    code, _, err = simulate(["--report", path, "--domain", "chat"], capsys)
    assert code == 2 and "domain 'chat' is not in" in err


# -- prediction of a measured CPU run ---------------------------------------------------------------------------------
def layer_skipping_draft(model, keep):
    """A copy of ``model`` with only the decoder layers ``keep``: a real, cheaper draft of the same vocabulary."""
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList([draft.model.layers[i] for i in keep])
    for i, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = i  # cache slots follow the new layer order
    draft.config.num_hidden_layers = len(keep)
    return draft


@pytest.mark.shared
def test_prediction_matches_a_measured_cpu_run(stories260k_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgraft.decoding.drafters import DraftModelDrafter
    from specgraft.evaluation.prompts import Prompt
    from specgraft.evaluation.report import run_eval

    model = AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(stories260k_dir)
    draft = layer_skipping_draft(model, [0, 1, 3, 4])
    prompts = [Prompt(str(i), "stories", [t]) for i, t in enumerate(
        ["Once upon a time", "Tom and his dog went to the park. They", "The sun was hot and", "Lily had a red ball."])]
    runs = {}
    for k in (4, 2):
        runs[k] = run_eval(model, DraftModelDrafter(draft, k=k), prompts, tmp_path / f"k{k}", tokenizer=tok,
                           max_new_tokens=64, ignore_eos=True, progress=False)["overall"]
    m4, m2 = runs[4], runs[2]
    assert m4["lossless_passed"] and m2["lossless_passed"]
    assert 1.5 < m4["tau"] < 4.0  # a partly-agreeing draft: the test is not trivial

    # Measured cost model of the chain-of-4 run: per draft forward (4 per step) and per verification.
    c = m4["draft_cost_per_step"] / 4
    v = m4["verify_cost_per_step"]
    p4 = predict(alpha=m4["alpha_exact"], draft_length=4, cost_ratio=c, verify_cost=v)
    assert p4.tau == pytest.approx(m4["tau"], rel=TAU_TOLERANCE)
    assert p4.speedup == pytest.approx(m4["speedup_ratio_of_totals"], rel=SPEEDUP_TOLERANCE)

    # Out of sample: a chain of 2, from the chain-of-4 run's alpha and its per-depth profile.
    assert predict(alpha=m4["alpha_exact"], draft_length=2, cost_ratio=c).tau == pytest.approx(
        m2["tau"], rel=TAU_TOLERANCE)
    assert predict(profile=m4["acceptance_by_depth"], draft_length=2, cost_ratio=c).tau == pytest.approx(
        m2["tau"], rel=TAU_TOLERANCE)

    # The CLI reproduces the measured run from its report.json (measured profile and costs).
    code, out, _ = simulate(["--report", tmp_path / "k4" / "report.json", "--json"], capsys)
    data = json.loads(out)
    assert code == 0
    assert data["tau"] == pytest.approx(m4["tau"], rel=TAU_TOLERANCE)
    assert data["speedup"] == pytest.approx(m4["speedup_ratio_of_totals"], rel=SPEEDUP_TOLERANCE)
