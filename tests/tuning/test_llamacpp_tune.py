"""``specgraft profile/tune --engine llamacpp`` without the engine: the prediction and choice from recorded costs and
acceptance, the engine counters they are computed from, the draft/target identity check, the card lines and the
bad inputs refused before llama.cpp starts. The engine tier (tests/llamacpp/test_tune_in_engine.py) runs it for
real."""

from __future__ import annotations

import json

import pytest
import torch

from specgraft.cli import main
from specgraft.errors import SpecgraftError
from specgraft.export.card import llamacpp_tuned_lines
from specgraft.tuning.llamacpp import (
    EngineTotals,
    LlamacppProfile,
    _draft_timer,
    card_summary,
    check_draft_for_target,
    choose,
    does_not_pay,
    expected_tau,
    predict,
    step_offset_of,
    tuned_record,
)

#: Synthetic costs of a machine where verifying K + 1 rows is cheap (a step costs 1.4-2.6 plain tokens).
CHEAP_VERIFY = dict(target_gguf="target.gguf", draft_gguf="draft.gguf", spec_type="draft-eagle3", threads=2,
                    cpu="test-cpu", prompt_tokens=100, new_tokens=64, rounds=3, plain_ms=10.0,
                    step_ms={1: 14.0, 2: 17.0, 3: 20.0, 4: 23.0, 5: 26.0},
                    draft_ms={1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0, 5: 10.0})
#: Costs recorded by `specgraft profile --engine llamacpp` for SmolLM2-135M-Instruct (Q4_1) with an EAGLE-3 draft
#: of the shipped recipe's shape, 1 thread of a shared 2-core CPU, KV ~160: a step of K drafts costs more than
#: K + 1 plain tokens.
SMOLLM2_1_THREAD = dict(CHEAP_VERIFY, target_gguf="SmolLM2-135M-Instruct.Q4_1.gguf", threads=1, plain_ms=17.567,
                        step_ms={1: 47.442, 2: 67.966, 3: 84.797, 4: 112.590, 5: 119.910},
                        draft_ms={1: 3.808, 2: 9.158, 3: 14.358, 4: 18.164, 5: 22.963})
RECORDED = CHEAP_VERIFY


def profile() -> LlamacppProfile:
    return LlamacppProfile(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in RECORDED.items()})


def test_prediction_is_tau_over_step_cost_and_the_fastest_length_is_chosen():
    acceptance = [0.7, 0.5, 0.35, 0.2, 0.1]
    predictions = predict(profile(), acceptance)
    assert [p.draft_tokens for p in predictions] == [1, 2, 3, 4, 5]
    by_k = {p.draft_tokens: p for p in predictions}
    # tau(K) = 1 + the acceptance of positions 1..K; tokens/s = tau / step.
    assert by_k[2].tau == pytest.approx(2.2)
    assert by_k[2].tokens_per_s == pytest.approx(1000 * 2.2 / 17.0, rel=1e-4)
    assert by_k[2].speedup == pytest.approx(2.2 / 1.7, rel=1e-3)
    assert by_k[3].break_even_tau == pytest.approx(2.0)
    rates = {k: 1000 * (1 + sum(acceptance[:k])) / RECORDED["step_ms"][k] for k in range(1, 6)}
    assert choose(predictions).draft_tokens == max(rates, key=rates.get) == 2
    # A bar above every prediction keeps plain decoding.
    assert choose(predictions, min_speedup=1.5) is None


def test_speculation_that_does_not_pay_names_the_break_even_acceptance_length():
    acceptance = [0.2, 0.05, 0.0, 0.0, 0.0]
    predictions = predict(profile(), acceptance)
    assert all(p.speedup < 1 for p in predictions)
    assert choose(predictions) is None
    why = does_not_pay(predictions, acceptance)
    assert "K=1" in why and "1.20" in why and "1.40" in why  # yields tau 1.2, needs 14 / 10 = 1.4


