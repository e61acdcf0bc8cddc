"""EagleDrafter in the speculative decoder: greedy output equals plain decoding; trained heads get tau > 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafter import DraftContext
from specgraft.decoding.tree import depths
from specgraft.decoding.verify import SamplingParams
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.heads import head_class
from specgraft.heads.eagle.drafter import EagleDrafter
from specgraft.target import Target
from specgraft.testing import tiny_model

HEAD_TYPES = ("eagle", "eagle3")


def build_head(target: Target, head_type: str, **overrides):
    """A fresh head; ``overrides`` the family's config does not have are dropped (the tests share one set)."""
    cls = head_class(head_type)
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    torch.manual_seed(0)
    return cls.build(target, cls.Config(**{k: v for k, v in overrides.items() if k in fields}).resolve(target))


def self_generated(target: Target, prompts: int, new_tokens: int, prompt_len: int = 4, seed: int = 0,
                   prompt_ids: list[list[int]] | None = None) -> torch.Tensor:
    """[prompts, prompt_len + new_tokens] sequences: random prompts and the target's own greedy continuations."""
    g = torch.Generator().manual_seed(seed)
    decoder = SpeculativeDecoder(target, ignore_eos=True)
    rows = []
    for i in range(prompts):
        prompt = prompt_ids[i] if prompt_ids else torch.randint(6, 300, (prompt_len,), generator=g).tolist()
        rows.append(prompt + decoder.generate(prompt, new_tokens).generated_ids)
    width = min(len(r) for r in rows)
    return torch.tensor([r[:width] for r in rows])


