"""The cost profile's step measurement: each timed step verifies exactly the tokens it is labelled with."""

from __future__ import annotations

import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.testing import tiny_model
from specgraft.tuning import cost


def test_timed_chain_steps_are_never_pruned_by_the_token_budget(monkeypatch):
    """A chain of n - 1 nodes is pruned to remaining - 1 near the end of a run; the slope between the short and the
    long run must only contain whole n-token steps (it once measured a 64-token chain as ~10 tokens)."""
    runs: list[tuple[int, int | None, list[int]]] = []  # (max_new_tokens, chain nodes or None, draft sizes)
    original = SpeculativeDecoder.generate

    def recording(self, prompt, max_new_tokens, seed=None):
        result = original(self, prompt, max_new_tokens, seed)
        tree = getattr(self.drafter, "_tree", None)  # the profile's fixed drafter: a chain or a depth-1 fan
        chain = tree is not None and bool((tree.parents[1:] >= 0).all())
        runs.append((max_new_tokens, int(tree.size) if chain else None, list(result.draft_sizes)))
        return result

    monkeypatch.setattr(SpeculativeDecoder, "generate", recording)
    model = tiny_model("llama")
    ref = cost._Reference(model, 16, 1)
    with torch.no_grad():
        table, bookkeeping = cost.measure_steps(model, 16, [1, 4, 12, 24], 1, ref)
    assert set(table["chain"]) == set(bookkeeping["chain"]) == {1, 4, 12, 24}
    timed = [r for r in runs if r[1] is not None]
    by_nodes: dict[int, list[tuple[int, list[int]]]] = {}
    for max_new, nodes, sizes in timed:
        by_nodes.setdefault(nodes, []).append((max_new, sizes))
    assert set(by_nodes) == {3, 11, 23}
    for nodes, calls in by_nodes.items():
        short, long = sorted({m for m, _ in calls})[-2:]  # the slope's two runs (the warm-up is shorter)
        for max_new, sizes in calls:
            if max_new == long:  # its first (long - short) steps are the ones the slope keeps
                assert sizes[: long - short] == [nodes] * (long - short), nodes


def test_each_timed_drafter_call_follows_a_target_forward(monkeypatch):
    """Drafting is timed as decoding runs it: right after a target forward (back to back, a small drafter keeps its
    working set in the CPU caches and reads 1.2-1.5x cheaper). The forward is untimed: only propose + accept is."""
    from specgraft.decoding.drafters import DraftModelDrafter

    model = tiny_model("llama")
    ref = cost._Reference(model, 16, 1)
    events: list[str] = []
    forward = ref.forward
    monkeypatch.setattr(ref, "forward", lambda: (events.append("target"), forward()))
    drafter = DraftModelDrafter(tiny_model("llama"), k=2)
    propose = drafter.propose

    def recording(ctx):
        events.append("propose")
        return propose(ctx)

    monkeypatch.setattr(drafter, "propose", recording)
    with torch.no_grad():
        cost._time_propose(drafter, model, cost._random_prompt(int(model.config.vocab_size), 16), 5, ref)
    timed = events[2:]  # after the catch-up on the prompt and the warm-up call
    assert timed == ["target", "propose"] * 5, events


def test_no_verification_step_reads_cheaper_than_a_plain_step():
    """A step ratio below 1 is pairing drift (a 4-token forward cannot beat the 1-token one): it is read as 1,
    and larger ratios are kept; each table stays non-decreasing."""
    table = cost.step_table(0.1, {("tree", 3): [0.70, 0.72, 0.75], ("tree", 4): [0.71], ("tree", 8): [1.4, 1.6],
                                  ("chain", 2): [0.9], ("chain", 4): [1.2], ("chain", 8): [1.1]})
    assert table["tree"][3] == table["tree"][4] == 0.1  # floored, not 0.072
    assert abs(table["tree"][8] - 0.15) < 1e-12
    assert table["chain"][1] == table["chain"][2] == 0.1
    assert abs(table["chain"][4] - table["chain"][8]) < 1e-12 and table["chain"][8] > 0.1  # pooled, monotone


def test_steps_are_priced_against_the_evals_baseline_the_faster_plain_decoding(monkeypatch):
    """The eval's baseline is plain decoding with the stock kernels or, when faster, with the switched ones; the
    profile's plain step and its step ratios must use the same, or (the floor at one plain step) every verification
    of a few tokens reads as free next to a slow stock step and the tuner picks the widest tree. Here a plain step
    costs 2 with the stock kernels and 1 with the switched ones, and verifying costs 1.25 switched steps."""
    from types import SimpleNamespace

    from specgraft.kernels.exact_attention import kernel_setting
    from specgraft.kernels.linear import use_weight_major_linears

    model = tiny_model("llama")
    assert use_weight_major_linears(model, min_weights=0) > 0 and kernel_setting(model) != "stock"

    def timed_generate(self, prompt, max_new_tokens, seed=None):
        plain_step = 2.0 if kernel_setting(self.model) == "stock" else 1.0
        step = plain_step * (1.25 if self.drafter is not None else 1.0)
        return SimpleNamespace(num_steps=max_new_tokens, wall_time_s=3.0 + step * max_new_tokens,
                               prefill_time_s=3.0, verify_time_s=0.9 * step * max_new_tokens, draft_sizes=[])

    monkeypatch.setattr(SpeculativeDecoder, "generate", timed_generate)
    ref = cost._Reference(model, 16, 1)
    monkeypatch.setattr(ref, "time", lambda: 1.0)
    table, _ = cost.measure_steps(model, 16, [1, 2, 4], 1, ref)
    assert table["chain"][1] == 1.0  # the switched kernels' plain step, not the stock one's 2.0
    assert table["chain"][2] == table["chain"][4] == 1.25  # against a stock plain step: floored to 2.0
    assert table["tree"][4] == 1.25
