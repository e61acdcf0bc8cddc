"""Medusa heads: construction from the target, parameter layout, the loss against a per-position reference."""

from __future__ import annotations

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.heads.base import head_class
from specgraft.heads.losses import topk_accuracy
from specgraft.heads.medusa.model import MedusaConfig, MedusaHead, _CrossEntropySum, medusa_loss, medusa_num_parameters
from specgraft.target import Target
from specgraft.testing import tiny_model


def make_head(target: Target, **overrides) -> MedusaHead:
    cfg = MedusaHead.Config(**{"num_heads": 3, "num_layers": 2, **overrides})
    return MedusaHead.build(target, cfg.resolve(target))


def batch_for(ids: torch.Tensor, loss_mask: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids) if attention_mask is None else attention_mask}
    batch["loss_mask"] = torch.ones_like(ids) if loss_mask is None else loss_mask
    return batch


def reference_medusa_loss(logits, ids, loss_mask, attention_mask, decay):
    """Per-position python loop: the definition the vectorised loss must match."""
    num_heads, batch, length, _ = logits.shape
    total, per_head = 0.0, []
    for k in range(num_heads):
        ces = []
        for b in range(batch):
            for t in range(length):
                j = t + k + 2
                if j >= length or not attention_mask[b, t] or not attention_mask[b, j] or not loss_mask[b, j]:
                    continue
                ces.append(-torch.log_softmax(logits[k, b, t].double(), -1)[ids[b, j]])
        ce = torch.stack(ces).mean() if ces else torch.zeros((), dtype=torch.float64)
        per_head.append(ce)
        total = total + decay ** k * ce
    return total, per_head


# ----------------------------------------------------------------------------------------------------------------
# construction


def test_registered_and_configured_from_recipe():
    target = Target(tiny_model("llama"))
    assert head_class("medusa") is MedusaHead
    cfg = MedusaHead.Config(num_heads=4, num_layers=2, loss_decay=0.5).resolve(target)
    assert (cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.loss_decay) == (4, 2, 64, 320, 0.5)
    head = MedusaHead.build(target, cfg)
    assert head.required_layers() == (4,)
    assert MedusaHead.needs_target_logits is False


@pytest.mark.parametrize("field,value", [("num_heads", 0), ("num_heads", -1), ("num_layers", 0),
                                         ("num_layers", -2), ("loss_decay", 0.0)])
def test_invalid_sizes_raise(field, value):
    target = Target(tiny_model("llama"))
    with pytest.raises(SpecgraftError, match=field):
        MedusaHead.Config(**{field: value}).resolve(target)  # validate() never ran on it
    with pytest.raises(SpecgraftError, match=field):
        MedusaHead(MedusaConfig(**{"hidden_size": 64, "vocab_size": 320, field: value}), target)


def test_config_sizes_must_match_target():
    target = Target(tiny_model("llama"))
    with pytest.raises(SpecgraftError, match="hidden_size 32"):
        MedusaHead(MedusaConfig(hidden_size=32, vocab_size=320), target)


@pytest.mark.parametrize("share", [False, True])
def test_parameter_names_are_vllm_names(share):
    target = Target(tiny_model("llama"))
    head = make_head(target, num_heads=3, num_layers=2, share_lm_head=share)
    expected = {f"blocks.{h}.layers.{i}.{p}" for h in range(3) for i in range(2) for p in ("weight", "bias")}
    if not share:
        expected |= {f"lm_heads.{h}.weight" for h in range(3)}
    assert set(head.state_dict()) == expected
    assert {name for name, _ in head.named_parameters()} == expected
    assert sum(p.numel() for p in head.parameters()) == medusa_num_parameters(64, 320, 3, 2, share)
    for h in range(3):
        for i in range(2):
            assert head.state_dict()[f"blocks.{h}.layers.{i}.weight"].shape == (64, 64)


def test_no_two_parameters_share_storage():
    """The reference repo's ``[ResBlock] * n`` bug made all layers one module; ours are independent."""
    target = Target(tiny_model("llama"))
    head = make_head(target, num_heads=3, num_layers=3)
    params = list(head.parameters())
    assert len(params) == 3 * 3 * 2 + 3
    pointers = [p.untyped_storage().data_ptr() for p in params]
    assert len(set(pointers)) == len(pointers)
    assert target.output_head.weight.untyped_storage().data_ptr() not in pointers
    # Independence in behaviour too: a step on one layer leaves the others alone.
    with torch.no_grad():
        head.blocks[0].layers[0].weight.add_(1.0)
    assert float(head.blocks[0].layers[1].weight.detach().abs().sum()) == 0.0
    assert float(head.blocks[1].layers[0].weight.detach().abs().sum()) == 0.0


