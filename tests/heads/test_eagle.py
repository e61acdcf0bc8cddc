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


@pytest.mark.parametrize("num_items", [None, 40])
def test_chunked_training_loss_equals_the_reference_loss_with_its_gradients(tiny_llama, num_items):
    """The training loss's logit term goes through the chunked linear cross-entropy (the target's plain lm_head):
    its value, metrics and every parameter's gradient equal the reference path (eagle1_loss on full logits); the
    top-1 metric is computed on logged steps only, in both paths."""
    target = Target(tiny_llama)
    batch = _batch()
    head = _head(target, feature_noise=0.0).train()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    items = None if num_items is None else {"step0": torch.tensor(num_items)}
    results = {}
    for path in ("chunked", "reference"):
        assert (head._plain_lm_head() is not None) == (path == "chunked")
        head.zero_grad(set_to_none=True)
        got = head.training_loss(batch, out, items)
        got.loss.backward()
        results[path] = (got, {n: p.grad.clone() for n, p in head.named_parameters()})
        head._plain_lm_head = lambda: None  # the reference path from here on
        head.metrics_enabled = path == "chunked"
    (chunked, chunked_grads), (reference, reference_grads) = results["chunked"], results["reference"]
    torch.testing.assert_close(chunked.loss, reference.loss, rtol=1e-5, atol=1e-7)
    assert chunked.metrics.keys() == reference.metrics.keys() == {"loss/feature", "loss/logit", "top1/step0"}
    for key in chunked.metrics:
        torch.testing.assert_close(chunked.metrics[key], reference.metrics[key], rtol=1e-5, atol=1e-7)
    for name, grad in chunked_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in chunked_grads.values())
    head.metrics_enabled = False  # a step that is not logged: no top-1 in either path
    assert "top1/step0" not in head.training_loss(batch, out, items).metrics  # reference
    del head._plain_lm_head  # the class's method again
    assert head._plain_lm_head() is not None
    assert "top1/step0" not in head.training_loss(batch, out, items).metrics  # chunked


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


# -- HASS: harmonized context alignment (ttt_steps) and objective distillation (hass_topk) ----------------------
def test_loss_with_topk_distillation_matches_direct_reference():
    g = torch.Generator().manual_seed(1)
    pred, nxt = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    draft_logits, target_logits = torch.randn(2, 6, 13, generator=g), torch.randn(2, 6, 13, generator=g) * 2
    mask = (torch.rand(2, 6, generator=g) > 0.3).float()
    plain, _ = eagle1_loss(pred, draft_logits, nxt, target_logits, mask)
    loss, metrics = eagle1_loss(pred, draft_logits, nxt, target_logits, mask, topk=4, topk_weight=0.5)
    topk_sum, count = 0.0, int(mask.sum())
    for b in range(2):
        for i in range(6):
            if mask[b, i]:
                p = torch.softmax(target_logits[b, i].double(), -1)
                logq = torch.log_softmax(draft_logits[b, i].double(), -1)
                top = p.argsort(descending=True)[:4]  # not renormalised over the top-4
                topk_sum += float(-(p[top] * logq[top]).sum())
    assert metrics["loss/topk"].item() == pytest.approx(topk_sum / count, rel=1e-5)
    assert loss.item() == pytest.approx(plain.item() + 0.5 * topk_sum / count, rel=1e-5)


def test_alignment_passes_equal_sequential_drafting(tiny_arch):
    """Pass s at index i (all i in parallel, training-time-test keys) == the drafter's KV-cache decoding s tokens
    after pair i, each step fed its own previous output feature (mirrors EAGLE-3's TTT test)."""
    target = Target(tiny_model(tiny_arch))
    head = _head(target, ttt_steps=3, num_layers=2).eval()
    seq_len = 9
    ids = torch.randint(6, 300, (1, seq_len))
    out = target(ids, layers=head.required_layers())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        parallel = head.align_outputs(batch, out)
        assert len(parallel) == 3 and parallel[0].shape == (1, seq_len - 1, target.hidden_size)
        feats = head.input_features(out.hidden_states)
        for i in range(seq_len - 1):
            cache = DynamicCache()
            mask = causal_additive_mask(i + 1, None, torch.float32, ids.device)
            hidden, _ = head.draft_forward(ids[:, 1 : i + 2], feats[:, : i + 1], torch.arange(i + 1)[None], mask,
                                           cache)
            hidden = hidden[:, -1:]
            torch.testing.assert_close(hidden[0, 0], parallel[0][0, i], atol=1e-5, rtol=1e-5)
            for s in range(1, 3):
                if i + s + 1 >= seq_len:
                    break
                hidden, _ = head.draft_forward(ids[:, i + s + 1 : i + s + 2], hidden, torch.tensor([[i + s]]),
                                               torch.zeros(1, 1, 1, i + 1 + s), cache)
                torch.testing.assert_close(hidden[0, 0], parallel[s][0, i], atol=1e-5, rtol=1e-5)


