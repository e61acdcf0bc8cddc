"""Row-exact attention: a verification row equals the one-row call plain decoding makes, bit for bit."""

from __future__ import annotations

import types

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.eval.decoder import SpeculativeDecoder
from specgraft.eval.drafter import DraftContext, Drafter
from specgraft.eval.exact_attention import (
    KEY_BLOCK,
    ROWS_KWARG,
    apply_attention_kernel,
    attention_kernel_of,
    chain_row_keys,
    exact_attention_forward,
    row_keys,
    rows_computed_independently,
)
from specgraft.eval.tree import DraftTree, tree_structure
from specgraft.testing import tiny_model

KV_HEADS, GROUP, DIM = 2, 3, 16
MODULE = types.SimpleNamespace(num_key_value_groups=GROUP, is_causal=True)


def require_row_exact_kernels(kv_heads: int, group: int, dim: int, dtype: torch.dtype) -> None:
    """Skip a bit-equality check on a machine whose BLAS does not compute rows independently at this shape (the
    kernel's premise; there ``apply_attention_kernel`` refuses ``exact``:
    ``test_exact_is_refused_in_one_line_where_rows_are_not_independent``). Closeness to the float64 reference is
    asserted before this is called, everywhere."""
    if not rows_computed_independently(kv_heads, group, dim, str(dtype), "cpu"):
        pytest.skip(f"this machine's matmul kernels are not row-independent at {kv_heads}x{group}x{dim} {dtype}: "
                    "exact attention is refused here, so its bit equality cannot hold")


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows) -> torch.Tensor:
    out, _ = exact_attention_forward(MODULE, query, keys, values, None, scaling=DIM ** -0.5, **{ROWS_KWARG: rows})
    return out  # [1, q, H, d]


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of one row over the given keys: [H, d] for query [H, d], keys [KVH, n, d]."""
    k = keys.double().repeat_interleave(GROUP, dim=0)
    v = values.double().repeat_interleave(GROUP, dim=0)
    weights = torch.softmax((query.double().unsqueeze(1) @ k.transpose(1, 2)) * DIM ** -0.5, dim=-1)  # [H, 1, n]
    return (weights @ v).squeeze(1)


# A tree with the accepted path away from the first rows: row r's path is not a contiguous run of cache slots.
TREE_PARENTS = (-1, -1, -1, 1, 1, 4, 2, 5, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [0, 1, 5, KEY_BLOCK - 3, KEY_BLOCK, KEY_BLOCK + 1, 3 * KEY_BLOCK - 2])
def test_every_tree_row_equals_the_one_row_call_on_its_own_keys(dtype, past):
    torch.manual_seed(past)
    structure = tree_structure(TREE_PARENTS)
    q = structure.size + 1
    heads = KV_HEADS * GROUP
    keys = torch.randn(1, KV_HEADS, past + q, DIM).to(dtype)
    values = torch.randn(1, KV_HEADS, past + q, DIM).to(dtype)
    query = torch.randn(1, heads, q, DIM).to(dtype)
    out = _attend(query, keys, values, row_keys(past, structure.row_paths(), structure.row_depths()))
    alone = []
    for r in range(q):
        # What plain decoding holds when it reaches row r: the prefix, then r's path in order, then r itself.
        path = structure.row_paths()[r, : int(structure.row_depths()[r]) + 1]
        slots = torch.cat([torch.arange(past), past + path])
        own_k, own_v = keys[:, :, slots], values[:, :, slots]
        alone.append(_attend(query[:, :, r : r + 1], own_k, own_v, chain_row_keys(len(slots) - 1, 1)))
        ref = _reference(query[0, :, r], own_k[0], own_v[0])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[0, r].double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(alone[r][0, 0].double(), ref, atol=tol, rtol=tol)
    require_row_exact_kernels(KV_HEADS, GROUP, DIM, dtype)
    for r in range(q):
        assert torch.equal(out[0, r], alone[r][0, 0]), f"row {r} differs from its one-row call"


@pytest.mark.parametrize("past", [200, 613])
def test_rows_equal_their_one_row_calls_at_a_real_model_shape(past):
    """SmolLM2's attention shape (9 query heads over 3 KV heads of 64) in bf16, at cache lengths whose block counts
    (13 and 39 with the tree) are not powers of two: the block sum's first, unpadded level is exercised."""
    torch.manual_seed(past)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    structure = tree_structure(TREE_PARENTS)
    q = structure.size + 1
    keys, values = (torch.randn(1, 3, past + q, 64).bfloat16() for _ in range(2))
    query = torch.randn(1, 9, q, 64).bfloat16()
    paths, depths = structure.row_paths(), structure.row_depths()
    out, _ = exact_attention_forward(module, query, keys, values, None, scaling=0.125,
                                     **{ROWS_KWARG: row_keys(past, paths, depths)})
    alone = []
    for r in range(q):
        slots = torch.cat([torch.arange(past), past + paths[r, : int(depths[r]) + 1]])
        alone.append(exact_attention_forward(module, query[:, :, r : r + 1], keys[:, :, slots], values[:, :, slots],
                                             None, scaling=0.125,
                                             **{ROWS_KWARG: chain_row_keys(len(slots) - 1, 1)})[0])
        torch.testing.assert_close(out[0, r].float(), alone[r][0, 0].float(), atol=2e-2, rtol=2e-2)
    require_row_exact_kernels(3, 3, 64, torch.bfloat16)
    for r in range(q):
        assert torch.equal(out[0, r], alone[r][0, 0]), f"row {r} differs from its one-row call"


