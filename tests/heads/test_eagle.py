"""EAGLE-1/2 head: the target family's own layer, borrowed frozen modules, the shifted loss, save/load."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from specgraft.errors import SpecgraftError
from specgraft.heads import head_class, load_head
from specgraft.heads.eagle.model import EagleConfig, EagleHead, eagle1_loss
from specgraft.heads.layers import causal_additive_mask
from specgraft.target import Target, TargetOutput
from specgraft.testing import tiny_model


def _head(target: Target, **overrides) -> EagleHead:
    cls = head_class("eagle")
    cfg = cls.Config(**overrides).resolve(target)
    torch.manual_seed(1)
    return cls.build(target, cfg)


def _batch(seq_len: int = 12, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 300, (batch, seq_len), generator=g)
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0  # right padding
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0  # a "prompt" that does not count
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask * attention}


def test_loss_matches_direct_reference():
    g = torch.Generator().manual_seed(0)
    pred, nxt = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g) * 2
    draft_logits, target_logits = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.4).float()
    loss, metrics = eagle1_loss(pred, draft_logits, nxt, target_logits, mask, feature_weight=1.0, logit_weight=0.1)
    feat_sum, ce_sum, hits, count = 0.0, 0.0, 0, 0
    for b in range(3):
        for i in range(5):
            if not mask[b, i]:
                continue
            count += 1
            d = (pred[b, i] - nxt[b, i]).tolist()
            feat_sum += sum(0.5 * x * x if abs(x) < 1 else abs(x) - 0.5 for x in d) / len(d)
            p = torch.softmax(target_logits[b, i].double(), -1)
            logq = torch.log_softmax(draft_logits[b, i].double(), -1)
            ce_sum += float(-(p * logq).sum())
            hits += int(draft_logits[b, i].argmax() == target_logits[b, i].argmax())
    assert metrics["loss/feature"].item() == pytest.approx(feat_sum / count, rel=1e-5)
    assert metrics["loss/logit"].item() == pytest.approx(ce_sum / count, rel=1e-5)
    assert loss.item() == pytest.approx(feat_sum / count + 0.1 * ce_sum / count, rel=1e-5)
    assert metrics["top1/step0"].item() == pytest.approx(hits / count)


def test_training_loss_shifts_by_one_position(tiny_llama):
    """Pair i = (f_i, x_{i+1}) predicts f_{i+1} and the target distribution at i+1, scored when x_{i+2} counts."""
    target = Target(tiny_llama)
    head = _head(target, feature_noise=0.0).eval()
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    got = head.training_loss(batch, out)
    feats = out.hidden_states[target.num_layers]
    ids, real, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    rows_pred, rows_next, rows_tl = [], [], []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            n = int(real[b].sum())  # real tokens of row b
            cache = DynamicCache()
            for i in range(n - 1):
                mask = torch.zeros(1, 1, 1, i + 1)
                pred, _ = head.draft_forward(ids[b : b + 1, i + 1 : i + 2], feats[b : b + 1, i : i + 1],
                                             torch.tensor([[i]]), mask, cache)
                if i + 2 < n and labels[b, i + 2]:
                    rows_pred.append(pred[0, 0])
                    rows_next.append(feats[b, i + 1])
                    rows_tl.append(out.logits[b, i + 1])
        pred = torch.stack(rows_pred)
        ref, _ = eagle1_loss(pred, head.logits(pred), torch.stack(rows_next), torch.stack(rows_tl),
                             torch.ones(len(rows_pred)))
    assert got.loss.item() == pytest.approx(ref.item(), rel=1e-4)
    # Offline features only: the target logits are recomputed from the post-norm features (index N).
    offline = head.training_loss(batch, TargetOutput(logits=None, hidden_states=out.hidden_states))
    assert offline.loss.item() == pytest.approx(got.loss.item(), rel=1e-5)


def test_feature_noise_only_in_training(tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, feature_noise=0.5)
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers())
    head.eval()
    assert head.training_loss(batch, out).loss.item() == head.training_loss(batch, out).loss.item()
    head.train()
    assert head.training_loss(batch, out).loss.item() != head.training_loss(batch, out).loss.item()


def test_parameter_names_follow_the_serving_layout(tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, num_layers=2, fc_bias=True)
    names = set(head.state_dict())
    proj = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    expected = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
                "layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight"}
    expected |= {f"layers.{i}.{p}" for i in (0, 1) for p in proj}
    assert names == expected  # no embeddings, final norm or lm_head: borrowed from the target, never saved
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert type(head.layers[0]) is type(target.decoder_layers[0])
    assert head.fc.weight.shape == (target.hidden_size, 2 * target.hidden_size)
    assert head.required_layers() == (target.num_layers,)
    assert type(head).needs_target_logits


def test_every_architecture_trains_without_touching_the_target(tiny_arch):
    target = Target(tiny_model(tiny_arch))
    head = _head(target)
    assert type(head.layers[0]) is type(target.decoder_layers[0])
    batch = _batch(seq_len=10)
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    result = head.training_loss(batch, out)
    assert torch.isfinite(result.loss)
    result.loss.backward()
    assert all(p.grad is None for p in target.model.parameters())
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in head.parameters())


def test_parallel_forward_equals_incremental_decoding(tiny_arch):
    target = Target(tiny_model(tiny_arch))
    head = _head(target, num_layers=2).eval()
    ids = torch.randint(6, 300, (1, 9))
    feats = target(ids, layers=head.required_layers()).hidden_states[target.num_layers]
    length = ids.shape[1] - 1
    with torch.no_grad():
        mask = causal_additive_mask(length, None, torch.float32, ids.device)
        parallel, logits = head.draft_forward(ids[:, 1:], feats[:, :-1], torch.arange(length)[None], mask)
        cache = DynamicCache()
        for i in range(length):
            step, _ = head.draft_forward(ids[:, i + 1 : i + 2], feats[:, i : i + 1], torch.tensor([[i]]),
                                         torch.zeros(1, 1, 1, i + 1), cache)
            torch.testing.assert_close(step[0, 0], parallel[0, i], atol=1e-5, rtol=1e-5)
    assert logits.shape == (1, length, target.vocab_size)


def test_save_load_round_trip(tmp_path, tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, fc_bias=True, num_layers=2, feature_noise=0.2).eval()
    path = head.save_pretrained(tmp_path / "eagle")
    loaded = load_head(target, path).eval()
    assert isinstance(loaded, EagleHead) and loaded.config == head.config
    assert set(load_file(str(path / "head.safetensors"))) == set(head.state_dict())
    ids = torch.randint(6, 300, (1, 7))
    feats = target(ids, layers=head.required_layers()).hidden_states[target.num_layers]
    mask = causal_additive_mask(6, None, torch.float32, ids.device)
    with torch.no_grad():
        a = head.draft_forward(ids[:, 1:], feats[:, :-1], torch.arange(6)[None], mask)
        b = loaded.draft_forward(ids[:, 1:], feats[:, :-1], torch.arange(6)[None], mask)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_config():
    with pytest.raises(SpecgraftError, match="num_layers"):
        EagleConfig(num_layers=0).validate()
    with pytest.raises(SpecgraftError, match="feature_noise"):
        EagleConfig(feature_noise=-1.0).validate()


def test_short_sequences_give_a_zero_loss(tiny_llama):
    target = Target(tiny_llama)
    head = _head(target)
    ids = torch.tensor([[5, 6]])
    out = target(ids, layers=head.required_layers())
    loss = head.training_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, out).loss
    assert loss.item() == 0.0 and not math.isnan(loss.item())
    loss.backward()  # keeps a graph, so a trainer's backward does not fail
