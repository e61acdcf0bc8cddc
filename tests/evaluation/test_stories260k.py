"""The speculative decoder on a real pretrained target: llama2.c stories260K (skipped without ../shared/data)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.decoding.drafters import DraftModelDrafter, RandomDrafter, SelfDrafter

pytestmark = pytest.mark.shared
PROMPTS = ["Once upon a time", "Tom and his dog went to the park. They", "The sun was hot and"]


@pytest.fixture(scope="module")
def stories(stories260k_dir):
    model = AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(stories260k_dir)


def noisy_copy(model, scale: float, seed: int = 0):
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return draft


@torch.no_grad()
def test_plain_and_speculative_greedy_reproduce_llama2c(stories, shared_data):
    """From BOS alone (a one-token prompt: no prefill), 200 greedy tokens equal run.c's own output."""
    model, tok = stories
    golden = json.loads((shared_data / "models" / "stories260K" / "golden_reference.json").read_text())
    expected = golden["greedy_from_bos"]["token_ids"][1:]
    for drafter in (None, SelfDrafter(k=4), DraftModelDrafter(noisy_copy(model, 0.2), k=3, tree_topk=(2, 2))):
        result = SpeculativeDecoder(model, tok, drafter=drafter).generate([1], len(expected))
        assert result.generated_ids == expected


@torch.no_grad()
def test_greedy_equals_reference_and_transformers_on_stories_prompts(stories):
    model, tok = stories
    draft = noisy_copy(model, 0.2)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        reference = generate_reference(model, ids, 48)
        hf = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=48)[0, len(ids):].tolist()
        assert hf == reference
        drafters = {"plain": None, "self": SelfDrafter(k=4), "random": RandomDrafter(512, k=3),
                    "draft": DraftModelDrafter(draft, k=4), "draft_tree": DraftModelDrafter(draft, k=3, tree_topk=(3,))}
        taus = {}
        for name, drafter in drafters.items():
            result = SpeculativeDecoder(model, tok, drafter=drafter).generate(prompt, 48)
            assert result.generated_ids == reference, (prompt, name)
            taus[name] = result.tau
        assert 1.0 < taus["draft"] < 5.0  # a partly-agreeing draft: real acceptances and rejections


@torch.no_grad()
def test_self_drafter_tau_on_stories(stories):
    model, tok = stories
    result = SpeculativeDecoder(model, tok, drafter=SelfDrafter(k=4), ignore_eos=True).generate(PROMPTS[0], 50)
    assert result.accepted_lengths == [4] * 10 and result.tau == 5.0
