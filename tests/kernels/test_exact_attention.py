"""Row-exact attention: a verification row equals the one-row call plain decoding makes, bit for bit."""

from __future__ import annotations

import types

import pytest
import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree, tree_structure
from specgraft.errors import SpecgraftError
from specgraft.kernels.exact_attention import (
    ROWS_KWARG,
    apply_attention_kernel,
    attention_kernel_of,
    chain_row_keys,
    exact_attention_forward,
    row_keys,
)
from specgraft.testing import tiny_model

KV_HEADS, GROUP, DIM = 2, 3, 16
MODULE = types.SimpleNamespace(num_key_value_groups=GROUP, is_causal=True)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows) -> torch.Tensor:
    out, _ = exact_attention_forward(MODULE, query, keys, values, None, scaling=DIM ** -0.5, **{ROWS_KWARG: rows})
    return out  # [1, q, H, d]


def _plain_step(module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """The attention call of a one-token step of plain decoding with the stock kernel: transformers' sdpa with one
    query row, no mask and the contiguous cache of the positions the row sees: [H, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, query.contiguous(), keys.contiguous(), values.contiguous(), None,
                                    scaling=scaling)
    return out[0, 0]


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of one row over the given keys: [H, d] for query [H, d], keys [KVH, n, d]."""
    k = keys.double().repeat_interleave(GROUP, dim=0)
    v = values.double().repeat_interleave(GROUP, dim=0)
    weights = torch.softmax((query.double().unsqueeze(1) @ k.transpose(1, 2)) * DIM ** -0.5, dim=-1)  # [H, 1, n]
    return (weights @ v).squeeze(1)


# A tree with the accepted path away from the first rows: row r's path is not a contiguous run of cache slots.
TREE_PARENTS = (-1, -1, -1, 1, 1, 4, 2, 5, 7)


def _own_slots(structure, past: int, row: int) -> torch.Tensor:
    """What plain decoding holds when it reaches verification row ``row``: the prefix, then the row's path."""
    path = structure.row_paths()[row, : int(structure.row_depths()[row]) + 1]
    return torch.cat([torch.arange(past), past + path])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [0, 1, 5, 13, 30, 509, 600])
def test_every_tree_row_is_plain_decodings_own_stock_call(dtype, past):
    """By construction, not by probe: each row's output is bit for bit the stock one-row sdpa call on its own keys,
    at cache lengths on both sides of the flash kernel's 512-key block, in both dtypes, with no skip."""
    torch.manual_seed(past)
    structure = tree_structure(TREE_PARENTS)
    q = structure.size + 1
    keys = torch.randn(1, KV_HEADS, past + q, DIM).to(dtype)
    values = torch.randn(1, KV_HEADS, past + q, DIM).to(dtype)
    query = torch.randn(1, KV_HEADS * GROUP, q, DIM).to(dtype)
    out = _attend(query, keys, values, row_keys(past, structure))
    for r in range(q):
        slots = _own_slots(structure, past, r)
        own_k, own_v = keys[:, :, slots], values[:, :, slots]
        ref = _reference(query[0, :, r], own_k[0], own_v[0])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[0, r].double(), ref, atol=tol, rtol=tol)
        alone = _plain_step(MODULE, query[:, :, r : r + 1], own_k, own_v, DIM ** -0.5)
        assert torch.equal(out[0, r], alone), f"row {r} differs from plain decoding's call"


@pytest.mark.parametrize("past", [200, 613])
def test_rows_equal_plain_steps_at_a_real_model_shape(past):
    """SmolLM2's attention shape (9 query heads over 3 KV heads of 64) in bf16, a tree and a 12-row chain."""
    torch.manual_seed(past)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for structure in (tree_structure(TREE_PARENTS), tree_structure(tuple(range(-1, 11)))):
        q = structure.size + 1
        keys, values = (torch.randn(1, 3, past + q, 64).bfloat16() for _ in range(2))
        query = torch.randn(1, 9, q, 64).bfloat16()
        out, _ = exact_attention_forward(module, query, keys, values, None, scaling=0.125,
                                         **{ROWS_KWARG: row_keys(past, structure)})
        for r in range(q):
            slots = _own_slots(structure, past, r)
            alone = _plain_step(module, query[:, :, r : r + 1], keys[:, :, slots], values[:, :, slots], 0.125)
            assert torch.equal(out[0, r], alone), f"row {r} differs from plain decoding's call"