def test_a_chain_layout_is_causal_and_matches_row_by_row_decoding():
    torch.manual_seed(0)
    past, q = KEY_BLOCK + 7, 12
    keys, values = torch.randn(1, KV_HEADS, past + q, DIM), torch.randn(1, KV_HEADS, past + q, DIM)
    query = torch.randn(1, KV_HEADS * GROUP, q, DIM)
    out = _attend(query, keys, values, chain_row_keys(past, q))
    alone = []
    for r in range(q):
        n = past + r + 1
        alone.append(_attend(query[:, :, r : r + 1], keys[:, :, :n], values[:, :, :n], chain_row_keys(n - 1, 1)))
        torch.testing.assert_close(out[0, r].double(), _reference(query[0, :, r], keys[0, :, :n], values[0, :, :n]),
                                   atol=1e-5, rtol=1e-5)  # causal: row r sees exactly the first n keys
    require_row_exact_kernels(KV_HEADS, GROUP, DIM, torch.float32)
    for r in range(q):
        assert torch.equal(out[0, r], alone[r][0, 0])


def test_stock_attention_is_the_control_it_depends_on_the_call():
    """The negative control: transformers' sdpa with masked keys is not computed per row the same way (on this
    machine's kernels at least one row differs); the exact kernel on the same inputs is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(1)
    differs = 0
    for past in (5, KEY_BLOCK + 3, 2 * KEY_BLOCK + 9):
        q = 9
        keys = torch.randn(1, KV_HEADS, past + q, DIM, dtype=torch.bfloat16)
        values = torch.randn(1, KV_HEADS, past + q, DIM, dtype=torch.bfloat16)
        query = torch.randn(1, KV_HEADS * GROUP, q, DIM, dtype=torch.bfloat16)
        mask = torch.zeros(1, 1, q, past + q, dtype=torch.bfloat16)
        mask[..., past:] = torch.triu(torch.full((q, q), torch.finfo(torch.bfloat16).min), 1)
        batched, _ = sdpa_attention_forward(MODULE, query, keys, values, mask, scaling=DIM ** -0.5)
        for r in range(q):
            n = past + r + 1
            alone, _ = sdpa_attention_forward(MODULE, query[:, :, r : r + 1], keys[:, :, :n], values[:, :, :n], None,
                                              scaling=DIM ** -0.5)
            differs += not torch.equal(batched[0, r], alone[0, 0])
    if differs == 0:
        pytest.skip("this machine's sdpa happens to be row-invariant here; the control cannot fail")
    assert differs > 0


class _DecoyTree(Drafter):
    """Drafts the known greedy continuation with a wrong sibling FIRST at every depth (so the right path sits on
    rows 2, 4, 6, ...), plus a wrong guess at the end: every step verifies a tree with a rejected branch."""

    def __init__(self, continuation: list[int], depth: int, vocab: int) -> None:
        self.continuation, self.depth, self.vocab = continuation, depth, vocab

    def propose(self, ctx: DraftContext) -> DraftTree:
        done = ctx.length - ctx.prompt_length
        depth = min(self.depth, ctx.max_depth, max(ctx.remaining_tokens - 1, 0))
        right = self.continuation[done : done + depth]
        tokens, parents, parent = [], [], -1
        for tok in right:
            tokens += [(tok + 7) % self.vocab, tok]
            parents += [parent, parent]
            parent = len(tokens) - 1
        device = ctx.token_ids.device
        if not tokens:
            return DraftTree.empty(device)
        return DraftTree(tokens=torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_answers_are_token_identical_with_exact_attention(dtype):
    model = tiny_model("llama", max_position_embeddings=512).to(dtype)
    config = model.config
    kv, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    if not rows_computed_independently(kv, config.num_attention_heads // kv, dim, str(dtype), "cpu"):
        with pytest.raises(SpecgraftError, match="cannot be bit-exact on this machine"):
            apply_attention_kernel("exact", model)
        assert attention_kernel_of(model) == "stock"
        pytest.skip("this machine's kernels are not row-independent at the tiny model's shape: exact is refused")
    assert apply_attention_kernel("exact", model) == "exact" and attention_kernel_of(model) == "exact"
    for prompt in ([5, 9, 17, 33], list(range(3, 3 + KEY_BLOCK + 5))):
        plain = SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 40)
        drafter = _DecoyTree(plain.generated_ids, 3, model.config.vocab_size)
        spec = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 40)
        assert spec.generated_ids == plain.generated_ids
        assert spec.num_steps < plain.num_steps  # the right branch was accepted: trees were really verified
    model.set_attn_implementation("sdpa")
    assert attention_kernel_of(model) == "stock"


def test_trees_larger_than_the_gemm_row_block_stay_token_identical_in_bf16():
    """A SmolLM2-wide bf16 model verifying 41-row trees: beyond 32 rows oneDNN's bf16 GEMM (AMX) computes rows
    differently from the one-row call, so the exact path splits the linear layers' products."""
    from specgraft.eval.kernels import row_exact_linear_class

    model = tiny_model("llama", max_position_embeddings=512, hidden_size=576, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2).to(torch.bfloat16)
    config = model.config
    if not rows_computed_independently(3, 3, 64, str(torch.bfloat16), "cpu"):
        pytest.skip("this machine's kernels are not row-independent at this attention shape: exact is refused")
    assert apply_attention_kernel("exact", model) == "exact"
    if type(model.lm_head) is not row_exact_linear_class():
        pytest.skip("this machine's bf16 GEMM differs from 2 rows on: the linear layers stay exact by margin only")
    prompt = list(range(3, 3 + KEY_BLOCK + 7))
    plain = SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 60)
    drafter = _DecoyTree(plain.generated_ids, 20, config.vocab_size)  # 40 nodes + the root per full step
    spec = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 60)
    assert max(spec.draft_sizes) == 40
    assert spec.generated_ids == plain.generated_ids
    assert spec.num_steps < plain.num_steps


