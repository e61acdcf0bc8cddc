"""The rounding-aware lossless check: top-logit gaps in ulps, and a report that tells a bf16 tie from a bug."""

from __future__ import annotations

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.evaluation.prompts import Prompt
from specgraft.evaluation.report import TurnRecord, lossless_summary
from specgraft.kernels.rounding import ROUNDING_TIE_ULPS, greedy_gap_ulps, ulps
from specgraft.testing import tiny_model

from ..evaluation.test_report import fake_result


def test_ulps_count_steps_of_the_dtype_at_the_reference_magnitude():
    ref = torch.tensor([26.5, 26.5, 1.0, 0.75])
    gap = torch.tensor([0.125, 0.5, 2.0 ** -7, 2.0 ** -8])
    assert ulps(gap, ref, torch.bfloat16).tolist() == [1.0, 4.0, 1.0, 1.0]  # bf16: 8 bits of mantissa
    assert ulps(torch.tensor([2.0 ** -23]), torch.tensor([1.5]), torch.float32).item() == 1.0


def test_a_greedy_answer_has_gap_zero_and_a_second_best_token_does_not():
    model = tiny_model("llama").eval()
    prompt = [5, 9, 17, 33]
    answer = SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 12).generated_ids
    assert greedy_gap_ulps(model, prompt, answer) == 0.0
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer[:5]])).logits[0, -1]
    wrong = answer[:5] + [int(logits.topk(2).indices[1])]  # the runner-up at position 5
    assert greedy_gap_ulps(model, prompt, wrong) > 1000 * ROUNDING_TIE_ULPS  # fp32: a real gap is huge in ulps
    assert greedy_gap_ulps(model, prompt, []) == 0.0


def _differing(spec_gap: float | None, base_gap: float | None) -> list[TurnRecord]:
    same = TurnRecord(Prompt("a", "d", ["x"], source="f"), 0, "", 1, fake_result(4, 1.0), fake_result(4, 1.0))
    other = TurnRecord(Prompt("b", "d", ["y"], source="f"), 0, "", 1, fake_result(4, 1.0), fake_result(4, 1.0),
                       spec_gap_ulps=spec_gap, base_gap_ulps=base_gap)
    other.base.generated_ids[-1] = 999
    return [same, other]


@pytest.mark.parametrize(("spec_gap", "base_gap", "up_to_rounding"), [
    (1.0, 0.0, True),      # a tie: within ROUNDING_TIE_ULPS
    (5.0, 5.0, True),      # no further from the argmax than plain decoding's own answer
    (40.0, 1.0, False),    # a token far below the top logit: a decoder bug, not rounding
    (None, None, False),   # not measured: the strict check stands
])
def test_the_report_says_rounding_only_for_ties(spec_gap, base_gap, up_to_rounding):
    summary = lossless_summary(_differing(spec_gap, base_gap), greedy=True)
    assert summary["lossless_passed"] is False and summary["lossless_identical"] == 1
    assert summary["lossless_up_to_rounding"] is up_to_rounding
    assert summary["lossless_check"].startswith("passed up to rounding" if up_to_rounding else "FAILED")


def test_identical_answers_pass_strictly():
    records = _differing(None, None)[:1]
    summary = lossless_summary(records, greedy=True)
    assert summary["lossless_passed"] is True and summary["lossless_up_to_rounding"] is True
    assert "max_logit_gap_ulps" not in summary
