"""Medusa decoding: the greedy sparse tree, accuracy measurement, and MedusaDrafter inside the speculative decoder."""

from __future__ import annotations

import itertools

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.decoding.drafter import DraftContext
from specgraft.decoding.metrics import summarize
from specgraft.decoding.tree import depths
from specgraft.decoding.verify import SamplingParams
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.heads.base import load_head
from specgraft.heads.medusa.drafter import (
    DEFAULT_NUM_NODES,
    MedusaDrafter,
    MedusaTree,
    build_sparse_tree,
    chain_tree,
    default_topk_accuracy,
    head_topk_accuracy,
    measure_topk_accuracy,
)
from specgraft.heads.medusa.model import MedusaHead
from specgraft.target import Target, load_target
from specgraft.testing import tiny_model, tiny_tokenizer

PROMPTS = ([1, 50, 60, 70], [1, 100, 7], [1, 33, 44, 55, 66, 77], [1, 210, 9, 9])


def make_head(target: Target, num_heads: int = 3, **overrides) -> MedusaHead:
    cfg = MedusaHead.Config(num_heads=num_heads, num_layers=1, **overrides)
    return MedusaHead.build(target, cfg.resolve(target))


def train_heads(head: MedusaHead, target: Target, ids: torch.Tensor, steps: int = 40, lr: float = 3e-3) -> None:
    """A small manual loop (the real trainer lives in specgraft.train)."""
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    out = target.forward(ids, layers=head.required_layers(), logits=False)
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = head.training_loss(batch, out).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def self_distilled_ids(target: Target, prompts, length: int) -> torch.Tensor:
    """[len(prompts), length] the target's own greedy text (prompt + continuation), all rows equal length."""
    rows = []
    for prompt in prompts:
        new = generate_reference(target.model, prompt, length - len(prompt), ignore_eos=True)
        rows.append(list(prompt) + new)
    return torch.tensor(rows)


def decode(target: Target, drafter, prompt, max_new_tokens: int):
    return SpeculativeDecoder(target, drafter=drafter, ignore_eos=True).generate(prompt, max_new_tokens)