def test_sliding_window_models_are_refused_in_one_line():
    model = tiny_model("llama", sliding_window=64)
    with pytest.raises(SpecgraftError, match="full-attention models only"):
        apply_attention_kernel("exact", model)
    with pytest.raises(SpecgraftError, match="not one of"):
        apply_attention_kernel("fast", model)


def test_a_batch_or_a_mismatched_layout_is_refused():
    rows = chain_row_keys(4, 2)
    keys = torch.randn(2, KV_HEADS, 6, DIM)
    with pytest.raises(SpecgraftError, match="one sequence at a time"):
        exact_attention_forward(MODULE, torch.randn(2, KV_HEADS * GROUP, 2, DIM), keys, keys, None,
                                **{ROWS_KWARG: rows})
    with pytest.raises(SpecgraftError, match="one sequence at a time"):
        exact_attention_forward(MODULE, torch.randn(1, KV_HEADS * GROUP, 3, DIM), keys[:1], keys[:1], None,
                                **{ROWS_KWARG: rows})


def test_pairwise_sum_is_unchanged_by_trailing_zeros_and_exact_to_rounding():
    from specgraft.eval.exact_attention import pairwise_sum

    torch.manual_seed(0)
    x = torch.randn(3, 11, 5)
    base = pairwise_sum(x, dim=1)
    for extra in (1, 5, 21):
        padded = torch.cat([x, torch.zeros(3, extra, 5)], dim=1)
        assert torch.equal(pairwise_sum(padded, dim=1), base)
    torch.testing.assert_close(base.double(), x.double().sum(1), atol=1e-5, rtol=1e-5)
    assert torch.equal(pairwise_sum(x[:, :1], dim=-2), x[:, 0])


