"""The speculative decoder: greedy losslessness, cache bookkeeping, stopping rules, the drafter contract."""

from __future__ import annotations

import copy

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.drafters import DraftModelDrafter, RandomDrafter, SelfDrafter
from specgraft.decoding.tree import DraftTree, tree_structure
from specgraft.errors import SpecgraftError, TargetMismatchError
from specgraft.testing import tiny_model, tiny_tokenizer

NEW = 24  # tokens generated per greedy check
K = 4


def perturbed(model, scale: float = 0.1, seed: int = 0):
    """A copy of ``model`` with relative Gaussian noise on every weight: a draft that agrees only partly."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return draft


def prompt_ids(n: int = 6, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=new, eos_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def drafters(model) -> dict[str, Drafter | None]:
    draft = perturbed(model)
    return {
        "plain": None,
        "self": SelfDrafter(k=K),
        "self_tree": SelfDrafter(k=3, tree_topk=(2, 2)),
        "random": RandomDrafter(model.config.vocab_size, k=3),
        "draft_chain": DraftModelDrafter(draft, k=3),
        "draft_tree": DraftModelDrafter(draft, k=3, tree_topk=(3, 2)),
    }


# -- greedy losslessness -----------------------------------------------------------------------------------------
@torch.no_grad()
def test_greedy_speculative_equals_plain_reference_and_transformers(tiny_arch):
    model = tiny_model(tiny_arch)
    prompt = prompt_ids()
    reference = generate_reference(model, prompt, NEW)
    assert reference == hf_greedy(model, prompt, NEW)
    for name, drafter in drafters(model).items():
        result = SpeculativeDecoder(model, drafter=drafter).generate(prompt, NEW)
        assert result.generated_ids == reference, name
        assert result.num_target_forwards == result.num_steps + 1  # prefill + one forward per step
        assert sum(result.emitted_per_step) == len(reference)


@pytest.mark.parametrize("arch,overrides", [
    ("gemma2", {"sliding_window": 4}),
    ("gemma3_text", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("mistral", {"sliding_window": 4}),
])
@torch.no_grad()
def test_greedy_with_sliding_window_shorter_than_the_sequence(arch, overrides):
    model = tiny_model(arch, **overrides)
    prompt = prompt_ids(7, seed=3)
    reference = generate_reference(model, prompt, 20, ignore_eos=True)
    assert len(reference) == 20
    for name, drafter in drafters(model).items():
        result = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 20)
        assert result.generated_ids == reference, name


@torch.no_grad()
def test_partial_acceptance_is_exercised_and_counted():
    model = tiny_model("llama")
    result = SpeculativeDecoder(model, drafter=DraftModelDrafter(perturbed(model), k=3),
                                ignore_eos=True).generate(prompt_ids(), 40)
    assert result.generated_ids == generate_reference(model, prompt_ids(), 40, ignore_eos=True)
    assert 0 < sum(result.accepted_lengths) < 3 * result.num_steps  # some accepted, some rejected
    # per-depth counts agree with the per-step accepted lengths of a chain
    for d in range(1, 4):
        assert result.depth_accepted[d - 1] == sum(a >= d for a in result.accepted_lengths)
        assert result.depth_attempted[d - 1] == sum(a >= d - 1 for a in result.accepted_lengths)
    assert result.tau == pytest.approx(1 + sum(result.accepted_lengths) / result.num_steps)


@torch.no_grad()
def test_self_drafter_tau_is_k_plus_one(tiny_arch):
    model = tiny_model(tiny_arch)
    result = SpeculativeDecoder(model, drafter=SelfDrafter(k=K), ignore_eos=True).generate(prompt_ids(), 4 * (K + 1))
    assert result.accepted_lengths == [K] * 4
    assert result.tau == K + 1
    assert result.depth_attempted == result.depth_accepted == [4] * K
    assert result.alpha_exact == 1.0  # greedy: q one-hot of the draft argmax = the target argmax
    # a budget that is not a multiple of k+1: all steps but the last are full, the last is truncated
    result = SpeculativeDecoder(model, drafter=SelfDrafter(k=K), ignore_eos=True).generate(prompt_ids(), 12)
    # the last step has 2 tokens left: the drafter is asked for 1 node (the bonus brings the second), not K
    assert result.draft_sizes == [K, K, 1]
    assert result.accepted_lengths == [K, K, 1] and result.emitted_per_step == [5, 5, 2]
    assert result.stop_reason == "max_new_tokens" and result.num_new_tokens == 12


def test_timed_parts_of_a_generation_are_disjoint_parts_of_its_wall_time(monkeypatch):
    """prefill, verification (forward + verdict) and drafting are each timed once and never overlap: the tuner
    subtracts them from the wall time to find what the rest of a step costs."""
    model = tiny_model("llama")
    forwards = []  # perf_counter reads seen by each target forward: the forward must lie inside a timed part
    forward = model.forward
    clock = iter(range(10_000))  # every perf_counter read advances 1 "second": parts are counted in reads
    monkeypatch.setattr("specgraft.decoding.decoder.time.perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(model, "forward", lambda *a, **k: (forwards.append(k["input_ids"].shape[1]),
                                                           forward(*a, **k))[1])
    drafter = DraftModelDrafter(tiny_model("llama", seed=1), k=K)
    result = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt_ids(), 12)
    assert len(forwards) == result.num_target_forwards == 1 + result.num_steps
    assert result.prefill_time_s > 0 and result.verify_time_s >= result.num_steps > 0 and result.draft_time_s > 0
    parts = result.prefill_time_s + result.verify_time_s + result.draft_time_s
    assert parts < result.wall_time_s  # disjoint (a shared interval would be counted twice) and not all of it


@torch.no_grad()
def test_random_drafter_alpha_and_tau():
    model = tiny_model("llama")
    result = SpeculativeDecoder(model, drafter=RandomDrafter(320, k=3), ignore_eos=True).generate(prompt_ids(), 20)
    # greedy: every draft is a point mass, so alpha is the share of verified positions whose draft is the argmax
    assert result.alpha_count == sum(result.depth_attempted)
    assert result.alpha_exact == sum(result.depth_accepted) / sum(result.depth_attempted)
    assert 1.0 <= result.tau < 1.5
    # sampling: the drafts are uniform draws, so alpha is the mean over positions of sum_x min(p(x), 1/V)
    sampled = SpeculativeDecoder(model, drafter=RandomDrafter(320, k=3), ignore_eos=True, temperature=1.0)
    result = sampled.generate(prompt_ids(), 8, seed=0)
    assert 0.0 < result.alpha_exact < 1.0 and result.alpha_count == sum(result.depth_attempted)


class StaticTreeDrafter(Drafter):
    """Random tokens on a fixed tree shape, drawn on the device (the drafter itself reads nothing back)."""

    def __init__(self, parents: list[int], vocab_size: int, sampled: bool) -> None:
        self.structure = tree_structure(tuple(parents))
        self.vocab_size, self.sampled = vocab_size, sampled

    def propose(self, ctx: DraftContext) -> DraftTree:
        n = self.structure.size
        tokens = torch.randint(0, self.vocab_size, (n,), generator=ctx.generator)
        q = torch.full((n, self.vocab_size), 1.0 / self.vocab_size) if self.sampled else None
        return DraftTree(tokens=tokens, parents=self.structure.parent_rows() - 1, q=q, sampled=self.sampled,
                         structure=self.structure)


@pytest.mark.parametrize("temperature,sampled", [(0.0, False), (1.0, False), (1.0, True)])
@torch.no_grad()
def test_one_device_read_per_step_outside_the_model(monkeypatch, temperature, sampled):
    """The decoder reads the device once per step (the verdict) plus once per generation (alpha), whatever the
    tree: no tolist/item/bool/int/float on tensors for validation, parent walks, sibling slots or statistics."""
    model = tiny_model("llama")
    drafter = StaticTreeDrafter([-1, -1, 0, 0, 1, 2], 320, sampled)
    decoder = SpeculativeDecoder(model, drafter=drafter, temperature=temperature, ignore_eos=True)
    prompt = prompt_ids()
    reads = {"count": 0, "paused": False}
    model.register_forward_pre_hook(lambda *_: reads.update(paused=True))
    model.register_forward_hook(lambda *_: reads.update(paused=False))
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original):
            if not reads["paused"]:
                reads["count"] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    result = decoder.generate(prompt, 20)
    monkeypatch.undo()
    assert result.num_steps >= 5
    assert reads["count"] == result.num_steps + 1


# -- stopping rules ----------------------------------------------------------------------------------------------
@torch.no_grad()
def test_eos_stops_generation_even_mid_accepted_path():
    model = tiny_model("llama")
    prompt = prompt_ids()
    free = generate_reference(model, prompt, 30, ignore_eos=True)
    eos = free[6]  # with SelfDrafter(k=4) the 7th token is the 2nd token of the 2nd accepted path
    first = free.index(eos)
    for drafter in (None, SelfDrafter(k=K), RandomDrafter(320, 3)):
        result = SpeculativeDecoder(model, drafter=drafter, eos_token_id=eos).generate(prompt, 30)
        assert result.generated_ids == free[: first + 1]
        assert result.stop_reason == "eos"
    assert generate_reference(model, prompt, 30, eos_token_id=eos) == free[: first + 1]
    hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, eos_token_id=eos)
    assert hf[0, len(prompt):].tolist() == free[: first + 1]


@torch.no_grad()
def test_max_new_tokens_truncates_an_overshooting_path():
    model = tiny_model("qwen2")
    prompt = prompt_ids()
    for new in (0, 1, 3, 7):
        reference = generate_reference(model, prompt, new, ignore_eos=True)
        result = SpeculativeDecoder(model, drafter=SelfDrafter(k=K), ignore_eos=True).generate(prompt, new)
        assert result.generated_ids == reference and len(reference) == new
        assert result.stop_reason == "max_new_tokens"
        assert result.num_target_forwards == (0 if new == 0 else result.num_steps + 1)


@torch.no_grad()
def test_context_limit_is_never_exceeded():
    model = tiny_model("llama", max_position_embeddings=16)
    prompt = prompt_ids(10)
    reference = generate_reference(model, prompt, 100, ignore_eos=True)
    assert len(reference) == 6  # the sequence fills the 16 positions
    seen_depths = []

    class Spy(SelfDrafter):
        def propose(self, ctx):
            seen_depths.append(ctx.max_depth)
            return super().propose(ctx)

    for drafter in (None, SelfDrafter(k=8), RandomDrafter(320, k=8), Spy(k=3)):
        result = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 100)
        assert result.generated_ids == reference
        assert result.stop_reason == "context_limit"
    assert seen_depths[0] == 16 - 10 - 1
    full = prompt_ids(16)
    assert SpeculativeDecoder(model, ignore_eos=True).generate(full, 5).generated_ids == []
    with pytest.raises(SpecgraftError, match="context of 16"):
        SpeculativeDecoder(model).generate(prompt_ids(17), 5)
    with pytest.raises(SpecgraftError, match="context of 16"):
        generate_reference(model, prompt_ids(17), 5)


@torch.no_grad()
def test_tree_deeper_than_the_context_is_pruned():
    model = tiny_model("llama", max_position_embeddings=14)

    class DeepSelf(SelfDrafter):
        def propose(self, ctx):
            return super().propose(DraftContext(**{**ctx.__dict__, "max_depth": 6}))  # ignores the limit

    prompt = prompt_ids(4)
    reference = generate_reference(model, prompt, 100, ignore_eos=True)
    result = SpeculativeDecoder(model, drafter=DeepSelf(k=6, tree_topk=(2,)), ignore_eos=True).generate(prompt, 100)
    assert result.generated_ids == reference and len(reference) == 10
    # step 1: 2 branches x 6 levels, all verified (max depth 14-4-1 = 9); step 2 at L=11: depth <= 2 -> 4 nodes
    assert result.draft_sizes == [12, 4] and result.accepted_lengths == [6, 2]


@torch.no_grad()
def test_pruned_tree_reports_accepted_nodes_in_the_proposed_indexing():
    model = tiny_model("llama", max_position_embeddings=13)
    prompt = prompt_ids(9)
    reference = generate_reference(model, prompt, 100, ignore_eos=True)
    calls = []

    class TwoChains(Drafter):
        """Chain A (nodes 0-3, wrong tokens, depth 4) then chain B (nodes 4-5, the true continuation)."""

        def propose(self, ctx):
            done = ctx.length - len(prompt)
            wrong = [(t + 1) % 320 for t in reference[done: done + 4]] + [0] * 4
            right = reference[done: done + 2] + [0] * 2
            return DraftTree(torch.tensor(wrong[:4] + right[:2]), torch.tensor([-1, 0, 1, 2, -1, 4]))

        def accept(self, accepted_node_indices, bonus_token):
            calls.append((list(accepted_node_indices), bonus_token))

    result = SpeculativeDecoder(model, drafter=TwoChains(), ignore_eos=True).generate(prompt, 100)
    assert result.generated_ids == reference and len(reference) == 4
    # step 1: L=9, max depth 13-9-1 = 3 prunes node 3 (depth 4); the accepted nodes 3, 4 of the pruned tree are
    # reported as 4, 5 of the proposed one, with the bonus reference[2]
    assert result.draft_sizes[0] == 5
    assert calls[0] == ([4, 5], reference[2])


# -- the drafter contract ----------------------------------------------------------------------------------------
class RecordingDrafter(Drafter):
    """Records every context. Drafts a decoy child of the root (node 0, always wrong) and a chain of fixed guesses
    under a second child (nodes 1-3), so accepted paths are not a prefix of the node order (the KV gather path)."""

    def __init__(self, layers, guesses):
        self.needs_hidden_states = tuple(layers)
        self.guesses = guesses
        self.contexts: list[DraftContext] = []
        self.accepts: list[tuple[list[int], int]] = []
        self.resets = 0

    def reset(self):
        self.resets += 1

    def propose(self, ctx):
        self.contexts.append(DraftContext(**{**ctx.__dict__, "hidden_states": dict(ctx.hidden_states)}))
        pos = ctx.length - ctx.prompt_length
        chain = self.guesses[pos: pos + 3]
        decoy = (chain[0] + 7) % 320
        return DraftTree(torch.tensor([decoy] + chain), torch.tensor([-1, -1, 1, 2]))

    def accept(self, accepted_node_indices, bonus_token):
        self.accepts.append((list(accepted_node_indices), bonus_token))


@torch.no_grad()
def test_drafter_receives_tokens_and_target_hidden_states_of_every_position(tiny_arch):
    model = tiny_model(tiny_arch)
    n_layers = model.config.num_hidden_layers
    prompt = prompt_ids(5)
    reference = generate_reference(model, prompt, 16, ignore_eos=True)
    guesses = [t if i % 3 else (t + 1) % 320 for i, t in enumerate(reference)] + [0] * 8  # every 3rd guess wrong
    drafter = RecordingDrafter((0, 2, n_layers), guesses)
    result = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 16)
    assert result.generated_ids == reference and drafter.resets == 1
    full = torch.tensor([prompt + reference])
    states = model(input_ids=full, output_hidden_states=True).hidden_states
    covered = 0
    for ctx in drafter.contexts:
        assert ctx.token_ids.tolist() == (prompt + reference)[: ctx.length]
        assert ctx.hidden_start == covered
        for layer in (0, 2, n_layers):
            h = ctx.hidden_states[layer]
            assert h.shape == (ctx.length - 1 - covered, model.config.hidden_size)
            torch.testing.assert_close(h, states[layer][0, covered: ctx.length - 1], atol=1e-4, rtol=1e-4)
        covered = ctx.length - 1
    # accept() reports the accepted nodes and the bonus that became the next root
    for (accepted, bonus), nxt in zip(drafter.accepts, drafter.contexts[1:]):
        assert nxt.token_ids[-1].item() == bonus
        assert accepted == list(range(1, len(accepted) + 1))
    assert 0 < sum(result.accepted_lengths) < 3 * result.num_steps


def test_hidden_state_indices_out_of_range_raise():
    model = tiny_model("llama")
    with pytest.raises(SpecgraftError, match="hidden states"):
        SpeculativeDecoder(model, drafter=RecordingDrafter((5,), []))


# -- sampling ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_plain_sampling_equals_reference_sampling_with_the_same_seed():
    model = tiny_model("llama")
    prompt = prompt_ids()
    for kwargs in (dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)):
        g = torch.Generator().manual_seed(5)
        reference = generate_reference(model, prompt, 20, generator=g, ignore_eos=True, **kwargs)
        result = SpeculativeDecoder(model, ignore_eos=True, seed=5, **kwargs).generate(prompt, 20)
        assert result.generated_ids == reference


@torch.no_grad()
def test_sampling_runs_are_reproducible_and_self_drafts_are_accepted():
    model = tiny_model("llama")
    dec = SpeculativeDecoder(model, drafter=SelfDrafter(k=3), temperature=0.8, top_p=0.95, ignore_eos=True)
    a, b = dec.generate(prompt_ids(), 16, seed=3), dec.generate(prompt_ids(), 16, seed=3)
    assert a.generated_ids == b.generated_ids
    # q equals p (same model, same processing): acceptance probability min(1, p/q) = 1 up to rounding
    assert a.alpha_exact == pytest.approx(1.0, abs=1e-5)
    assert a.tau == pytest.approx(4.0, abs=0.5)


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    observed, expected = observed.double().flatten(), expected.double().flatten()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    keep = expected >= 5
    rest = ~keep & (expected > 0)
    o = torch.cat([observed[keep], observed[rest].sum().view(1)])
    e = torch.cat([expected[keep], expected[rest].sum().view(1)])
    o, e = o[e > 0], e[e > 0]
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((o.numel() - 1) / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("mode,wrong", [("iid", False), ("topk", False), ("iid", True)],
                         ids=["iid_tree", "topk_tree", "negative_control_residual_is_p"])
@torch.no_grad()
def test_speculative_sampling_end_to_end_matches_the_target_distribution(monkeypatch, mode, wrong):
    """Smaller-N end-to-end check through the decoder (the 10^5-draw proof is in test_verify.py): the first two
    tokens of a vocab-12 target, drafted by a partly-agreeing draft model as a tree, against the exact target
    distribution; a sampler that resamples from p after a rejection must be rejected by the same test."""
    from specgraft.decoding import verify
    from specgraft.decoding.verify import SamplingParams, process_logits

    vocab, draws = 12, 800
    model = tiny_model("llama", vocab_size=vocab, hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    params = dict(temperature=0.9, top_k=8)
    drafter = DraftModelDrafter(perturbed(model, scale=0.5), k=2, tree_topk=(2,), sibling_mode=mode)
    dec = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True, seed=11, **params)
    prompt = [1, 5, 7]
    sp = SamplingParams(**params)
    p1 = process_logits(model(input_ids=torch.tensor([prompt])).logits[0, -1], sp).double()  # [V]
    nxt = torch.tensor([prompt + [t] for t in range(vocab)])
    p2 = process_logits(model(input_ids=nxt).logits[:, -1], sp).double()  # [V, V]: row = first token
    if wrong:
        monkeypatch.setattr(verify, "_iid_residual", lambda p, q: p)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    accepted = 0
    for _ in range(draws):
        r = dec.generate(prompt, 2)
        counts[r.generated_ids[0], r.generated_ids[1]] += 1
        accepted += r.accepted_lengths[0] > 0
    pvalue = _chi2_pvalue(counts, draws * p1.unsqueeze(1) * p2)
    if wrong:
        assert pvalue < 1e-8
    else:
        assert 0.1 < accepted / draws < 0.95  # both acceptance and rejection well exercised
        assert pvalue > 1e-4


# -- errors and API ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-2)])
def test_invalid_sampling_settings_raise(kwargs):
    with pytest.raises(SpecgraftError):
        SpeculativeDecoder(tiny_model("llama"), **kwargs)


def test_bad_prompts_and_budgets_raise():
    dec = SpeculativeDecoder(tiny_model("llama"))
    with pytest.raises(SpecgraftError, match="batch size"):
        dec.generate(torch.ones(2, 4, dtype=torch.long), 3)
    with pytest.raises(SpecgraftError, match="empty"):
        dec.generate([], 3)
    with pytest.raises(SpecgraftError, match="tokenizer"):
        dec.generate("hello", 3)
    with pytest.raises(SpecgraftError, match="max_new_tokens"):
        dec.generate([1, 2], -1)


def test_draft_model_with_another_vocab_is_refused():
    target = tiny_model("llama")
    with pytest.raises(TargetMismatchError, match="256.*320"):
        SpeculativeDecoder(target, drafter=DraftModelDrafter(tiny_model("llama", vocab_size=256)))
    with pytest.raises(TargetMismatchError, match="100"):
        SpeculativeDecoder(target, drafter=RandomDrafter(100))
    other_tok = tiny_tokenizer()
    other_tok.add_tokens(["<extra>"])
    with pytest.raises(TargetMismatchError, match="tokenizer"):
        SpeculativeDecoder(target, tokenizer=tiny_tokenizer(),
                           drafter=DraftModelDrafter(tiny_model("llama"), tokenizer=other_tok))


@torch.no_grad()
def test_text_prompt_and_target_wrapper():
    from specgraft.target import Target

    tok = tiny_tokenizer()
    target = Target(tiny_model("llama"), tok)
    result = SpeculativeDecoder(target, drafter=SelfDrafter(k=2), ignore_eos=True).generate("Once upon", 6)
    assert result.prompt_ids == tok("Once upon")["input_ids"]
    assert result.text == tok.decode(result.generated_ids, skip_special_tokens=True)
    assert result.tokens_per_second > 0 and result.wall_time_s > 0


class _OutOfVocabDrafter(Drafter):
    """Drafts a chain whose second token lies past the target's vocabulary (a faulty drafter)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.chain(torch.tensor([1, self.vocab_size + 3]))