def test_blocks_are_zero_init_and_lm_heads_copy_target():
    target = Target(tiny_model("llama"))
    head = make_head(target)
    for block in head.blocks:
        for layer in block.layers:
            assert float(layer.weight.detach().abs().sum()) == 0.0 and float(layer.bias.detach().abs().sum()) == 0.0
    for lm in head.lm_heads:
        torch.testing.assert_close(lm.weight, target.output_head.weight, rtol=0, atol=0)
        assert lm.weight.requires_grad


@pytest.mark.parametrize("share", [False, True])
def test_fresh_heads_reproduce_target_logits(tiny_arch, share):
    """Identity blocks + the target's lm_head (and Gemma soft-capping): every head equals the target at init."""
    target = Target(tiny_model(tiny_arch))
    head = make_head(target, share_lm_head=share)
    ids = torch.randint(3, 300, (2, 9))
    out = target.forward(ids, layers=head.required_layers())
    logits = head(out.hidden_states[target.num_layers])  # [K, B, T, V]
    assert logits.shape == (3, 2, 9, 320)
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# the loss


def test_medusa_loss_matches_per_position_loop():
    torch.manual_seed(0)
    num_heads, batch, length, vocab = 3, 3, 11, 17
    logits = torch.randn(num_heads, batch, length, vocab)
    ids = torch.randint(0, vocab, (batch, length))
    loss_mask = (torch.rand(batch, length) > 0.3).long()
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, 8:] = 0  # right padding
    attention_mask[2, :3] = 0  # left padding
    loss, per_head = medusa_loss(logits, ids, loss_mask, 0.8, attention_mask)
    ref_loss, ref_heads = reference_medusa_loss(logits, ids, loss_mask, attention_mask, 0.8)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(per_head, ref_heads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # A list of per-head tensors is accepted too.
    torch.testing.assert_close(medusa_loss(list(logits), ids, loss_mask, 0.8, attention_mask)[0], loss)


def test_medusa_loss_counts_label_positions_only():
    """The mask that matters is the LABEL's: a non-assistant token at t still trains head k on t + k + 2."""
    logits = torch.zeros(1, 1, 6, 4, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 3, 0, 1]])
    loss_mask = torch.tensor([[0, 0, 0, 0, 1, 0]])  # only position 4 is a label
    loss, (ce,) = medusa_loss(logits, ids, loss_mask, 0.8)
    loss.backward()
    grad_rows = logits.grad[0, 0].abs().sum(-1)
    assert grad_rows.nonzero().flatten().tolist() == [2]  # head 0 at t=2 predicts position 4
    torch.testing.assert_close(ce, torch.log(torch.tensor(4.0)))