def test_a_chain_layout_is_causal_and_matches_row_by_row_decoding():
    torch.manual_seed(0)
    past, q = 23, 12
    keys, values = torch.randn(1, KV_HEADS, past + q, DIM), torch.randn(1, KV_HEADS, past + q, DIM)
    query = torch.randn(1, KV_HEADS * GROUP, q, DIM)
    out = _attend(query, keys, values, chain_row_keys(past, q))
    for r in range(q):
        n = past + r + 1
        torch.testing.assert_close(out[0, r].double(), _reference(query[0, :, r], keys[0, :, :n], values[0, :, :n]),
                                   atol=1e-5, rtol=1e-5)  # causal: row r sees exactly the first n keys
        assert torch.equal(out[0, r], _plain_step(MODULE, query[:, :, r : r + 1], keys[:, :, :n], values[:, :, :n],
                                                  DIM ** -0.5))


def test_stock_attention_is_the_control_it_depends_on_the_call():
    """The negative control: transformers' sdpa with masked keys is not computed per row the same way (on this
    machine's kernels at least one row differs); the exact kernel on the same inputs is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(1)
    differs = 0
    for past in (5, 19, 41):
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
    """Token-identical to plain decoding with the STOCK kernels, in fp32 too (where MKL's products regroup a row's
    sum from 2 rows on, every verified row is then its own product)."""
    model = tiny_model("llama", max_position_embeddings=512).to(dtype)
    prompts = ([5, 9, 17, 33], list(range(3, 24)))
    plain = [SpeculativeDecoder(model, ignore_eos=True).generate(p, 40).generated_ids for p in prompts]
    assert apply_attention_kernel("exact", model) == "exact" and attention_kernel_of(model) == "exact"
    for prompt, stock_plain in zip(prompts, plain):
        assert SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 40).generated_ids == stock_plain
        drafter = _DecoyTree(stock_plain, 3, model.config.vocab_size)
        spec = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 40)
        assert spec.generated_ids == stock_plain
        assert spec.num_steps < 40  # the right branch was accepted: trees were really verified
    model.set_attn_implementation("sdpa")
    assert attention_kernel_of(model) == "stock"


def test_trees_larger_than_the_gemm_row_block_stay_token_identical_in_bf16():
    """A SmolLM2-wide bf16 model verifying 41-row trees: beyond 32 rows oneDNN's bf16 GEMM (AMX) computes rows
    differently from the one-row call, so the exact path splits the linear layers' products."""
    model = tiny_model("llama", max_position_embeddings=512, hidden_size=576, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2).to(torch.bfloat16)
    prompt = list(range(3, 26))
    plain = SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 60)  # stock kernels
    assert apply_attention_kernel("exact", model) == "exact"
    drafter = _DecoyTree(plain.generated_ids, 20, model.config.vocab_size)  # 40 nodes + the root per full step
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


def test_profile_measured_with_another_attention_kernel_warns_naming_both():
    from specgraft.tuning.cost import CostProfile, check_profile

    profile = CostProfile(device="cpu", device_name="x", dtype="bfloat16", threads=2, torch_version="2",
                          target={}, kv_length=8, step_s={"chain": {1: 0.1}, "tree": {}}, attention_kernel="exact")
    data = profile.to_dict()
    assert CostProfile.from_dict(data).attention_kernel == "exact"
    del data["attention_kernel"]
    assert CostProfile.from_dict(data).attention_kernel == "stock"  # profiles from before the field
    (message,) = check_profile(profile, None, None, attention_kernel="stock")
    assert "exact attention kernel" in message and "uses stock" in message
    assert check_profile(profile, None, None, attention_kernel="exact") == []


def test_exact_is_refused_in_one_line_where_the_attention_check_fails(monkeypatch):
    """A torch build whose attention kernel computed a row differently in a batch than alone: refused, naming the
    shape and the fix, and the model is left as it was."""
    import specgraft.kernels.exact_attention as exact

    model = tiny_model("llama", max_position_embeddings=512).to(torch.bfloat16)
    monkeypatch.setattr(exact, "rows_match_one_row_calls", lambda *args: False)
    with pytest.raises(SpecgraftError, match=r"cannot be bit-exact with this torch build.*kernel stock"):
        exact.apply_attention_kernel("exact", model)
    assert attention_kernel_of(model) == "stock"