def test_the_calibration_runs_step_cost_shifts_every_length():
    """The calibration run at K=5 measures a step of 2.9 plain tokens where the profile had 2.6: every length's step
    is charged the 0.3 plain tokens more, and speeds are in the calibration run's plain speed."""
    calibration, plain = EngineTotals(), EngineTotals()
    plain.add({"predicted_n": 64, "predicted_ms": 64 * 12.0}, [], 0)
    steps = [(2, 5)] * 21  # 21 steps of 3 tokens, plus the prompt pass's token: 64 tokens, no plain step
    calibration.add({"predicted_n": 64, "predicted_ms": 21 * 2.9 * 12.0}, steps, 5)
    offset, plain_ms = step_offset_of(profile(), calibration, plain)
    assert plain_ms == pytest.approx(12.0) and offset == pytest.approx(0.3)
    acceptance = [0.7, 0.5, 0.35, 0.2, 0.1]
    by_k = {p.draft_tokens: p for p in predict(profile(), acceptance, offset, plain_ms)}
    assert by_k[2].break_even_tau == pytest.approx(1.7 + 0.3)
    assert by_k[2].speedup == pytest.approx(2.2 / 2.0, rel=1e-3)
    assert by_k[2].tokens_per_s == pytest.approx(1000 * 2.2 / (2.0 * 12.0), rel=1e-3)
    # A calibration step cheaper than the profile's is noise: no negative offset.
    cheap = EngineTotals()
    cheap.add({"predicted_n": 64, "predicted_ms": 21 * 2.0 * 12.0}, steps, 5)
    assert step_offset_of(profile(), cheap, plain)[0] == 0.0


def test_where_a_step_costs_more_than_k_plus_1_tokens_even_perfect_acceptance_does_not_pay():
    smollm2 = LlamacppProfile(**SMOLLM2_1_THREAD)
    perfect = [1.0] * 5
    predictions = predict(smollm2, perfect)
    assert choose(predictions) is None
    assert [p.tau for p in predictions] == [2, 3, 4, 5, 6]
    assert predictions[0].break_even_tau == pytest.approx(47.442 / 17.567, rel=1e-3)
    why = does_not_pay(predictions, perfect)
    assert "even a draft accepted every time would not pay" in why
    assert "would not pay" not in does_not_pay(predict(profile(), [0.2, 0.05, 0, 0, 0]), [0.2, 0.05, 0, 0, 0])


def test_lengths_past_the_calibration_are_not_predicted():
    assert [p.draft_tokens for p in predict(profile(), [0.6, 0.4])] == [1, 2]
    with pytest.raises(SpecgraftError, match="calibrated for draft lengths up to 2"):
        expected_tau([0.6, 0.4], 3)


def test_engine_totals_count_acceptance_over_full_length_drafts_only():
    totals = EngineTotals()
    # 1 token from the prompt pass, 4 steps of a 3-token draft (the last one shortened), 1 plain token at the end.
    steps = [(3, 3), (0, 3), (2, 3), (1, 2)]
    totals.add({"predicted_n": 1 + sum(a + 1 for a, _ in steps) + 1, "predicted_ms": 50.0}, steps, 3)
    assert totals.steps == 4 and totals.accepted == 6 and totals.drafted == 11
    assert totals.full_steps == 3
    assert totals.acceptance_per_position() == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert totals.plain_tokens == 1
    assert totals.tokens_per_s == pytest.approx(1000 * 12 / 50.0)


def test_the_engine_draft_timer_is_read_from_its_statistics_line():
    log = ("0.00.127 I slot print_timing: id  0 | task 0 |        eval time =      23.80 ms /    40 tokens\n"
           "0.00.127 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    2     44     44, #gen "
           "drafts =     44, #acc drafts =    20, #gen tokens =    130, #acc tokens =    32, #mean acc len = 1.73, "
           "#acc rate/pos = (0.455, 0.182, 0.091), dur(b,g,a) = 0.002, 10.352, 0.010 ms\n")
    assert _draft_timer(log) == (44, pytest.approx(10.352))
    assert _draft_timer("no statistics here") is None


def test_profile_round_trips_and_a_foreign_json_is_refused(tmp_path):
    p = profile()
    p.save(tmp_path / "p.json")
    loaded = LlamacppProfile.load(tmp_path / "p.json")
    assert loaded.step_ms == p.step_ms and loaded.draft_ms == p.draft_ms and loaded.plain_ms == p.plain_ms
    assert loaded.verify_ms(3) == pytest.approx(14.0)
    (tmp_path / "other.json").write_text(json.dumps({"kind": "cost-profile"}))
    with pytest.raises(SpecgraftError, match="not a llama.cpp cost profile"):
        LlamacppProfile.load(tmp_path / "other.json")


