"""DFlash head: the training path equals the reference loss, blocks are isolated, training learns, save/load,
bad input."""

from __future__ import annotations

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.heads import load_head
from specgraft.heads.dflash.config import DFlashConfig, resolve_dflash_config
from specgraft.heads.dflash.losses import block_label_mask, dflash_loss, dflash_position_weights
from specgraft.heads.dflash.model import DFlashHead
from specgraft.target import Target
from specgraft.testing import tiny_model, tiny_tokenizer

from .helpers import make_head


def make_batch(seq_len: int = 14, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 300, (batch, seq_len), generator=g)
    attention = torch.ones_like(ids)
    attention[-1, -3:] = 0
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask * attention}


@pytest.fixture
def llama_target() -> Target:
    return Target(tiny_model("llama"), tiny_tokenizer())


def reference_loss(head: DFlashHead, batch: dict[str, torch.Tensor], out, seed: int,
                   draft_logits: bool = True) -> torch.Tensor:
    """dflash_loss on full [B, A, bs, V] logits for the anchors ``torch.manual_seed(seed)`` draws: the draft's
    (default) or the target's own (the loss floor: the target distributions' weighted entropy)."""
    bs = head.config.block_size
    torch.manual_seed(seed)
    hidden, anchors, valid, labels = head.training_blocks(batch, out)
    with torch.no_grad():
        rows = anchors[..., None] + torch.arange(bs) - 1  # slot k of anchor a: the target's prediction at a + k - 1
        target_logits = torch.stack([out.logits[b, rows[b].clamp(min=0)] for b in range(len(rows))])
        columns = head.draft_token_ids()
        if columns is not None:
            target_logits = target_logits[..., columns]
        logits = head.block_logits(hidden) if draft_logits else target_logits
        return dflash_loss(logits, torch.softmax(target_logits, -1), block_label_mask(labels, anchors, valid, bs),
                           dflash_position_weights(bs, head.config.decay_gamma))


@pytest.mark.parametrize("draft_vocab_size", [0, 150])
def test_training_loss_equals_the_reference_on_full_logits(tiny_arch, draft_vocab_size):
    target = Target(tiny_model(tiny_arch), tiny_tokenizer())
    head = make_head(target, block_size=4, max_anchors=5, draft_vocab_size=draft_vocab_size)
    if draft_vocab_size:
        head.prepare_from_data(torch.randint(0, 50, (target.vocab_size,), generator=torch.Generator().manual_seed(0)))
    batch = make_batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers())
    torch.manual_seed(7)
    result = head.training_loss(batch, out)
    assert result.metrics["anchors"].item() == 10  # 5 per row: both rows have more valid positions
    assert result.loss.item() == pytest.approx(reference_loss(head, batch, out, seed=7).item(), rel=1e-5)