def test_exact_stays_exact_where_the_linear_products_are_not_row_exact(monkeypatch, caplog):
    """Where the GEMM regroups a row's sum from 2 rows on (MKL in fp32, some bf16 shapes on an AMD EPYC), every
    verified row is its own product: still token-identical, with a warning that names the cost and the fast kernel."""
    import specgraft.kernels.linear as kernels

    model = tiny_model("llama", max_position_embeddings=512).to(torch.bfloat16)
    prompt = [5, 9, 17, 33]
    plain = SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 30).generated_ids
    monkeypatch.setattr(kernels, "row_exact_chunk", lambda *args: 1)
    with caplog.at_level("WARNING"):
        assert apply_attention_kernel("exact", model) == "exact"
    assert "one row per product" in caplog.text and "--attention-kernel stock" in caplog.text
    assert {layer.row_chunk for layer in model.modules() if isinstance(layer, torch.nn.Linear)} == {1}
    spec = SpeculativeDecoder(model, drafter=_DecoyTree(plain, 3, model.config.vocab_size), ignore_eos=True)
    assert spec.generate(prompt, 30).generated_ids == plain


def test_the_check_sees_a_row_dependent_kernel(monkeypatch):
    """Negative control for the construction check: a kernel whose row result depends on the call's row count."""
    import specgraft.kernels.exact_attention as exact

    real = exact.exact_attention_forward

    def skewed(module, query, *args, **kwargs):
        out, extra = real(module, query, *args, **kwargs)
        return out * (1 + 0.05 * (query.shape[2] > 1)), extra  # visible in bf16 too

    monkeypatch.setattr(exact, "exact_attention_forward", skewed)
    exact.rows_match_one_row_calls.cache_clear()
    try:
        assert not exact.rows_match_one_row_calls(2, 3, 16, "float32", "cpu")
        assert not exact.rows_match_one_row_calls(2, 3, 16, "torch.bfloat16", "cpu")
    finally:
        monkeypatch.undo()
        exact.rows_match_one_row_calls.cache_clear()
    assert exact.rows_match_one_row_calls(2, 3, 16, "bfloat16", "cpu")  # the real kernel passes


@torch.no_grad()
def test_activations_and_rotary_tables_compute_a_verification_row_by_row_and_nothing_else():
    """Their vectorised transcendental functions round a row's tail elements differently alone than inside a
    bigger call; inside a verification each row is its own call, outside (prefill, drafting) the module is as
    before, and the switch keeps the module's identity and state."""
    from specgraft.kernels.exact_attention import rows_one_at_a_time, use_row_by_row_elementwise

    model = tiny_model("llama", max_position_embeddings=512, intermediate_size=172).to(torch.bfloat16)
    act, rotary = model.model.layers[0].mlp.act_fn, model.model.rotary_emb
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 9, 172).to(torch.bfloat16)
    positions = torch.arange(200, 209).unsqueeze(0)
    stock_act, stock_rotary = act(x), rotary(x, positions)
    switched = use_row_by_row_elementwise(model)
    assert switched == model.config.num_hidden_layers + 1 and model.model.layers[0].mlp.act_fn is act
    assert use_row_by_row_elementwise(model) == switched  # idempotent
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(act(x), stock_act)  # outside a verification: the stock call
    assert all(torch.equal(a, b) for a, b in zip(rotary(x, positions), stock_rotary))
    with rows_one_at_a_time(model):
        rowwise, (cos, sin) = act(x), rotary(x, positions)
    for r in range(9):
        assert torch.equal(rowwise[:, r : r + 1], act(x[:, r : r + 1]))
        one_cos, one_sin = rotary(x, positions[:, r : r + 1])
        assert torch.equal(cos[:, r : r + 1], one_cos) and torch.equal(sin[:, r : r + 1], one_sin)
    torch.testing.assert_close(rowwise.float(), stock_act.float(), atol=1e-2, rtol=1e-2)
