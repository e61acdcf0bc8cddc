"""Verification functions: logits processing, greedy walk, and statistical proof that sampling is lossless.

The statistical tests draw 10^5 independent decoding trials in one vectorised call of the real
``verify_sampling``. The target and the draft are synthetic position-dependent Markov chains over a vocab of 10,
so the exact distribution of the emitted tokens is known in closed form. Each test checks, by chi-square at a
stringent level, the first emitted token and the token after it (emitted after an accepted draft or after a
rejection), and the same test must reject deliberately wrong samplers (negative controls).
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specgraft.decoding import verify
from specgraft.decoding.tree import children_table, depths, tree_structure
from specgraft.decoding.verify import SamplingParams, greedy_verdict, process_logits, verify_greedy, verify_sampling
from specgraft.errors import SpecgraftError

V = 10  # vocab of the synthetic chains
N = 100_000  # trials per statistical test
ROOT = 3  # root token of every trial
PASS_P = 1e-4  # a correct sampler must give p-values above this (fixed seeds: deterministic)
FAIL_P = 1e-12  # a wrong sampler must be rejected this strongly
TREE = [-1, -1, 0, 0, 1, 2, 2, 5]  # root has 2 children; depths 1..4
CHAIN = [-1, 0, 1, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=7, top_p=0.9)


# -- logits processing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.6),
                                                     (1.0, 1, 1.0), (2.0, 0, 0.01)])
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    ours = process_logits(logits, SamplingParams(temperature, top_k, top_p))
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(ours, scores.softmax(-1), atol=1e-6, rtol=0)


def test_process_logits_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    probs = process_logits(logits, SamplingParams(0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # ties: first index, like torch.argmax


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_p=-0.2), dict(top_k=-1), dict(top_k=2.5)])
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(SpecgraftError):
        SamplingParams(**kwargs)


# -- greedy ------------------------------------------------------------------------------------------------------
def test_verify_greedy_walks_the_tree():
    parents = [-1, -1, 0, 0, 1, 3]
    tokens = [5, 6, 7, 8, 9, 4]
    # rows: root, node0..node5; the root wants 6 (node1), node1 wants 9 (node4), node4 wants 2 (no child)
    argmax = [6, 0, 9, 0, 0, 2, 0]
    assert verify_greedy(parents, tokens, argmax) == ([1, 4], 2)
    # root wants 5 -> node0, node0 wants 8 -> node3, node3 wants 4 -> node5 (a leaf): bonus = node5's argmax
    argmax = [5, 8, 0, 0, 4, 0, 1]
    assert verify_greedy(parents, tokens, argmax) == ([0, 3, 5], 1)
    assert verify_greedy(parents, tokens, [1, 0, 0, 0, 0, 0, 0]) == ([], 1)
    assert verify_greedy([], [], [7]) == ([], 7)


def test_device_greedy_verdict_equals_the_tree_walk():
    """greedy_verdict (no host read) picks the same path and bonus as verify_greedy, duplicate siblings included."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 9, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
        tokens = torch.randint(0, 3, (n,), generator=g)  # a 3-token vocab: many matches and duplicates
        argmax = torch.randint(0, 3, (n + 1,), generator=g)
        structure = tree_structure(tuple(parents))
        last, bonus = greedy_verdict(structure, tokens, argmax).tolist()
        assert (structure.path_to(last), bonus) == verify_greedy(parents, tokens, argmax)


