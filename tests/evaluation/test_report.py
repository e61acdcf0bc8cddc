"""run_eval and the report: per-domain aggregation against hand computations, lossless check, outputs."""

from __future__ import annotations

import json
import math

import pytest

from specgraft.decoding.decoder import GenerationResult, SpeculativeDecoder
from specgraft.decoding.drafters import RandomDrafter, SelfDrafter
from specgraft.errors import SpecgraftError
from specgraft.evaluation.prompts import Prompt
from specgraft.evaluation.report import (
    METRIC_KEYS,
    PLOTS,
    EvalSettings,
    TurnRecord,
    build_report,
    render_markdown,
    run_eval,
    summarize_records,
)
from specgraft.testing import tiny_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = [
    Prompt("1", "writing", ["Write a poem.", "Now shorter."]),
    Prompt("2", "math", ["What is 2+2?"]),
    Prompt("3", "math", ["What is 3+5?"]),
]


def strict_json(path):
    """json.loads that refuses NaN/Infinity (report.json must be valid JSON for other tools)."""
    def refuse(token):
        raise ValueError(f"non-JSON constant {token}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def read_answers(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_self_drafter_report_end_to_end(tiny_llama, tiny_tok, tmp_path):
    report = run_eval(tiny_llama, SelfDrafter(k=3), PROMPTS, tmp_path, tokenizer=tiny_tok, max_new_tokens=10,
                      progress=False)
    assert strict_json(tmp_path / "report.json") == report
    assert list(report["domains"]) == ["writing", "math"]
    for values in [report["overall"], *report["domains"].values()]:
        assert set(METRIC_KEYS) <= set(values)
        # Greedy self-drafting accepts every draft: acceptance 1 at every depth, alpha_exact 1; 10 tokens take
        # steps of 4, 4 and 2 (the last draft is cut to the 1 node the budget can still use), so tau = 10 / 3.
        assert values["tau"] == pytest.approx(10 / 3)
        assert values["acceptance_by_depth"] == [1.0, 1.0, 1.0]
        assert values["alpha_exact"] == pytest.approx(1.0)
        assert values["lossless_passed"] is True
    assert report["domains"]["writing"]["num_prompts"] == 1 and report["domains"]["writing"]["num_turns"] == 2
    assert report["domains"]["math"]["num_prompts"] == 2
    assert report["overall"]["lossless_check"].startswith("passed (3/3")
    assert report["settings"]["lossy"] is False and report["settings"]["max_new_tokens"] == 10
    assert report["target"]["architecture"] == "LlamaForCausalLM"
    assert report["drafter"]["type"] == "SelfDrafter" and report["drafter"]["mode"] == "chain"

    answers = read_answers(tmp_path / "answers.jsonl")
    assert [(a["prompt_id"], a["domain"], a["turn"]) for a in answers] == [
        ("1", "writing", 0), ("1", "writing", 1), ("2", "math", 0), ("3", "math", 0)]
    for a in answers:
        # Each answer equals plain greedy decoding of its prompt, recomputed here independently.
        ids = tiny_tok(a["prompt"], add_special_tokens=False)["input_ids"]
        assert a["prompt_tokens"] == len(ids)
        assert a["answer_ids"] == SpeculativeDecoder(tiny_llama, tiny_tok).generate(ids, 10).generated_ids
        assert a["baseline_equal"] is True and a["baseline_ids"] == a["answer_ids"]
        assert a["answer"] == tiny_tok.decode(a["answer_ids"], skip_special_tokens=True)
    # Multi-turn: the second turn's prompt holds the first turn's generated answer as the assistant message.
    assert f"<|im_start|>assistant\n{answers[0]['answer']}<|im_end|>" in answers[1]["prompt"]
    assert answers[1]["prompt"].endswith("<|im_start|>user\nNow shorter.<|im_end|>\n<|im_start|>assistant\n")

    # Totals are pooled from the answers.
    assert report["overall"]["new_tokens"] == sum(a["new_tokens"] for a in answers)
    assert report["overall"]["wall_time_s"] == pytest.approx(sum(a["time_s"] for a in answers))
    expected_tps = sum(a["new_tokens"] for a in answers) / sum(a["time_s"] for a in answers)
    assert report["overall"]["tokens_per_s"] == pytest.approx(expected_tps)

    for file in PLOTS.values():
        data = (tmp_path / file).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| writing | 1 | 3.33 |" in md and "| math | 2 | 3.33 |" in md and "| **overall** | 3 | 3.33 |" in md


def test_random_drafter_rejects_and_stays_lossless(tiny_llama, tiny_tok, tmp_path):
    report = run_eval(tiny_llama, RandomDrafter(320, k=3), PROMPTS[1:], tmp_path, tokenizer=tiny_tok,
                      max_new_tokens=12, progress=False, warmup=0)
    overall = report["overall"]
    assert 1.0 <= overall["tau"] < 1.5
    assert overall["lossless_passed"] is True
    assert overall["acceptance_by_depth"][0] < 0.5
    # Greedy: every draft is a point mass, so alpha_exact is the share of verified drafts equal to the argmax.
    assert overall["alpha_exact"] == pytest.approx(sum(overall["depth_accepted"]) / sum(overall["depth_attempted"]))


def test_sampling_is_not_checkable_per_prompt_and_repeats_redo_the_same_work(tiny_llama, tiny_tok, tmp_path):
    report = run_eval(tiny_llama, SelfDrafter(k=2), PROMPTS[1:], tmp_path, tokenizer=tiny_tok, max_new_tokens=8,
                      temperature=0.9, top_p=0.95, seed=3, repeats=2, progress=False)
    overall = report["overall"]
    assert overall["lossless_passed"] is None and overall["lossless_check"].startswith("not checkable")
    assert report["settings"]["temperature"] == 0.9 and report["settings"]["repeats"] == 2
    answers = read_answers(tmp_path / "answers.jsonl")
    assert all(len(a["times_s"]) == 2 and len(a["baseline_times_s"]) == 2 for a in answers)
    # A seeded turn is reproducible: decoding it again with the recorded seed gives the recorded answer.
    ids = tiny_tok(answers[0]["prompt"], add_special_tokens=False)["input_ids"]
    again = SpeculativeDecoder(tiny_llama, tiny_tok, SelfDrafter(k=2), temperature=0.9, top_p=0.95).generate(
        ids, 8, seed=3)
    assert again.generated_ids == answers[0]["answer_ids"]
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "n/a (sampling)" in md


def fake_result(tokens: int, seconds: float, accepted: list[int] | None = None, draft_time: float = 0.0,
                depth: int = 3):
    """A GenerationResult of a chain of ``depth`` drafts with the given accepted counts per step."""
    r = GenerationResult(prompt_ids=[1], generated_ids=list(range(tokens)), wall_time_s=seconds,
                         draft_time_s=draft_time)
    if accepted:
        r.accepted_lengths = list(accepted)
        r.depth_attempted = [sum(1 for a in accepted if a >= d) for d in range(depth)]
        r.depth_accepted = [sum(1 for a in accepted if a > d) for d in range(depth)]
    return r


def test_aggregation_against_hand_computation():
    p1, p2 = Prompt("a", "d", ["x", "y"], source="f"), Prompt("b", "d", ["z"], source="f")
    records = [
        # prompt a, two turns: spec 10+6 tokens in 1+1 s, baseline 10+6 tokens in 2+2 s
        TurnRecord(p1, 0, "", 1, fake_result(10, 1.0, [2, 1, 3], draft_time=0.2), fake_result(10, 2.0)),
        TurnRecord(p1, 1, "", 1, fake_result(6, 1.0, [1, 3], draft_time=0.2), fake_result(6, 2.0)),
        # prompt b: spec 8 tokens in 4 s, baseline 8 tokens in 2 s; its answer differs from the baseline
        TurnRecord(p2, 0, "", 1, fake_result(8, 4.0, [0, 0, 2]), fake_result(8, 2.0)),
    ]
    records[2].base.generated_ids[-1] = 999
    s = summarize_records(records, greedy=True)
    assert s["num_prompts"] == 2 and s["num_turns"] == 3
    assert s["tau"] == pytest.approx((3 + 2 + 4 + 2 + 4 + 1 + 1 + 3) / 8)
    # Mean of per-prompt ratios: a: (16/2) / (16/4) = 2; b: (8/4) / (8/2) = 0.5 -> 1.25.
    assert s["speedup_mean_of_ratios"] == pytest.approx(1.25)
    # Ratio of totals: (24/6) / (24/6) = 1.
    assert s["speedup_ratio_of_totals"] == pytest.approx(1.0)
    assert s["tokens_per_s"] == pytest.approx(24 / 6) and s["baseline_tokens_per_s"] == pytest.approx(24 / 6)
    # Depth 1 attempted in all 8 steps, accepted in 6; depth 2 attempted 6, accepted 4; depth 3: 4 -> 2.
    assert s["acceptance_by_depth"] == pytest.approx([6 / 8, 4 / 6, 2 / 4])
    assert s["lossless_passed"] is False and s["lossless_identical"] == 1 and s["lossless_checked"] == 2
    assert s["lossless_check"].startswith("FAILED (1/2") and "b" in s["lossless_check"]
    # Measured costs in baseline decoding steps (baseline: 6 s / 24 tokens = 0.25 s per token).
    assert s["draft_cost_per_step"] == pytest.approx(0.4 / 8 / 0.25)
    assert s["verify_cost_per_step"] == pytest.approx((6.0 - 0.4) / 8 / 0.25)
    assert math.isnan(s["alpha_exact"])  # no q reported

    report = build_report(records, EvalSettings(), {"name_or_path": "t"}, {"type": "x", "mode": "chain"})
    assert report["overall"]["alpha_exact"] is None  # NaN is written as null
    md = render_markdown(report)
    assert "FAILED 1/2" in md and "Lossless check: FAILED" in md


def test_bad_settings_and_prompts(tiny_llama, tiny_tok, tmp_path):
    small = tiny_model("llama", max_position_embeddings=32)
    with pytest.raises(SpecgraftError, match="temperature must be >= 0"):
        run_eval(tiny_llama, None, PROMPTS, tmp_path, tokenizer=tiny_tok, temperature=-0.1)
    with pytest.raises(SpecgraftError, match=r"top_p must be in \(0, 1\]"):
        run_eval(tiny_llama, None, PROMPTS, tmp_path, tokenizer=tiny_tok, top_p=1.5)
    with pytest.raises(SpecgraftError, match="no prompts"):
        run_eval(tiny_llama, None, [], tmp_path, tokenizer=tiny_tok)
    with pytest.raises(SpecgraftError, match=r"prompt long \(domain d\) has \d+ tokens, at or over the target's "
                                             r"context of 32"):
        run_eval(small, SelfDrafter(k=2), [Prompt("long", "d", ["x" * 40])], tmp_path, tokenizer=tiny_tok)
    assert not (tmp_path / "report.json").exists()


def test_a_turn_that_overflows_the_context_ends_its_conversation(tiny_tok, tmp_path):
    model = tiny_model("llama", max_position_embeddings=48)
    prompts = [Prompt("c", "d", ["hi", "more", "again"])]  # turn 1 with the 20-token answer is > 48 tokens
    report = run_eval(model, SelfDrafter(k=2), prompts, tmp_path, tokenizer=tiny_tok, max_new_tokens=20,
                      ignore_eos=True, progress=False)
    answers = read_answers(tmp_path / "answers.jsonl")
    assert [a["turn"] for a in answers] == [0]
    assert report["skipped_turns"] == [{"prompt_id": "c", "domain": "d", "from_turn": 1,
                                        "tokens": report["skipped_turns"][0]["tokens"]}]
    assert report["skipped_turns"][0]["tokens"] >= 48


@pytest.mark.parametrize("kernel", ["stock", "gqa", "exact"])
def test_speedups_are_against_plain_decoding_with_the_stock_kernels(tiny_tok, tmp_path, monkeypatch, kernel):
    """The baseline is the user's own plain decoding: the stock kernels in the same dtype. Under another kernel the
    report names the stock baseline and its time, times plain decoding under the kernel beside it, and takes the
    speedup against the faster of the two (named)."""
    import torch

    from specgraft.kernels.exact_attention import apply_attention_kernel, attention_kernel_of

    model = tiny_model("llama", max_position_embeddings=512).to(torch.bfloat16)
    assert apply_attention_kernel(kernel, model) == kernel
    seen: list[tuple[bool, str, str]] = []  # (drafting?, attention, first linear's class) per generate call
    real = SpeculativeDecoder.generate

    def spy(self, *args, **kwargs):
        seen.append((self.drafter is not None, attention_kernel_of(self.model),
                     type(self.model.model.layers[0].self_attn.q_proj).__name__))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    report = run_eval(model, SelfDrafter(k=3), PROMPTS[1:], tmp_path, tokenizer=tiny_tok, max_new_tokens=8,
                      progress=False, warmup=0, repeats=1)
    overall = report["overall"]
    assert report["measurement"]["baseline_stock_kernels"] is True
    assert report["measurement"]["kernels"] == {"stock": "stock", "gqa": "attention gqa, linear stock",
                                                "exact": "attention exact, linear row-exact"}[kernel]
    assert overall["plain_stock_s"] > 0 and overall["plain_stock_tokens_per_s"] > 0
    plain_calls = [call for call in seen if not call[0]]
    assert ("stock", "Linear") in {call[1:] for call in plain_calls}  # the baseline really ran the stock kernels
    assert attention_kernel_of(model) == kernel  # and the kernels came back
    if kernel != "exact":  # gqa's one-token steps are sdpa's own: nothing of plain decoding to time again
        assert overall["plain_kernel_s"] is None and overall["baseline_kernels"] == "stock"
        assert len(plain_calls) == 2
        assert overall["speedup_ratio_of_totals"] == overall["speedup_vs_stock_ratio_of_totals"]
    else:
        assert len(plain_calls) == 4 and ("exact", "RowExactLinear") in {call[1:] for call in plain_calls}
        assert overall["plain_kernel_s"] > 0
        assert overall["plain_kernel_over_stock"] == pytest.approx(overall["plain_kernel_s"] / overall["plain_stock_s"])
        faster = "stock" if overall["plain_stock_s"] <= overall["plain_kernel_s"] else report["measurement"]["kernels"]
        assert overall["baseline_kernels"] == faster
        assert overall["baseline_wall_time_s"] == min(overall["plain_stock_s"], overall["plain_kernel_s"])
        # against the faster plain setting: never more than against stock plain decoding
        assert overall["speedup_ratio_of_totals"] <= overall["speedup_vs_stock_ratio_of_totals"] * (1 + 1e-12)
    assert overall["lossless_passed"] is True  # token-identical to stock plain decoding
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "baseline kernels: " in markdown and "plain decoding with the stock kernels took" in markdown
    for line in read_answers(tmp_path / "answers.jsonl"):
        assert line["baseline_time_s"] > 0 and (line["plain_kernel_time_s"] is None) == (kernel != "exact")