@torch.no_grad()
def test_greedy_verdict_on_the_host_equals_the_device_verdict():
    """On the CPU the greedy verdict is read and walked in Python; the device path (GPUs) must give the same
    tokens, acceptance counts and alpha for chains and trees."""
    model = tiny_model("llama")
    prompt = prompt_ids(7, seed=5)
    for name, drafter in drafters(model).items():
        if drafter is None:
            continue
        runs = []
        for host in (True, False):
            decoder = SpeculativeDecoder(model, drafter=copy.deepcopy(drafter), ignore_eos=True)
            decoder.host_verdict = host
            runs.append(decoder.generate(prompt, 24))
        host_run, device_run = runs
        assert host_run.generated_ids == device_run.generated_ids, name
        assert host_run.accepted_lengths == device_run.accepted_lengths, name
        assert (host_run.depth_attempted, host_run.depth_accepted) == (device_run.depth_attempted,
                                                                      device_run.depth_accepted), name
        assert host_run.alpha_sum == pytest.approx(device_run.alpha_sum) and host_run.alpha_count == \
            device_run.alpha_count, name


@pytest.mark.parametrize("host_verdict", [True, False])
@torch.no_grad()
def test_a_draft_token_outside_the_vocabulary_is_refused(host_verdict):
    model = tiny_model("llama")
    decoder = SpeculativeDecoder(model, drafter=_OutOfVocabDrafter(model.config.vocab_size))
    decoder.host_verdict = host_verdict
    with pytest.raises(SpecgraftError, match="outside the target vocab"):
        decoder.generate(prompt_ids(), 8)