# -- synthetic Markov target and draft ---------------------------------------------------------------------------
def _tables(seed: int = 0, positions: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p[pos, token] (processed by PARAMS) and draft q[pos, token], both [positions, V, V]."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(positions, V, V, generator=g) * 1.5
    p = process_logits(target_logits, PARAMS).double()
    draft_logits = target_logits + torch.randn(positions, V, V, generator=g) * 1.2
    q = torch.softmax(draft_logits / PARAMS.temperature, -1).double()  # full support, correlated with p
    return p, q


def _draft_trials(parents, root: torch.Tensor, root_pos: int, q_table, sampled: bool, g):
    """Per-trial draft tokens [B, n], q rows [B, n, V], and target rows p [B, n+1, V] (needs the p table)."""
    batch = root.shape[0]
    n = len(parents)
    d = depths(parents).tolist()
    table = children_table(parents)
    tokens = torch.zeros(batch, n, dtype=torch.long)
    q = torch.zeros(batch, n, V, dtype=torch.float64)
    for i, parent in enumerate(parents):
        parent_tok = root if parent < 0 else tokens[:, parent]
        rows = q_table[root_pos + d[i] - 1, parent_tok]  # [B, V] distribution at the parent
        q[:, i] = rows
        if sampled:
            tokens[:, i] = torch.multinomial(rows, 1, generator=g).squeeze(1)
        else:
            rank = table[parent + 1].index(i)  # deterministic top-k: the rank-th best token of the parent's q
            tokens[:, i] = torch.topk(rows, rank + 1, dim=-1).indices[:, rank]
    return tokens, q


def _target_rows(parents, root, root_pos, tokens, p_table):
    d = [0] + depths(parents).tolist()
    toks = torch.cat([root.unsqueeze(1), tokens], dim=1)  # [B, n+1]
    return torch.stack([p_table[root_pos + d[r], toks[:, r]] for r in range(len(parents) + 1)], dim=1)


def _run_step(parents, root, root_pos, p_table, q_table, sampled, g):
    tokens, q = _draft_trials(parents, root, root_pos, q_table, sampled, g)
    p = _target_rows(parents, root, root_pos, tokens, p_table)
    verdict = verify_sampling(parents, tokens, p, q if sampled else None, sampled, generator=g)
    return tokens, verdict


def _simulate(parents, sampled: bool, seed: int = 1):
    """First two emitted tokens of N trials, and whether the first was an accepted draft."""
    p_table, q_table = _tables()
    g = torch.Generator().manual_seed(seed)
    root = torch.full((N,), ROOT, dtype=torch.long)
    tokens, verdict = _run_step(parents, root, 0, p_table, q_table, sampled, g)
    first_accepted = verdict.num_accepted >= 1
    arange = torch.arange(N)
    path0 = verdict.path[:, 0].clamp(min=0) if verdict.path.shape[1] else torch.zeros(N, dtype=torch.long)
    y1 = torch.where(first_accepted, tokens[arange, path0], verdict.bonus)
    # The token after y1: the next accepted node or the bonus of the same step, or (after a rejection) the first
    # token of a second step rooted at y1 (position 1).
    two = verdict.num_accepted >= 2
    path1 = verdict.path[:, 1].clamp(min=0) if verdict.path.shape[1] > 1 else torch.zeros(N, dtype=torch.long)
    y2 = torch.where(two, tokens[arange, path1], verdict.bonus)
    again = ~first_accepted
    if bool(again.any()):
        tok2, v2 = _run_step(parents, y1[again], 1, p_table, q_table, sampled, g)
        a2 = torch.arange(int(again.sum()))
        first2 = torch.where(v2.num_accepted >= 1, tok2[a2, v2.path[:, 0].clamp(min=0)], v2.bonus)
        y2[again] = first2
    return y1, y2, first_accepted, p_table, q_table


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells of expected count < 5 are pooled; any count in a zero-probability cell
    fails outright (p = 0)."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep & (expected > 0)].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep & (expected > 0)].sum().view(1)])
    nonzero = exp > 0
    obs, exp = obs[nonzero], exp[nonzero]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _conditional_pvalue(y_cond: torch.Tensor, y_next: torch.Tensor, cond_probs: torch.Tensor) -> float:
    """Chi-square of y_next given y_cond against rows of cond_probs [V, V] (row totals fixed)."""
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((y_cond, y_next), torch.ones_like(y_cond, dtype=torch.float64), accumulate=True)
    stat, df = 0.0, 0
    for a in range(V):
        total = counts[a].sum()
        if total == 0:
            continue
        exp = total * cond_probs[a]
        obs = counts[a]
        if bool((obs[exp == 0] > 0).any()):
            return 0.0
        keep = exp >= 5
        rest = ~keep & (exp > 0)
        o = torch.cat([obs[keep], obs[rest].sum().view(1)])
        e = torch.cat([exp[keep], exp[rest].sum().view(1)])
        o, e = o[e > 0], e[e > 0]
        stat += float(((o - e) ** 2 / e).sum())
        df += o.numel() - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _pvalues(parents, sampled: bool) -> dict[str, float]:
    y1, y2, acc, p_table, _ = _simulate(parents, sampled)
    p1 = p_table[0, ROOT]  # [V]
    joint = p1.unsqueeze(1) * p_table[1]  # [V, V]: P(y1, y2)
    counts1 = torch.bincount(y1, minlength=V)
    counts12 = torch.zeros(V, V, dtype=torch.float64)
    counts12.index_put_((y1, y2), torch.ones(N, dtype=torch.float64), accumulate=True)
    return {
        "first": _chi2_pvalue(counts1, N * p1),
        "joint": _chi2_pvalue(counts12, N * joint),
        "after_accepted": _conditional_pvalue(y1[acc], y2[acc], p_table[1]),
        "after_rejected": _conditional_pvalue(y1[~acc], y2[~acc], p_table[1]),
        "accept_rate": float(acc.double().mean()),
    }


CASES = [("chain_sampled", CHAIN, True), ("tree_iid", TREE, True), ("chain_deterministic", CHAIN, False),
         ("tree_topk", TREE, False)]


@pytest.mark.parametrize("name,parents,sampled", CASES, ids=[c[0] for c in CASES])
def test_sampling_verification_is_lossless(name, parents, sampled):
    pv = _pvalues(parents, sampled)
    assert 0.05 < pv["accept_rate"] < 0.95, pv  # both branches well exercised
    for key in ("first", "joint", "after_accepted", "after_rejected"):
        assert pv[key] > PASS_P, (name, key, pv)


def test_chain_first_acceptance_rate_equals_alpha_exact():
    """P(first draft accepted) = sum_x min(p, q) (1 - TV); checked within 5 standard errors."""
    _, _, acc, p_table, q_table = _simulate(CHAIN, sampled=True)
    alpha = float(verify.alpha_exact(p_table[0, ROOT], q_table[0, ROOT]))
    se = (alpha * (1 - alpha) / N) ** 0.5
    assert abs(float(acc.double().mean()) - alpha) < 5 * se


WRONG = [
    ("accept_always", "_acceptance_prob", lambda p_x, q_x: torch.ones_like(p_x), CHAIN, True),
    ("residual_is_p", "_iid_residual", lambda p, q: p, CHAIN, True),
    ("residual_no_clamp", "_iid_residual", lambda p, q: (p - q).abs(), TREE, True),
    ("tree_residual_is_p", "_iid_residual", lambda p, q: p, TREE, True),
    ("topk_no_zeroing", "_point_residual", lambda p, x: p, TREE, False),
]


@pytest.mark.parametrize("name,attr,wrong,parents,sampled", WRONG, ids=[w[0] for w in WRONG])
def test_negative_control_wrong_sampler_is_rejected(monkeypatch, name, attr, wrong, parents, sampled):
    monkeypatch.setattr(verify, attr, wrong)
    pv = _pvalues(parents, sampled)
    assert min(pv["first"], pv["joint"]) < FAIL_P, (name, pv)


def test_sampling_with_empty_tree_samples_from_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    verdict = verify_sampling([], torch.zeros(N, 0, dtype=torch.long), p.expand(N, 1, 4), None, False, g)
    assert verdict.path.shape == (N, 0) and int(verdict.num_accepted.max()) == 0
    assert _chi2_pvalue(torch.bincount(verdict.bonus, minlength=4), N * p) > PASS_P


def test_sampled_tree_without_q_raises():
    with pytest.raises(SpecgraftError):
        verify_sampling([-1], torch.zeros(1, 1, dtype=torch.long), torch.full((1, 2, 3), 1 / 3), None, True)
