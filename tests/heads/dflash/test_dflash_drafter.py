"""DFlashDrafter in the speculative decoder: greedy output equals plain decoding on every tiny architecture and
stories260K, the cached context equals a fresh computation, sampling reports q over the target vocabulary."""

from __future__ import annotations

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.verify import SamplingParams
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.heads.dflash.drafter import DFlashDrafter
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

from .helpers import context_for, make_head, self_generated, train_head


@pytest.fixture(scope="module")
def llama_trained():
    target = Target(tiny_model("llama"), tiny_tokenizer())
    data = self_generated(target, rows=6, new_tokens=40)
    return target, data, train_head(target, data, steps=80, block_size=4, max_anchors=64)


@pytest.mark.parametrize(("mode", "draft_layers"), [("chain", "target"), ("tree", "target"), ("chain", "qwen3")])
def test_random_heads_decode_exactly_like_plain_greedy(tiny_arch, mode, draft_layers):
    target = Target(tiny_model(tiny_arch), tiny_tokenizer())
    head = make_head(target, block_size=4, num_layers=2, draft_layers=draft_layers)
    prompt = torch.randint(6, 300, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = SpeculativeDecoder(target, ignore_eos=True).generate(prompt, 16)
    spec = SpeculativeDecoder(target, drafter=DFlashDrafter(head, mode=mode, top_k=3), ignore_eos=True)
    result = spec.generate(prompt, 16)
    assert result.generated_ids == plain.generated_ids
    assert result.num_steps <= plain.num_steps


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_trained_head_is_lossless_and_accepts_drafts(llama_trained, mode):
    target, data, head = llama_trained
    drafter = DFlashDrafter(head, mode=mode)
    decoder = SpeculativeDecoder(target, drafter=drafter, ignore_eos=True)
    plain = SpeculativeDecoder(target, ignore_eos=True)
    taus = []
    for row in data[:3]:
        prompt = row[:4].tolist()
        result = decoder.generate(prompt, 30)
        assert result.generated_ids == plain.generate(prompt, 30).generated_ids
        taus.append(result.tau)
    assert sum(taus) / len(taus) > 1.5  # more than one draft accepted per two steps on the training sequences
    assert drafter.acceptance.verdicts > 0


def test_cached_context_equals_a_fresh_computation(llama_trained):
    """Feeding the context over several steps (with a rewind) gives the logits of one fresh call."""
    target, data, head = llama_trained
    tokens = data[0, :20]
    layers = head.required_layers()
    fresh = DFlashDrafter(head)
    expected = fresh.block_logits(context_for(target, tokens, layers))
    stepwise = DFlashDrafter(head)
    for cut in (5, 9, 9, 14):  # 9 twice: a proposal without accept, then the same history again
        stepwise.block_logits(context_for(target, tokens[:cut], layers, start=stepwise._seen))
    # A rewind to position 12 (the decoder never does this, but the drafter must not keep stale keys).
    stepwise.block_logits(context_for(target, tokens[:13], layers, start=12))
    got = stepwise.block_logits(context_for(target, tokens, layers, start=stepwise._seen))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # And the block sees exactly the training mask: the training forward at anchor 19 gives the same logits.
    with torch.no_grad():
        out = target(tokens[None, :-1], layers=layers)
        context = head.context_features(out.hidden_states)
        slots = torch.full((1, 4), head.config.mask_token_id)
        slots[0, 0] = tokens[-1]
        alone = head.block_logits(head.block_forward(head.embed(slots), context, torch.arange(23)[None], None))
    torch.testing.assert_close(expected, alone[0, 1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("draft_vocab_size", [0, 120])
def test_sampling_draws_from_the_reported_q(draft_vocab_size):
    target = Target(tiny_model("llama"), tiny_tokenizer())
    head = make_head(target, block_size=5, draft_vocab_size=draft_vocab_size)
    drafter = DFlashDrafter(head)
    tokens = torch.randint(6, 300, (9,), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.9, top_k=40)

    def draw(seed: int, max_depth: int = 16):
        drafter.reset()
        return drafter.propose(context_for(target, tokens, drafter.needs_hidden_states, sampling=sampling,
                                           generator=torch.Generator().manual_seed(seed), max_depth=max_depth))

    tree = draw(0)
    assert tree.sampled and tree.q is not None and tree.q.shape == (4, target.vocab_size)
    tree.validate(target.vocab_size, need_q=True)
    torch.testing.assert_close(tree.q.sum(-1), torch.ones(4))
    assert (tree.q >= 0).all() and (tree.q > 0).sum(-1).le(40).all()  # top_k = 40 applied
    assert (tree.q[torch.arange(4), tree.tokens] > 0).all()
    if draft_vocab_size:  # zero outside the draft vocabulary
        outside = torch.ones(target.vocab_size, dtype=torch.bool)
        outside[head.draft_token_ids()] = False
        assert tree.q[:, outside].sum() == 0
    assert torch.equal(draw(0).tokens, tree.tokens)  # seeded
    assert draw(0, max_depth=2).size == 2  # the decoder's depth limit is honoured


def test_sampled_tokens_follow_q_with_a_negative_control():
    """Over seeds, each slot's empirical token frequencies match its own q, and not the next slot's (a peaked
    temperature, so the distributions differ clearly)."""
    target = Target(tiny_model("llama"), tiny_tokenizer())
    drafter = DFlashDrafter(make_head(target, block_size=5))
    tokens = torch.randint(6, 300, (9,), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.02)
    draws = 300
    counts = torch.zeros(2, target.vocab_size)
    q = None
    for seed in range(draws):
        drafter.reset()
        tree = drafter.propose(context_for(target, tokens, drafter.needs_hidden_states, sampling=sampling,
                                           generator=torch.Generator().manual_seed(seed)))
        q = tree.q[:2] if q is None else q
        torch.testing.assert_close(tree.q[:2], q)  # q does not depend on the seed
        counts[torch.arange(2), tree.tokens[:2]] += 1  # slots 1 and 2
    empirical = counts / draws
    tv_own = 0.5 * (empirical - q).abs().sum(-1)  # [2]
    tv_swapped = 0.5 * (empirical - q.flip(0)).abs().sum(-1)
    assert 0.5 * (q[0] - q[1]).abs().sum() > 0.25  # the control distributions really differ
    assert (tv_own < 0.12).all(), tv_own
    assert (tv_swapped > 0.2).all(), tv_swapped


def test_sampled_decoding_runs_and_verifies(llama_trained):
    target, data, head = llama_trained
    decoder = SpeculativeDecoder(target, drafter=DFlashDrafter(head), temperature=0.8, ignore_eos=True, seed=1)
    result = decoder.generate(data[0, :4].tolist(), 20)
    assert len(result.generated_ids) == 20 and result.alpha_count > 0


def test_bind_refuses_another_target_and_bad_arguments():
    target = Target(tiny_model("llama"), tiny_tokenizer())
    head = make_head(target)
    other = Target(tiny_model("llama", hidden_size=32, num_attention_heads=2), tiny_tokenizer())
    with pytest.raises(TargetMismatchError, match="hidden_size 64 vs 32"):
        SpeculativeDecoder(other, drafter=DFlashDrafter(head))
    with pytest.raises(SpecgraftError, match="mode must be one of"):
        DFlashDrafter(head, mode="beam")
    with pytest.raises(SpecgraftError, match="needs a dflash head"):
        DFlashDrafter(torch.nn.Linear(2, 2))


def test_a_shorter_block_is_the_block_a_shorter_trained_head_runs():
    """``block_size=k + 1`` (llama.cpp's block for --spec-draft-n-max k) runs the same weights on k + 1 slots: the
    drafts of a head whose config says block k + 1; not the first k slots of the full block."""
    import copy

    target = Target(tiny_model("llama"), tiny_tokenizer())
    head = make_head(target, block_size=6).eval()
    short = copy.deepcopy(head)
    short.config.block_size = 3
    tokens = torch.randint(6, 300, (12,), generator=torch.Generator().manual_seed(0))
    ctx = context_for(target, tokens, head.required_layers())
    got = DFlashDrafter(head, depth=2, block_size=3).block_logits(ctx)
    torch.testing.assert_close(got, DFlashDrafter(short).block_logits(ctx), rtol=0, atol=0)
    assert not torch.allclose(got, DFlashDrafter(head).block_logits(ctx)[:2])
    for bad in (2, 7, True):
        with pytest.raises(SpecgraftError, match="block_size must be an integer in 3..6"):
            DFlashDrafter(head, depth=2, block_size=bad)


@pytest.mark.shared
@pytest.mark.slow
def test_stories260k_greedy_is_lossless_with_a_briefly_trained_head(stories260k_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories260k_dir)
    target = Target(model, tokenizer)
    prompts = ["Once upon a time", "Tom and his dog went to the park. They", "The sun was hot and"]
    plain = SpeculativeDecoder(target, tokenizer, ignore_eos=True)
    rows = [tokenizer(p)["input_ids"] + plain.generate(p, 48).generated_ids for p in prompts]
    width = min(len(r) for r in rows)
    data = torch.tensor([r[:width] for r in rows])
    head = train_head(target, data, steps=60, block_size=6, max_anchors=64)
    decoder = SpeculativeDecoder(target, tokenizer, drafter=DFlashDrafter(head), ignore_eos=True)
    for prompt in prompts:
        result = decoder.generate(prompt, 40)
        assert result.generated_ids == plain.generate(prompt, 40).generated_ids
        assert result.tau > 1.0


@pytest.mark.parametrize("draft_vocab_size", [0, 120])
def test_acceptance_ranks_are_the_drafters_ranks_at_every_root(draft_vocab_size, monkeypatch):
    """The trainer's teacher-forced ranks (DFlashHead.acceptance_ranks, every anchor in a few chunked forwards)
    equal, at every anchor i and depth d, the rank of the target's greedy token i + d among the decoder's own
    slot-d logits when its root is token i + 1; depths past the block and tokens outside a reduced draft vocabulary
    are unranked."""
    from specgraft.heads import dflash
    from specgraft.heads.base import UNRANKED, draft_columns, token_ranks

    target = Target(tiny_model("llama"), tiny_tokenizer())
    head = make_head(target, block_size=4, draft_vocab_size=draft_vocab_size).eval()
    tokens = torch.randint(6, 300, (1, 14), generator=torch.Generator().manual_seed(5))
    layers = head.required_layers()
    with torch.no_grad():
        out = target(tokens, layers=layers, logits=True)
    greedy = out.logits.argmax(-1)
    depth = 4  # one past the block's 3 drafted slots
    monkeypatch.setattr(dflash.model, "EVAL_BLOCK_SLOTS", 4 * 5)  # 5 anchors per forward: several chunks
    ranks = head.acceptance_ranks({"input_ids": tokens}, out, greedy, depth)
    columns = draft_columns(head.draft_token_ids(), target.vocab_size)
    length = tokens.shape[1]
    for i in range(length - 1):
        with torch.no_grad():
            logits = DFlashDrafter(head).block_logits(context_for(target, tokens[0, : i + 2], layers))
        for d in range(1, depth + 1):
            if d > 3 or i + d >= length:
                assert ranks[0, i, d - 1] == UNRANKED
                continue
            expected = token_ranks(logits[d - 1].float(), greedy[0, i + d], columns)
            assert ranks[0, i, d - 1] == expected, (i, d)
    if draft_vocab_size:
        assert (ranks == UNRANKED).sum() > (depth * length - 3 * (length - 2)), "no token outside the draft vocab"