def test_medusa_loss_short_sequences_and_empty_masks():
    logits = torch.randn(3, 2, 3, 5, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))
    loss, per_head = medusa_loss(logits, ids, torch.ones_like(ids), 0.8)
    # Only head 0 has a pair (t=0 -> 2); heads 1, 2 contribute 0, no NaN.
    assert per_head[1].item() == 0.0 and per_head[2].item() == 0.0 and torch.isfinite(loss).item()
    loss, _ = medusa_loss(logits, ids, torch.zeros_like(ids), 0.8)
    assert loss.item() == 0.0
    loss.backward()  # the graph survives an empty mask
    assert float(logits.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("rows", [0, 1, 37])
def test_fused_cross_entropy_matches_torch(rows):
    torch.manual_seed(rows)
    logits = (torch.randn(rows, 23) * 4).requires_grad_()
    labels = torch.randint(0, 23, (rows,))
    ours = _CrossEntropySum.apply(logits, labels)
    (grad_ours,) = torch.autograd.grad(ours * 0.7, logits)
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    (grad_ref,) = torch.autograd.grad(ref * 0.7, logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [None, 4])  # llama's chunked loss: one chunk, and 4 rows per chunk
def test_training_loss_matches_reference_loss_and_gradients(arch, share, rows_per_chunk, monkeypatch):
    import specgraft.heads.losses as losses

    if rows_per_chunk is not None:
        monkeypatch.setattr(losses, "LOGITS_CHUNK_ELEMENTS", rows_per_chunk * tiny_model(arch).config.vocab_size)
    torch.manual_seed(1)
    target = Target(tiny_model(arch))
    head = make_head(target, share_lm_head=share)
    with torch.no_grad():  # move away from the identity init so the blocks matter
        for p in head.blocks.parameters():
            p.normal_(0, 0.05)
    ids = torch.randint(3, 300, (3, 12))
    loss_mask = (torch.rand(3, 12) > 0.4).long()
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    attention_mask[0, 9:] = 0
    batch = batch_for(ids, loss_mask, attention_mask)
    out = target.forward(ids, attention_mask, layers=head.required_layers(), logits=False)

    result = head.training_loss(batch, out)
    result.loss.backward()
    fast_grads = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()

    logits = head(out.hidden_states[target.num_layers])
    ref_loss, ref_heads = medusa_loss(logits, ids, loss_mask, head.config.loss_decay, attention_mask)
    ref_loss.backward()
    torch.testing.assert_close(result.loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in head.named_parameters():
        torch.testing.assert_close(fast_grads[name], p.grad, rtol=1e-4, atol=1e-6)

    # Metrics: 0-dim tensors, equal to the shared accuracy helpers on the same pairs.
    assert set(result.metrics) == {f"{m}/head{k}" for m in ("loss", "top1", "top5") for k in range(3)}
    for k in range(3):
        off = k + 2
        labels = ids[:, off:]
        mask = (loss_mask[:, off:] * attention_mask[:, off:] * attention_mask[:, :-off]).bool()
        head_logits = logits[k, :, :-off].detach()
        for name, kk in (("top1", 1), ("top5", 5)):
            metric = result.metrics[f"{name}/head{k}"]
            assert metric.dim() == 0 and not metric.requires_grad
            torch.testing.assert_close(metric, topk_accuracy(head_logits, labels, mask, k=kk))
        torch.testing.assert_close(result.metrics[f"loss/head{k}"], ref_heads[k].detach())


def test_training_loss_on_every_architecture_leaves_target_without_gradients(tiny_arch):
    target = Target(tiny_model(tiny_arch))
    for share in (False, True):
        head = make_head(target, share_lm_head=share)
        ids = torch.randint(3, 300, (2, 10))
        out = target.forward(ids, layers=head.required_layers(), logits=False)
        result = head.training_loss(batch_for(ids), out)
        assert torch.isfinite(result.loss)
        result.loss.backward()
        assert all(p.grad is None for p in target.model.parameters())
        assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in head.parameters())
        assert not any(p.requires_grad for p in target.model.parameters())


def test_a_few_dozen_steps_learn_a_repeated_sequence():
    """Meaningful behaviour: on a periodic text every head learns its offset (top-1 near 1, loss falls)."""
    torch.manual_seed(0)
    target = Target(tiny_model("llama"))
    head = make_head(target, num_heads=3, num_layers=1)
    pattern = torch.randint(3, 300, (7,))
    ids = pattern.repeat(2, 6)  # [2, 42]
    batch = batch_for(ids)
    out = target.forward(ids, layers=head.required_layers(), logits=False)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = head.training_loss(batch, out)
    for _ in range(40):
        result = head.training_loss(batch, out)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
    final = head.training_loss(batch, out)
    assert final.loss.item() < 0.2 * first.loss.item()
    for k in range(3):
        assert float(final.metrics[f"top1/head{k}"]) > 0.9
        assert float(final.metrics[f"top1/head{k}"]) > float(first.metrics[f"top1/head{k}"])


def test_training_loss_uses_flattened_masked_rows_only(monkeypatch):
    """Only labelled rows reach the vocabulary projection (the speed of head training depends on it)."""
    target = Target(tiny_model("llama"))
    head = make_head(target, num_heads=2, num_layers=1)
    ids = torch.randint(3, 300, (2, 10))
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    seen = []
    for k, block in enumerate(head.blocks):  # every row a head projects first goes through its block
        block.register_forward_pre_hook(lambda _module, args, k=k: seen.append((k, tuple(args[0].shape))))
    out = target.forward(ids, layers=head.required_layers(), logits=False)
    head.training_loss(batch_for(ids, loss_mask), out)
    # head 0: labels at 6..9 -> 4 rows per sequence; head 1: labels at 6..9 from t = 3..6 -> 4 rows.
    assert seen == [(0, (8, 64)), (1, (8, 64))]
