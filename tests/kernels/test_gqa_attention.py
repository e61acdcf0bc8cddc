"""GQA attention without the KV copy: the same attention as sdpa, the grouping broadcast, lossless through the
decoder, chosen by ``auto`` where it applies."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.tree import DraftTree
from specgraft.kernels.exact_attention import apply_attention_kernel, attention_kernel_of, resolve_attention_kernel
from specgraft.kernels.gqa_attention import gqa_attention_forward
from specgraft.testing import tiny_model

KV_HEADS, GROUP, DIM = 3, 3, 64  # SmolLM2-135M's attention shape


def _inputs(q: int, past: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, KV_HEADS * GROUP, q, DIM, generator=gen)
    key, value = (torch.randn(1, KV_HEADS, past + q, DIM, generator=gen) for _ in range(2))
    return query, key, value


def _tree_mask(q: int, past: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, q, past + q]: the prefix, then a tree where row i sees row 0 (the root), its parent chain and itself."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, q)]
    visible = torch.zeros(q, past + q, dtype=torch.bool)
    visible[:, :past] = True
    for i in range(q):
        j = i
        while j >= 0:
            visible[i, past + j] = True
            j = parents[j]
    if dtype == torch.bool:
        return visible[None, None]
    return torch.zeros(q, past + q).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("past", [0, 7, 200])
def test_masked_multi_row_calls_equal_sdpa_with_copied_kv_heads(mask_dtype, past):
    module = types.SimpleNamespace(num_key_value_groups=GROUP, is_causal=True)
    q = 9
    query, key, value = _inputs(q, past)
    mask = _tree_mask(q, past, mask_dtype)
    ours, _ = gqa_attention_forward(module, query, key, value, mask, scaling=DIM ** -0.5)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=DIM ** -0.5)
    assert ours.shape == stock.shape == (1, q, KV_HEADS * GROUP, DIM)
    torch.testing.assert_close(ours, stock, atol=1e-6, rtol=1e-6)
    # and both are softmax attention over each row's visible keys (float64 reference, KV heads repeated)
    k = key.double().repeat_interleave(GROUP, dim=1)
    v = value.double().repeat_interleave(GROUP, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * DIM ** -0.5
    visible = _tree_mask(q, past, torch.bool)
    ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v  # [1, H, q, d]
    torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_the_kv_heads_are_broadcast_not_copied_and_other_calls_are_sdpa(monkeypatch):
    """The masked multi-row call reaches torch with enable_gqa and the grouped [KVH] keys; a one-row call (plain
    decoding), an unmasked call and a non-grouped module go through transformers' sdpa unchanged."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((key.shape[1], kwargs.get("enable_gqa", False)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    module = types.SimpleNamespace(num_key_value_groups=GROUP, is_causal=True)
    query, key, value = _inputs(5, 20)
    gqa_attention_forward(module, query, key, value, _tree_mask(5, 20, torch.bool))
    assert calls[-1] == (KV_HEADS, True)
    one = gqa_attention_forward(module, query[:, :, :1], key[:, :, :21], value[:, :, :21], None)[0]
    assert torch.equal(one, sdpa_attention_forward(module, query[:, :, :1], key[:, :, :21], value[:, :, :21],
                                                   None)[0])
    calls.clear()
    plain = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    full_k, full_v = (t.repeat_interleave(GROUP, dim=1) for t in (key, value))
    gqa_attention_forward(plain, query, full_k, full_v, _tree_mask(5, 20, torch.bool))
    assert calls == [(KV_HEADS * GROUP, False)]  # nothing to broadcast: sdpa as transformers calls it


class _DecoyTree(Drafter):
    """The known greedy continuation with a wrong sibling first at every depth: every step verifies a tree whose
    accepted path is not the first rows."""

    def __init__(self, continuation: list[int], depth: int, vocab: int) -> None:
        self.continuation, self.depth, self.vocab = continuation, depth, vocab

    def propose(self, ctx: DraftContext) -> DraftTree:
        done = ctx.length - ctx.prompt_length
        right = self.continuation[done : done + min(self.depth, ctx.max_depth)]
        tokens, parents, parent = [], [], -1
        for tok in right:
            tokens += [(tok + 7) % self.vocab, tok]
            parents += [parent, parent]
            parent = len(tokens) - 1
        if not tokens:
            return DraftTree.empty(ctx.token_ids.device)
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


def test_speculative_answers_equal_plain_decoding_with_the_gqa_kernel():
    model = tiny_model("llama", max_position_embeddings=512)
    reference = SpeculativeDecoder(model, ignore_eos=True).generate(list(range(3, 40)), 48)  # stock sdpa
    assert apply_attention_kernel("gqa", model) == "gqa" and attention_kernel_of(model) == "gqa"
    for prompt in ([5, 9, 17, 33], list(range(3, 40))):
        plain = SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 48)
        drafter = _DecoyTree(plain.generated_ids, 3, model.config.vocab_size)
        spec = SpeculativeDecoder(model, drafter=drafter, ignore_eos=True).generate(prompt, 48)
        assert spec.generated_ids == plain.generated_ids
        assert spec.num_steps < plain.num_steps  # trees were verified and their right branches accepted
    assert plain.generated_ids == reference.generated_ids  # plain decoding is unchanged by the switch


def test_auto_picks_gqa_only_where_kv_heads_are_grouped_on_the_cpu():
    assert resolve_attention_kernel("auto", tiny_model("llama")) == "gqa"  # 4 query heads over 2 KV heads
    assert resolve_attention_kernel("auto", tiny_model("llama", num_key_value_heads=4)) == "stock"
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    assert resolve_attention_kernel("auto", eager) == "stock"  # a model run with eager attention stays so
    model = tiny_model("llama")
    assert apply_attention_kernel("auto", model) == "gqa" == attention_kernel_of(model)
    assert apply_attention_kernel("stock", tiny_model("llama")) == "stock"


def test_a_soft_capped_model_is_refused_in_one_line_and_auto_keeps_it_stock():
    """Gemma-2 caps its attention logits, which sdpa cannot: gqa would raise on the first forward, so the switch is
    refused before anything changes, and auto leaves such a model on its own attention."""
    from specgraft.errors import SpecgraftError

    model = tiny_model("gemma2")
    assert model.config.attn_logit_softcapping
    model.config._attn_implementation = "sdpa"  # as if sdpa had capping: auto must still not pick gqa
    with pytest.raises(SpecgraftError, match=r"soft-capping.*use --attention-kernel stock"):
        apply_attention_kernel("gqa", model)
    assert attention_kernel_of(model) == "stock"
    assert resolve_attention_kernel("auto", model) == "stock"
    model.config._attn_implementation = "eager"
    prompt = [5, 9, 17]
    assert SpeculativeDecoder(model, ignore_eos=True).generate(prompt, 5).num_new_tokens == 5  # still decodes