def brute_force_best(acc: torch.Tensor, num_nodes: int) -> float:
    num_heads, topk = acc.shape
    paths = [p for d in range(1, num_heads + 1) for p in itertools.product(range(topk), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(paths, num_nodes):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in subset):
            best = max(best, MedusaTree.from_paths(subset).expected_accepted(acc))
    return best


# ----------------------------------------------------------------------------------------------------------------
# tree construction


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_nodes", [2, 4, 5])
def test_greedy_tree_maximises_expected_acceptance(seed, num_nodes):
    gen = torch.Generator().manual_seed(seed)
    acc = torch.rand(2, 3, generator=gen) * 0.5
    tree = build_sparse_tree(acc, num_nodes=num_nodes)
    assert tree.size == num_nodes
    assert tree.expected_accepted(acc) == pytest.approx(brute_force_best(acc, num_nodes), abs=1e-12)


def test_default_tree_shape_and_order():
    acc = default_topk_accuracy(4)
    tree = build_sparse_tree(acc)
    assert tree.size == DEFAULT_NUM_NODES and 1 < tree.depth <= 4
    parents, depths = tree.parents(), tree.depths()
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert depths == sorted(depths)  # breadth-first
    for i, path in enumerate(tree.paths):
        assert depths[i] == len(path)
        if len(path) > 1:
            assert tree.paths[parents[i]] == path[:-1]
    # siblings best first, ranks within the head's top-k
    for parent in set(parents):
        ranks = [tree.paths[i][-1] for i, p in enumerate(parents) if p == parent]
        assert ranks == sorted(ranks)
    assert tree.max_rank < acc.shape[1]
    # expected acceptance beats the chain of the same heads and grows with the node budget
    assert tree.expected_accepted(acc) > chain_tree(4).expected_accepted(acc)
    assert build_sparse_tree(acc, num_nodes=20).expected_accepted(acc) < tree.expected_accepted(acc)


def test_tree_options_and_chain():
    acc = default_topk_accuracy(5, topk=4)
    assert build_sparse_tree(acc, num_nodes=10).size == 10
    assert build_sparse_tree(acc, num_nodes=30, max_depth=2).depth == 2
    assert build_sparse_tree(acc[:3, :3], num_nodes=100).size == 3 + 9 + 27  # every path, then nothing left
    assert chain_tree(3).paths == ((0,), (0, 0), (0, 0, 0))
    assert chain_tree(3).parents() == [-1, 0, 1]
    # a head that is never right still gets explored last, never before a useful one
    acc = torch.tensor([[0.9, 0.05], [0.0, 0.0]])
    assert build_sparse_tree(acc, num_nodes=2).paths == ((0,), (1,))


@pytest.mark.parametrize("bad", [torch.zeros(0, 3), torch.full((2, 3), 1.5), torch.zeros(3)])
def test_bad_accuracies_raise(bad):
    with pytest.raises(SpecgraftError, match="accuracies|accuracy"):
        build_sparse_tree(bad)


def test_tree_requires_parents():
    with pytest.raises(SpecgraftError, match="no parent"):
        MedusaTree.from_paths([(0,), (1, 0)])
    with pytest.raises(SpecgraftError, match="num_nodes"):
        build_sparse_tree(default_topk_accuracy(2), num_nodes=0)


def test_default_accuracy_prior():
    acc = default_topk_accuracy(4, topk=6)
    assert acc.shape == (4, 6)
    assert bool((acc > 0).all()) and bool((acc.sum(1) <= 1).all())
    assert bool((acc[:, 1:] < acc[:, :-1]).all()) and bool((acc[1:] < acc[:-1]).all())


# ----------------------------------------------------------------------------------------------------------------
# measuring accuracies


def reference_accuracy(head, target, ids, loss_mask, topk):
    hidden = target.forward(ids, layers=head.required_layers(), logits=False).hidden_states[target.num_layers]
    with torch.no_grad():
        logits = head(hidden)  # [K, B, T, V]
    acc = torch.zeros(head.num_heads, topk)
    for k in range(head.num_heads):
        hits, count = torch.zeros(topk), 0
        for b in range(ids.shape[0]):
            for t in range(ids.shape[1] - k - 2):
                label = int(ids[b, t + k + 2])
                if not loss_mask[b, t + k + 2]:
                    continue
                count += 1
                order = torch.argsort(logits[k, b, t], descending=True).tolist()
                if order.index(label) < topk:
                    hits[order.index(label)] += 1
        acc[k] = hits / max(count, 1)
    return acc


def test_measure_topk_accuracy_matches_reference():
    torch.manual_seed(0)
    target = Target(tiny_model("llama"))
    head = make_head(target)
    ids = self_distilled_ids(target, PROMPTS[:2], 24)
    train_heads(head, target, ids, steps=15)
    loss_mask = (torch.rand(ids.shape) > 0.3).long()
    batches = [{"input_ids": ids[i:i + 1], "loss_mask": loss_mask[i:i + 1]} for i in range(2)]
    acc = measure_topk_accuracy(head, target, batches, topk=5)
    torch.testing.assert_close(acc, reference_accuracy(head, target, ids, loss_mask, 5))
    assert acc.shape == (3, 5) and float(acc[0].sum()) > 0.5
    # rows of a dataset (plain lists) and bare id tensors are accepted; max_batches limits the pass
    rows = [{"input_ids": ids[i].tolist(), "loss_mask": loss_mask[i].tolist()} for i in range(2)]
    torch.testing.assert_close(measure_topk_accuracy(head, None, rows, topk=5), acc)
    first = measure_topk_accuracy(head, target, [ids[:1], ids[1:]], topk=5, max_batches=1)
    torch.testing.assert_close(first, reference_accuracy(head, target, ids[:1], torch.ones_like(ids[:1]), 5))
    assert head.training  # measurement restores the mode
    with pytest.raises(SpecgraftError, match="input_ids"):
        measure_topk_accuracy(head, target, [{"ids": ids}])


def test_measured_accuracy_is_saved_and_builds_the_same_tree(tmp_path):
    target = Target(tiny_model("llama"), tiny_tokenizer())
    head = make_head(target)
    assert torch.equal(head_topk_accuracy(head), default_topk_accuracy(3))  # the prior until measured
    train_heads(head, target, self_distilled_ids(target, PROMPTS[:2], 24), steps=10)
    acc = measure_topk_accuracy(head, target, [self_distilled_ids(target, PROMPTS[2:], 24)])
    head.set_topk_accuracy(acc)
    head.save_pretrained(tmp_path / "head")
    loaded = load_head(target, tmp_path / "head")
    torch.testing.assert_close(head_topk_accuracy(loaded), acc)
    assert MedusaDrafter(loaded, num_nodes=20).tree == build_sparse_tree(acc, num_nodes=20)
    with pytest.raises(SpecgraftError, match="topk_accuracy"):
        head.set_topk_accuracy(torch.zeros(2, 4))  # wrong number of heads
    torch.testing.assert_close(head_topk_accuracy(head), acc)  # unchanged by the failed set


# ----------------------------------------------------------------------------------------------------------------
# the drafter in isolation


def context_for(target: Target, ids: list[int], sampling: SamplingParams | None = None, max_depth: int = 100):
    layer = target.num_layers
    hidden = target.forward(torch.tensor([ids[:-1]]), layers=(layer,), logits=False).hidden_states[layer][0]
    return DraftContext(token_ids=torch.tensor(ids), prompt_length=len(ids), hidden_start=0,
                        hidden_states={layer: hidden}, sampling=sampling or SamplingParams(), max_depth=max_depth)


def test_propose_fills_the_static_tree_with_head_top_choices():
    torch.manual_seed(0)
    target = Target(tiny_model("llama"))
    head = make_head(target)
    with torch.no_grad():
        for p in head.blocks.parameters():
            p.normal_(0, 0.1)
    drafter = MedusaDrafter(head, num_nodes=12)
    ctx = context_for(target, [1, 5, 9, 13, 17])
    tree = drafter.propose(ctx)
    assert tree.size == 12 and not tree.sampled
    assert tree.parents.tolist() == drafter.tree.parents()
    hidden = ctx.hidden_states[target.num_layers][-1]
    with torch.no_grad():
        logits = head(hidden.view(1, 1, -1))[:, 0, 0]  # [K, V]
    order = logits.argsort(-1, descending=True)
    for i, path in enumerate(drafter.tree.paths):
        assert int(tree.tokens[i]) == int(order[len(path) - 1, path[-1]])
    assert tree.q is None  # deterministic siblings: point masses, no [n, V] rows kept
    tree.validate(320, need_q=True)
    # sampling settings do not change a top-k tree (its tokens are the heads' ranking, not draws)
    sampled_ctx = context_for(target, [1, 5, 9, 13, 17], SamplingParams(temperature=0.7, top_k=20))
    assert drafter.propose(sampled_ctx).tokens.tolist() == tree.tokens.tolist()


def test_only_the_heads_the_draft_reaches_are_computed(monkeypatch):
    """A chain of 1 runs head 0 only; a tree cut to depth 2 by the decoder runs heads 0 and 1."""
    target = Target(tiny_model("llama"))
    head = make_head(target)
    calls: list[int] = []
    original = head.head_logits
    monkeypatch.setattr(head, "head_logits", lambda hidden, k: calls.append(k) or original(hidden, k))
    chain = MedusaDrafter(head, mode="chain", max_depth=1).propose(context_for(target, [1, 5, 9]))
    assert chain.size == 1 and calls == [0]
    calls.clear()
    tree = MedusaDrafter(head).propose(context_for(target, [1, 5, 9], max_depth=2))
    assert int(depths(tree.parents).max()) == 2 and calls == [0, 1]
    calls.clear()
    MedusaDrafter(head).propose(context_for(target, [1, 5, 9]))
    assert calls == list(range(head.num_heads))


def test_propose_respects_max_depth_and_needs_a_processed_position():
    target = Target(tiny_model("llama"))
    head = make_head(target)
    drafter = MedusaDrafter(head)
    tree = drafter.propose(context_for(target, [1, 5, 9], max_depth=1))
    assert tree.size > 0 and tree.parents.tolist() == [-1] * tree.size
    assert drafter.propose(context_for(target, [1, 5, 9], max_depth=0)).size == 0
    empty = DraftContext(token_ids=torch.tensor([1]), prompt_length=1, hidden_start=0,
                         hidden_states={target.num_layers: torch.zeros(0, 64)}, max_depth=10)
    assert drafter.propose(empty).size == 0
    chain = MedusaDrafter(head, mode="chain").propose(context_for(target, [1, 5, 9]))
    assert chain.parents.tolist() == [-1, 0, 1]


def test_drafter_rejects_bad_arguments_and_other_targets():
    target = Target(tiny_model("llama"), tiny_tokenizer())
    head = make_head(target)
    with pytest.raises(SpecgraftError, match="mode"):
        MedusaDrafter(head, mode="beam")
    with pytest.raises(SpecgraftError, match="rows"):
        MedusaDrafter(head, accuracy=torch.full((2, 5), 0.1))
    beyond_vocab = torch.zeros(3, 400)
    beyond_vocab[:, 350] = 0.9
    with pytest.raises(SpecgraftError, match="rank 350"):
        MedusaDrafter(head, accuracy=beyond_vocab)
    with pytest.raises(TargetMismatchError, match="hidden_size 64 vs 32"):
        SpeculativeDecoder(tiny_model("llama", hidden_size=32), drafter=MedusaDrafter(head))
    other_tok = tiny_tokenizer()
    other_tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(TargetMismatchError, match="tokenizer"):
        SpeculativeDecoder(target.model, other_tok, drafter=MedusaDrafter(head))


# ----------------------------------------------------------------------------------------------------------------
# lossless greedy decoding


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_greedy_decoding_equals_plain_decoding(tiny_arch, mode):
    torch.manual_seed(0)
    target = Target(tiny_model(tiny_arch), tiny_tokenizer())
    fresh = make_head(target)
    trained = make_head(target)
    repeated = torch.tensor([[1] + [40, 41, 42, 43, 44] * 8])
    train_heads(trained, target, repeated, steps=30)
    for head in (fresh, trained):
        drafter = MedusaDrafter(head, mode=mode, num_nodes=24)
        for prompt in (PROMPTS[0], [1], [40, 41, 42, 43]):
            reference = generate_reference(target.model, prompt, 24, ignore_eos=True)
            result = decode(target, drafter, prompt, 24)
            assert result.generated_ids == reference
            assert result.num_steps <= 24


def test_heads_trained_on_the_targets_own_text_raise_tau():
    """Meaningful behaviour: a few dozen steps on (repetitive) self-generated text make most drafts accepted."""
    torch.manual_seed(0)
    target = Target(tiny_model("llama"))
    ids = self_distilled_ids(target, PROMPTS, 48)
    untrained, trained = make_head(target), make_head(target)
    train_heads(trained, target, ids, steps=60)
    trained.set_topk_accuracy(measure_topk_accuracy(trained, target, [ids]))
    taus = {}
    for name, head in (("untrained", untrained), ("trained", trained)):
        for mode in ("tree", "chain"):
            results = [decode(target, MedusaDrafter(head, mode=mode), p, 40) for p in PROMPTS]
            for prompt, result in zip(PROMPTS, results, strict=True):
                assert result.generated_ids == generate_reference(target.model, prompt, 40, ignore_eos=True)
            taus[name, mode] = sum(r.tau for r in results) / len(results)
    for mode in ("tree", "chain"):
        assert taus["trained", mode] > 2.0
        assert taus["trained", mode] > taus["untrained", mode] + 0.3
    assert taus["trained", "tree"] >= taus["trained", "chain"] - 0.05


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_untrained_heads_report_the_alpha_they_measure(temperature):
    """alpha_exact of deterministic drafts is the target's probability of the drafted token, so an untrained head
    reports its measured depth-1 acceptance, not the overlap of two similar softmaxes (issue 16: 0.94 reported at
    a measured 0.008). Greedy: exactly (each verified position counts 1 when its draft is the argmax); T = 1:
    within sampling noise."""
    torch.manual_seed(0)
    target = Target(tiny_model("llama"))
    head = make_head(target)
    prompts = [*PROMPTS, [1] + [40, 41, 42, 43, 44] * 3]

    def pooled(drafter: MedusaDrafter) -> dict:
        decoder = SpeculativeDecoder(target, drafter=drafter, temperature=temperature, ignore_eos=True, seed=0)
        return summarize([decoder.generate(p, 40) for p in prompts])

    one = pooled(MedusaDrafter(head, mode="chain", max_depth=1))
    depth1, steps = one["acceptance_by_depth"][0], one["depth_attempted"][0]
    tolerance = 1e-12 if temperature == 0.0 else 4 * (max(depth1 * (1 - depth1), 0.01) / steps) ** 0.5
    assert abs(one["alpha_exact"] - depth1) <= tolerance, (one["alpha_exact"], depth1)
    chain = pooled(MedusaDrafter(head, mode="chain"))  # every depth pooled
    verified = sum(chain["depth_attempted"])
    rate = sum(chain["depth_accepted"]) / verified
    tolerance = 1e-12 if temperature == 0.0 else 4 * (max(rate * (1 - rate), 0.01) / verified) ** 0.5
    assert abs(chain["alpha_exact"] - rate) <= tolerance, (chain["alpha_exact"], rate)
    if temperature == 0.0:
        tree = pooled(MedusaDrafter(head))
        # alpha scores each verified position's first child; acceptance may also come from a later sibling
        assert tree["alpha_exact"] <= sum(tree["depth_accepted"]) / sum(tree["depth_attempted"])


def test_sampling_decoding_runs_with_deterministic_siblings():
    target = Target(tiny_model("llama"))
    head = make_head(target)
    train_heads(head, target, self_distilled_ids(target, PROMPTS, 32), steps=20)
    decoder = SpeculativeDecoder(target, drafter=MedusaDrafter(head, num_nodes=16), temperature=0.8, top_p=0.9,
                                 ignore_eos=True, seed=3)
    result = decoder.generate(PROMPTS[0], 30)
    assert len(result.generated_ids) == 30 and all(0 <= t < 320 for t in result.generated_ids)
    assert result.alpha_count > 0 and 0.0 <= result.alpha_exact <= 1.0
    assert result.generated_ids == decoder.generate(PROMPTS[0], 30, seed=3).generated_ids  # seeded


@pytest.mark.shared
@pytest.mark.slow
def test_stories260k_greedy_equality_and_tau(stories260k_dir):
    torch.manual_seed(0)
    target = load_target(stories260k_dir)
    tok = target.tokenizer
    prompts = [tok(text)["input_ids"] for text in ("Once upon a time", "The little dog", "Lily and Tom went",
                                                   "One day, a bird")]
    ids = self_distilled_ids(target, prompts[:3], 96)
    untrained, trained = make_head(target), make_head(target)
    train_heads(trained, target, ids, steps=60)
    trained.set_topk_accuracy(measure_topk_accuracy(trained, target, [ids]))
    taus = {}
    for name, head in (("untrained", untrained), ("trained", trained)):
        for mode in ("tree", "chain"):
            drafter = MedusaDrafter(head, mode=mode, num_nodes=32)
            results = []
            for prompt in prompts:
                result = decode(target, drafter, prompt, 48)
                assert result.generated_ids == generate_reference(target.model, prompt, 48, ignore_eos=True)
                results.append(result)
            taus[name, mode] = sum(r.tau for r in results) / len(results)
    for mode in ("tree", "chain"):
        assert taus["trained", mode] > 1.5
        assert taus["trained", mode] > taus["untrained", mode]