def test_hass_training_loss_equals_the_loss_on_sequentially_drafted_rows(tiny_llama):
    """ttt_steps 3 + top-K: each pass scored on the features the drafter computes s tokens ahead (padding and
    prompt tokens left out), decayed and summed; the metrics carry each pass's terms."""
    target = Target(tiny_llama)
    steps, decay, topk, topk_weight = 3, 0.7, 5, 0.6
    head = _head(target, feature_noise=0.0, ttt_steps=steps, loss_decay=decay, hass_topk=topk,
                 hass_topk_weight=topk_weight).eval()
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    got = head.training_loss(batch, out)
    feats = out.hidden_states[target.num_layers]
    ids, real, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    rows = {s: ([], [], []) for s in range(steps)}  # pass -> (draft features, next features, target logits)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            n = int(real[b].sum())
            for i in range(n - 1):
                cache = DynamicCache()
                mask = causal_additive_mask(i + 1, None, torch.float32, ids.device)
                hidden, _ = head.draft_forward(ids[b : b + 1, 1 : i + 2], feats[b : b + 1, : i + 1],
                                               torch.arange(i + 1)[None], mask, cache)
                hidden = hidden[:, -1:]
                for s in range(steps):
                    if s:
                        if i + s + 1 >= n:
                            break
                        hidden, _ = head.draft_forward(ids[b : b + 1, i + s + 1 : i + s + 2], hidden,
                                                       torch.tensor([[i + s]]), torch.zeros(1, 1, 1, i + 1 + s), cache)
                    if i + s + 2 < n and labels[b, i + s + 2]:
                        rows[s][0].append(hidden[0, 0])
                        rows[s][1].append(feats[b, i + s + 1])
                        rows[s][2].append(out.logits[b, i + s + 1])
        ref = 0.0
        for s in range(steps):
            pred = torch.stack(rows[s][0])
            loss, metrics = eagle1_loss(pred, head.logits(pred), torch.stack(rows[s][1]), torch.stack(rows[s][2]),
                                        torch.ones(len(rows[s][0])), topk=topk, topk_weight=topk_weight)
            ref += decay**s * loss.item()
            suffix = "" if s == 0 else f"/step{s}"
            for key in ("loss/feature", "loss/logit", "loss/topk"):
                assert got.metrics[key + suffix].item() == pytest.approx(metrics[key].item(), rel=1e-4), (key, s)
            assert got.metrics[f"top1/step{s}"].item() == pytest.approx(metrics["top1/step0"].item())
    assert got.loss.item() == pytest.approx(ref, rel=1e-4)
    assert head.loss_item_counts(batch) == {f"step{s}": len(rows[s][0]) for s in range(steps)}
    # Gradients reach every parameter through all passes; the target stays untouched.
    head.train()
    head.training_loss(batch, out).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    assert all(p.grad is None for p in target.model.parameters())


def test_hass_is_training_only_the_saved_head_is_the_same(tmp_path, tiny_llama):
    """The HASS switches change the loss, not the head: the same weights and tensor names, and the one-pass
    defaults give exactly the plain EAGLE-1 loss."""
    target = Target(tiny_llama)
    plain = _head(target).eval()
    hass = _head(target, ttt_steps=3, hass_topk=10).eval()
    assert plain.state_dict().keys() == hass.state_dict().keys()
    assert all(torch.equal(plain.state_dict()[k], hass.state_dict()[k]) for k in plain.state_dict())
    a = load_file(str(plain.save_pretrained(tmp_path / "plain") / "head.safetensors"))
    b = load_file(str(hass.save_pretrained(tmp_path / "hass") / "head.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_head(target, tmp_path / "hass").config == hass.config
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=plain.required_layers(), logits=True)
    one_pass = _head(target, ttt_steps=1, hass_topk=0).eval()
    assert one_pass.training_loss(batch, out).loss.item() == plain.training_loss(batch, out).loss.item()
    assert hass.training_loss(batch, out).loss.item() != plain.training_loss(batch, out).loss.item()


def test_bad_hass_config(tiny_llama):
    for field, value, match in (("ttt_steps", 0, "ttt_steps"), ("loss_decay", 0.0, "loss_decay"),
                                ("hass_topk", -1, "hass_topk"), ("hass_topk_weight", -0.5, "hass_topk_weight")):
        with pytest.raises(SpecgraftError, match=match):
            EagleConfig(**{field: value}).validate()
    target = Target(tiny_llama)
    with pytest.raises(SpecgraftError, match="at most"):
        EagleConfig(hass_topk=target.vocab_size + 1).resolve(target)


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_recipe_hass_switches_are_checked_with_their_path(head_type):
    from specgraft.config import Recipe, from_dict
    from specgraft.errors import ConfigError

    base = {"model": {"name_or_path": "org/model"}, "data": {"path": "data.jsonl"}, "output": {"dir": "out"}}
    recipe = from_dict(Recipe, {**base, "head": {"type": head_type, "hass_topk": 10, "ttt_steps": 3}})
    assert (recipe.head.hass_topk, recipe.head.hass_topk_weight, recipe.head.ttt_steps) == (10, 1.0, 3)
    defaults = from_dict(Recipe, {**base, "head": {"type": head_type}}).head
    assert defaults.hass_topk == 0  # off unless asked for
    for field, value in (("hass_topk", -1), ("hass_topk_weight", -1.0), ("ttt_steps", 0), ("loss_decay", 1.5)):
        with pytest.raises(ConfigError, match=rf"^head\.{field} must be"):
            from_dict(Recipe, {**base, "head": {"type": head_type, field: value}})