def test_card_lines_carry_the_tuned_length_or_why_speculation_does_not_pay():
    acceptance = [0.7, 0.5, 0.35, 0.2, 0.1]
    predictions = predict(profile(), acceptance)
    measured = {"draft_tokens": 2, "speedup": 1.25, "tokens_per_s": 125.0, "plain_tokens_per_s": 100.0}
    record = tuned_record(profile(), acceptance, predictions, choose(predictions), measured, {}, 1.0)
    assert record["draft_tokens"] == 2 and "--spec-draft-n-max" in record["serve_flags"]
    text = "\n".join(llamacpp_tuned_lines(card_summary(record)))
    assert "Draft length 2 was chosen in llama.cpp" in text and "measured 1.25x" in text
    low = [0.2, 0.05, 0.0, 0.0, 0.0]
    plain = tuned_record(profile(), low, predict(profile(), low), None, {}, {}, 1.0)
    assert plain["draft_tokens"] == 0 and plain["serve_flags"] == []
    text = "\n".join(llamacpp_tuned_lines(card_summary(plain)))
    assert "does not pay" in text and "1.40 tokens per step" in text


def _gguf(path, arch, tokens, **numbers):
    import gguf

    from specgraft.export.llamacpp import write_gguf

    fields = [("tokenizer.ggml.model", "llama", gguf.GGUFValueType.STRING, None),
              ("tokenizer.ggml.tokens", tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)]
    metadata = {f"{arch}.{k}": v for k, v in numbers.items()}
    write_gguf(path, arch, metadata, {"token_embd.weight": torch.zeros(len(tokens), 8)}, fields)
    return path


def test_a_draft_for_another_target_is_refused(tmp_path):
    tokens = [f"t{i}" for i in range(16)]
    target = _gguf(tmp_path / "target.gguf", "llama", tokens, block_count=4, embedding_length=8,
                   **{"attention.head_count": 2})
    good = _gguf(tmp_path / "good.gguf", "eagle3", tokens, target_hidden_size=8, target_layers=[1, 2, 3])
    check_draft_for_target(good, target)
    other_vocab = _gguf(tmp_path / "vocab.gguf", "eagle3", [*tokens[:-1], "x"], target_hidden_size=8)
    with pytest.raises(SpecgraftError, match="not a draft for .*tokenizer differs"):
        check_draft_for_target(other_vocab, target)
    wider = _gguf(tmp_path / "wide.gguf", "eagle3", tokens, target_hidden_size=16)
    with pytest.raises(SpecgraftError, match="16-wide target features"):
        check_draft_for_target(wider, target)


def test_bad_engine_inputs_are_one_error_line(tmp_path, monkeypatch, capsys):
    tokens = [f"t{i}" for i in range(16)]
    target = _gguf(tmp_path / "target.gguf", "llama", tokens, block_count=4, embedding_length=8,
                   **{"attention.head_count": 2})
    draft = _gguf(tmp_path / "draft.gguf", "eagle3", tokens, target_hidden_size=8)
    monkeypatch.setenv("SPECGRAFT_LLAMACPP_HOME", str(tmp_path / "no-build"))
    out = tmp_path / "p.json"
    assert main(["profile", "--engine", "llamacpp", "--target", str(target), "--draft-gguf", str(draft),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "bash scripts/build_llamacpp.sh" in err[0]
    (tmp_path / "no-build").mkdir()
    (tmp_path / "no-build" / "BUILT").write_text("llama-cpp-python 0.3.20\n")
    bin_dir = tmp_path / "no-build" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-server", "llama-speculative-simple", "llama-completion", "llama-quantize"):
        (bin_dir / name).write_text("")
    assert main(["profile", "--engine", "llamacpp", "--target", str(target), "--draft-gguf", str(draft),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0.3.20, not the pinned 0.3.36" in err[0] and "build_llamacpp.sh" in err[0]
    assert main(["tune", "--engine", "llamacpp", "--target", str(tmp_path), "--head", str(tmp_path),
                 "--prompts", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TARGET.gguf" in err[0]
    assert main(["profile", "--target", str(target), "--draft-gguf", str(draft), "--out", str(out)]) == 2
    assert "add --engine llamacpp" in capsys.readouterr().err
    assert main(["tune", "--engine", "llamacpp", "--target", str(target), "--draft-gguf", str(draft), "--prompts",
                 str(target), "--calibration", str(target), "--out", str(tmp_path / "t")]) == 2
    assert "calibrates acceptance in llama.cpp itself" in capsys.readouterr().err
    assert not out.exists()