def train_head(target: Target, head_type: str, data: torch.Tensor, steps: int, lr: float = 3e-3, **overrides):
    """A few dozen full-batch steps (the target is frozen, so its outputs are computed once)."""
    head = build_head(target, head_type, ttt_steps=3, **overrides)
    head.prepare_from_data(torch.bincount(data.flatten(), minlength=target.vocab_size))
    batch = {"input_ids": data, "attention_mask": torch.ones_like(data), "loss_mask": torch.ones_like(data)}
    out = target(data, batch["attention_mask"], layers=head.required_layers(), logits=True)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    for _ in range(steps):
        loss = head.training_loss(batch, out).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def greedy_pair(target: Target, drafter: EagleDrafter | None, prompt: list[int], new_tokens: int):
    plain = SpeculativeDecoder(target, ignore_eos=True).generate(prompt, new_tokens)
    spec = SpeculativeDecoder(target, drafter=drafter, ignore_eos=True).generate(prompt, new_tokens)
    return plain, spec


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_random_heads_decode_exactly_like_plain_greedy(tiny_arch, head_type):
    target = Target(tiny_model(tiny_arch))
    head = build_head(target, head_type, draft_vocab_size=200)
    prompt = torch.randint(6, 300, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, spec = greedy_pair(target, EagleDrafter(head, top_k=4, depth=4, total_tokens=16), prompt, 16)
    assert spec.generated_ids == plain.generated_ids
    assert spec.num_steps <= plain.num_steps


@pytest.fixture(scope="module")
def llama_trained():
    target = Target(tiny_model("llama"))
    data = self_generated(target, prompts=8, new_tokens=48)
    heads = {t: train_head(target, t, data, steps=40) for t in HEAD_TYPES}
    return target, data, heads


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_trained_heads_are_exact_and_accept_more_than_one_token(llama_trained, head_type, mode):
    target, data, heads = llama_trained
    drafter = EagleDrafter(heads[head_type], mode=mode, depth=5 if mode == "chain" else 6)
    taus = []
    for row in (0, 5):
        plain, spec = greedy_pair(target, drafter, data[row, :4].tolist(), 32)
        assert spec.generated_ids == plain.generated_ids
        assert spec.num_steps < plain.num_steps
        taus.append(spec.tau)
    # A tiny random target's distributions are nearly flat, so cumulative draft scores fall fast with depth and
    # the dynamic tree stays shallow; tau is still well above 1 (about 2-3 tree, 1.3-6 chain).
    assert min(taus) > 1.0 and sum(taus) / len(taus) > 1.5, taus


def test_tree_with_one_child_per_node_is_the_greedy_chain(llama_trained):
    target, data, heads = llama_trained
    n = 12
    layers = sorted({i for head in heads.values() for i in head.required_layers()})
    out = target(data[:1, : n - 1], layers=layers)
    ctx = DraftContext(token_ids=data[0, :n], prompt_length=n, hidden_start=0,
                       hidden_states={i: h[0] for i, h in out.hidden_states.items()}, max_depth=100)
    for head in heads.values():
        tree = EagleDrafter(head, top_k=1, depth=5, total_tokens=6).propose(ctx)
        chain = EagleDrafter(head, mode="chain", depth=5).propose(ctx)
        assert tree.parents.tolist() == chain.parents.tolist() == [-1, 0, 1, 2, 3]
        assert tree.tokens.tolist() == chain.tokens.tolist()
        assert tree.q is None and chain.q is None  # deterministic drafts carry no full-vocabulary q rows


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3"])
def test_trained_heads_on_other_architectures(arch):
    target = Target(tiny_model(arch))
    data = self_generated(target, prompts=6, new_tokens=40, seed=1)
    for head_type in HEAD_TYPES:
        head = train_head(target, head_type, data, steps=30, draft_vocab_size=256)
        plain, spec = greedy_pair(target, EagleDrafter(head), data[0, :4].tolist(), 24)
        assert spec.generated_ids == plain.generated_ids
        assert spec.tau > 1.0


def test_tree_shape_limits_and_sibling_order(llama_trained):
    target, data, heads = llama_trained
    drafter = EagleDrafter(heads["eagle3"], top_k=3, depth=4, total_tokens=12)
    n = 10
    out = target(data[:1, : n - 1], layers=drafter.needs_hidden_states)
    ctx = DraftContext(token_ids=data[0, :n], prompt_length=n, hidden_start=0,
                       hidden_states={i: h[0] for i, h in out.hidden_states.items()}, max_depth=100)
    tree = drafter.propose(ctx)
    tree.validate(target.vocab_size)
    assert tree.size == 11 and not tree.sampled
    assert int(depths(tree.parents).max()) <= 4
    assert tree.q is None  # deterministic siblings: point masses, no q rows kept
    # Children of the root are the draft's top-3, best first.
    children = [i for i, p in enumerate(tree.parents.tolist()) if p == -1]
    assert tree.tokens[children].tolist() == drafter_root_topk(drafter, ctx, 3)[: len(children)]
    # The draft cache holds the committed pairs plus the expanded nodes; accept() cuts back to the pairs.
    assert drafter._cache.get_seq_length() > n - 1
    drafter.accept([], 0)
    assert drafter._cache.get_seq_length() == n - 1
    # max_depth from the decoder (context limit) caps the tree.
    drafter.reset()
    ctx.max_depth = 1
    assert int(depths(drafter.propose(ctx).parents).max()) == 1


def drafter_root_topk(drafter: EagleDrafter, ctx: DraftContext, k: int) -> list[int]:
    """The draft's top-k tokens for the root's children, computed independently (one full causal pass)."""
    from specgraft.heads.layers import causal_additive_mask

    head = drafter.head
    n = ctx.length - 1
    with torch.no_grad():
        feats = head.input_features({i: h[None] for i, h in ctx.hidden_states.items()})
        _, logits = head.draft_forward(ctx.token_ids[1:][None], feats, torch.arange(n)[None],
                                       causal_additive_mask(n, None, torch.float32, feats.device))
    top = logits[0, -1].topk(k).indices
    return head.draft_token_ids()[top].tolist()


def test_sampling_runs_with_deterministic_tree_and_sampled_chain(llama_trained):
    target, data, heads = llama_trained
    for mode, sampled in (("tree", False), ("chain", True)):
        drafter = EagleDrafter(heads["eagle"], mode=mode, depth=4)
        decoder = SpeculativeDecoder(target, drafter=drafter, temperature=0.8, ignore_eos=True, seed=1)
        result = decoder.generate(data[0, :4].tolist(), 20)
        assert len(result.generated_ids) == 20
        assert result.alpha_count > 0
        out = target(data[:1, :7], layers=drafter.needs_hidden_states)
        drafter.reset()
        tree = drafter.propose(DraftContext(token_ids=data[0, :8], prompt_length=8, hidden_start=0,
                                            hidden_states={i: h[0] for i, h in out.hidden_states.items()},
                                            sampling=SamplingParams(temperature=0.8), max_depth=10,
                                            generator=torch.Generator().manual_seed(0)))
        assert tree.sampled is sampled
        assert (tree.q is not None) is sampled  # only a sampled draft reports q
        tree.validate(target.vocab_size, need_q=True)


def test_wrong_target_and_bad_settings(llama_trained):
    _, _, heads = llama_trained
    other = tiny_model("qwen2")
    with pytest.raises(TargetMismatchError, match="made for"):
        SpeculativeDecoder(other, drafter=EagleDrafter(heads["eagle"]))
    with pytest.raises(SpecgraftError, match="mode"):
        EagleDrafter(heads["eagle"], mode="beam")
    with pytest.raises(SpecgraftError, match="total_tokens"):
        EagleDrafter(heads["eagle"], total_tokens=1)


@pytest.mark.shared
@pytest.mark.slow
def test_stories260k_trained_heads(stories260k_dir):
    """On the real stories260K model: exact greedy output, and tau > 1 after a little training on its own text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(stories260k_dir)
    target = Target(model, tok)
    prompts = ["Once upon a time", "Tom and his dog went to the park.", "The sun was hot and", "Lily had a red ball.",
               "One day, a little bird", "Sam liked to play", "There was a big tree", "Mom said to Ben"]
    ids = [tok(p)["input_ids"] for p in prompts]
    width = min(len(i) for i in ids)
    data = self_generated(target, len(ids), 64, prompt_ids=[i[:width] for i in ids])
    for head_type in HEAD_TYPES:
        untrained = build_head(target, head_type)
        plain, spec = greedy_pair(target, EagleDrafter(untrained), ids[0], 40)
        assert spec.generated_ids == plain.generated_ids
        head = train_head(target, head_type, data, steps=60)
        for prompt in (ids[0], tok("Anna went to the shop")["input_ids"]):
            plain, spec = greedy_pair(target, EagleDrafter(head), prompt, 40)
            assert spec.generated_ids == plain.generated_ids
            assert spec.tau > 1.5, f"{head_type}: tau {spec.tau}"  # measured about 2 (unseen prompt) to 4.5