def test_profile_measured_with_another_attention_kernel_warns_naming_both():
    from specgraft.eval.cost import CostProfile, check_profile

    profile = CostProfile(device="cpu", device_name="x", dtype="bfloat16", threads=2, torch_version="2",
                          target={}, kv_length=8, step_s={"chain": {1: 0.1}, "tree": {}}, attention_kernel="exact")
    data = profile.to_dict()
    assert CostProfile.from_dict(data).attention_kernel == "exact"
    del data["attention_kernel"]
    assert CostProfile.from_dict(data).attention_kernel == "stock"  # profiles from before the field
    (message,) = check_profile(profile, None, None, attention_kernel="stock")
    assert "exact attention kernel" in message and "uses stock" in message
    assert check_profile(profile, None, None, attention_kernel="exact") == []


def test_exact_is_refused_in_one_line_where_rows_are_not_independent(monkeypatch):
    """Where the BLAS computes a row differently beside other rows (an AMD EPYC's MKL in fp32), exact attention
    cannot keep its promise: the switch is refused, naming the shape and the fix, and the model is left as it was."""
    import specgraft.eval.exact_attention as exact

    model = tiny_model("llama", max_position_embeddings=512)
    monkeypatch.setattr(exact, "rows_computed_independently", lambda *args: False)
    with pytest.raises(SpecgraftError, match=r"cannot be bit-exact on this machine.*use --attention-kernel stock"):
        exact.apply_attention_kernel("exact", model)
    assert attention_kernel_of(model) == "stock"
    monkeypatch.setattr(exact, "rows_computed_independently", lambda *args: True)
    assert exact.apply_attention_kernel("exact", model) == "exact"


def test_the_probe_sees_a_row_dependent_kernel(monkeypatch):
    """Negative control for the probe: a kernel whose row result depends on the call's row count is caught."""
    import specgraft.eval.exact_attention as exact

    real = exact.exact_attention_forward

    def skewed(module, query, *args, **kwargs):
        out, extra = real(module, query, *args, **kwargs)
        return out * (1 + 0.05 * (query.shape[2] > 1)), extra  # visible in bf16 too

    monkeypatch.setattr(exact, "exact_attention_forward", skewed)
    exact.rows_computed_independently.cache_clear()
    try:
        assert not exact.rows_computed_independently(2, 3, 16, "torch.float32", "cpu")
        assert not exact.rows_computed_independently(2, 3, 16, "torch.bfloat16", "cpu")
    finally:
        monkeypatch.undo()
        exact.rows_computed_independently.cache_clear()