def test_block_split_attention_equals_the_dense_block_mask_with_its_gradients(tiny_arch, monkeypatch):
    """Training attention on the CPU scores each query against the context its mask opens and its own block's slots
    only (_BlockKeysAttention: context through the fused kernel, joined with the in-block scores by log-sum-exp);
    the dense path (every block's keys, the others masked: other devices) gives the same loss and the same gradient
    for every parameter, on a padded batch."""
    from specgraft.heads.dflash import model as dflash_model

    target = Target(tiny_model(tiny_arch), tiny_tokenizer())
    head = make_head(target, block_size=4, max_anchors=6).train()
    batch = make_batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers())
    results, calls = {}, []
    apply = dflash_model._BlockKeysAttention.apply
    monkeypatch.setattr(dflash_model._BlockKeysAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    for path in ("split", "dense"):
        if path == "dense":
            # the split path ran (not for soft-capped attention scores, Gemma-2's, which keep the dense path)
            assert bool(calls) != bool(getattr(head.draft_config, "attn_logit_softcapping", None))
            calls.clear()
            monkeypatch.setattr(dflash_model, "cpu_flash_with_lse", lambda *_: False)
        head.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        loss = head.training_loss(dict(batch), out).loss
        loss.backward()
        results[path] = (loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    assert not calls  # the dense path ran
    (split, split_grads), (dense, dense_grads) = results["split"], results["dense"]
    torch.testing.assert_close(split, dense, rtol=1e-5, atol=1e-6)
    assert split_grads.keys() == dense_grads.keys() and len(split_grads) > 4
    for name, grad in split_grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_each_block_sees_only_its_context_prefix_and_itself(llama_target):
    """The batched training forward of several blocks == each block run alone on the context before its anchor."""
    head = make_head(llama_target, block_size=3, max_anchors=4).eval()
    batch = make_batch(batch=2)
    batch = {k: v[:1] for k, v in batch.items()}  # the unpadded row
    out = llama_target(batch["input_ids"], layers=head.required_layers())
    with torch.no_grad():
        torch.manual_seed(3)
        hidden, anchors, valid, _ = head.training_blocks(batch, out)
        context = head.context_features(out.hidden_states)  # [1, T, h]
        assert valid.all() and anchors.shape[1] == 4
        for j, a in enumerate(anchors[0].tolist()):
            slots = torch.full((1, 3), head.config.mask_token_id)
            slots[0, 0] = batch["input_ids"][0, a]
            alone = head.block_forward(head.embed(slots), context[:, :a], torch.arange(a + 3)[None], None)
            torch.testing.assert_close(hidden[0, j], alone[0], rtol=1e-4, atol=1e-5)


def test_training_lowers_the_loss(llama_target):
    head = make_head(llama_target, block_size=4, max_anchors=64)  # every valid anchor, every step
    batch = make_batch(seq_len=24, batch=2)
    out = llama_target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers())
    floor = reference_loss(head, batch, out, seed=0, draft_logits=False).item()
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        torch.manual_seed(step)
        loss = head.training_loss(batch, out).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # The excess over the floor (a weighted KL to the target) must shrink by more than half.
    assert losses[-1] - floor < 0.5 * (losses[0] - floor)


def test_weights_borrow_the_target_vocab_or_own_a_reduced_one(llama_target):
    full = make_head(llama_target)
    names = set(full.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"} <= names
    assert not {n for n in names if n.startswith(("lm_head", "embed")) or n in ("d2t", "t2d")}
    assert full.lm_head is None and full.draft_token_ids() is None
    reduced = make_head(llama_target, draft_vocab_size=100)
    assert {"lm_head.weight", "d2t", "t2d"} <= set(reduced.state_dict())
    assert reduced.lm_head.weight.shape == (100, llama_target.hidden_size)
    # The target's own modules are never parameters of the head.
    assert all(p.requires_grad for p in full.parameters())


@pytest.mark.parametrize("draft_vocab_size", [0, 100])
def test_block_logits_go_through_the_projection_module(llama_target, draft_vocab_size):
    """Decoding's block logits call the vocabulary projection as a module (its own lm_head, or the target's), so a
    decoder's linear-kernel switch reaches it, and equal the plain ``norm(h) @ W^T``."""
    head = make_head(llama_target, draft_vocab_size=draft_vocab_size).eval()
    module = head.lm_head if draft_vocab_size else llama_target.output_head
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    hidden = torch.randn(3, llama_target.hidden_size)
    with torch.no_grad():
        logits = head.block_logits(hidden)
    handle.remove()
    assert calls == [1]
    torch.testing.assert_close(logits, head.norm(hidden) @ module.weight.T)


def test_save_and_load_round_trip(tmp_path, llama_target):
    head = make_head(llama_target, block_size=5, num_layers=2, draft_vocab_size=120).eval()
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(llama_target, tmp_path / "h").eval()
    assert isinstance(loaded, DFlashHead) and loaded.config == head.config
    x = torch.randn(1, 5, llama_target.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.block_logits(x), head.block_logits(x), rtol=0, atol=0)


def test_mask_token_defaults(llama_target):
    # The tiny tokenizer has 262 ids for 320 embedding rows: the first unused row.
    assert resolve_dflash_config(llama_target).mask_token_id == 262
    assert resolve_dflash_config(llama_target).aux_layer_ids == list(llama_target.default_eagle3_layers())
    no_tok = Target(tiny_model("llama"))
    with pytest.raises(SpecgraftError, match="set head.mask_token_id"):
        resolve_dflash_config(no_tok)
    assert resolve_dflash_config(no_tok, mask_token_id=3).mask_token_id == 3
    full_tok = Target(tiny_model("llama", vocab_size=262), tiny_tokenizer())
    assert resolve_dflash_config(full_tok).mask_token_id == 3  # <unk>


@pytest.mark.parametrize(("fields", "message"), [
    ({"block_size": 1}, "block_size must be an integer >= 2"),
    ({"block_size": 600}, "larger than the target's context"),
    ({"mask_token_id": 320}, "outside the target vocabulary"),
    ({"aux_layer_ids": [1, 9]}, r"aux_layer_ids index \[9\] out of range"),
    ({"aux_layer_ids": []}, "aux_layer_ids is empty"),
    ({"sample_from_anchor": True}, "sample_from_anchor=True"),
    ({"draft_vocab_size": 400}, "draft"),
    ({"decay_gamma": 0.0}, "decay_gamma must be > 0"),
    ({"colour": 1}, "unknown dflash fields"),
    ({"draft_layers": "mamba"}, "draft_layers must be one of"),
])
def test_bad_input_is_one_line(llama_target, fields, message):
    with pytest.raises(SpecgraftError, match=message) as info:
        resolve_dflash_config(llama_target, **fields)
    assert "\n" not in str(info.value)


def test_an_invalid_saved_config_is_refused_on_build(llama_target):
    with pytest.raises(SpecgraftError, match="block_size"):
        DFlashHead(DFlashConfig(block_size=0, aux_layer_ids=[1], mask_token_id=5), llama_target)


def test_config_from_a_recipe_head_section(llama_target):
    from types import SimpleNamespace

    section = SimpleNamespace(type="dflash", block_size=6, num_layers=2, feature_layers=[1, 2], mask_token_id=None,
                              draft_vocab_size=None, decay_gamma=None, max_anchors=64)
    cfg = DFlashHead.config_from_recipe(section, llama_target)
    assert cfg == DFlashConfig(block_size=6, num_layers=2, aux_layer_ids=[1, 2], mask_token_id=262, max_anchors=64)


def test_block_keys_attention_equals_the_joint_softmax_with_an_empty_context_row():
    """_BlockKeysAttention against the written-out joint softmax (context scores under the mask ++ own-block scores):
    grouped-query heads (4 on 2), a query row whose context is entirely masked (an anchor at position 0) and the
    transposed layout transformers hands over; outputs and the gradients of q and of both key/value groups."""
    from specgraft.heads.dflash.losses import additive_mask, own_block_mask
    from specgraft.heads.dflash.model import _BlockKeysAttention

    batch, heads, kv_heads, context, blocks, bs, dim = 2, 4, 2, 6, 3, 4, 8
    queries = blocks * bs
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(batch, queries, heads, dim, generator=gen).transpose(1, 2).requires_grad_()
    k, v, kb, vb = (torch.randn(batch, n, kv_heads, dim, generator=gen).transpose(1, 2).requires_grad_()
                    for n in (context, context, queries, queries))
    visible = torch.rand(batch, queries, context, generator=gen) > 0.4
    visible[0, :bs] = False  # block 0 of row 0 sees no context at all
    mask = additive_mask(visible, torch.float32)  # [B, 1, Q, T]
    out = _BlockKeysAttention.apply(q.contiguous(), k, v, mask, kb, vb, bs, dim ** -0.5)

    dense_mask = torch.cat([mask, additive_mask(own_block_mask(blocks, bs)[None], torch.float32).expand(
        batch, -1, -1, -1)], dim=-1)  # [B, 1, Q, T + Q]
    keys = torch.cat([k, kb], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    values = torch.cat([v, vb], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    reference = torch.softmax(q @ keys.transpose(-1, -2) * dim ** -0.5 + dense_mask, dim=-1) @ values
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    weights = torch.randn(out.shape, generator=gen)
    leaves = [q, k, v, kb, vb]
    got = torch.autograd.grad((out * weights).sum(), leaves)
    want = torch.autograd.grad((reference * weights).sum(), leaves)
    for name, g, w in zip(("q", "k", "v", "block k", "block v"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)
