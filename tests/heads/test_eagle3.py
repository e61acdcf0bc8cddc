"""EAGLE-3 head: fused layers, 2h midlayer, draft vocabulary, training-time test, save/load, bad input."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from specgraft.errors import SpecgraftError
from specgraft.heads import head_class, load_head
from specgraft.heads.eagle3.model import Eagle3Head, eagle3_feature_loss, eagle3_ttt_loss
from specgraft.heads.layers import causal_additive_mask
from specgraft.target import Target, TargetOutput
from specgraft.testing import tiny_model


def _head(target: Target, counts: torch.Tensor | None = None, **overrides) -> Eagle3Head:
    cls = head_class("eagle3")
    cfg = cls.Config(**overrides).resolve(target)
    torch.manual_seed(1)
    head = cls.build(target, cfg)
    if counts is not None:
        head.prepare_from_data(counts)
    return head


def _counts(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (vocab,), generator=torch.Generator().manual_seed(seed))


def _batch(seq_len: int = 12, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 300, (batch, seq_len), generator=g)
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask * attention}


def _ttt_loss_problem(seed: int, bsz: int, seq_len: int, vocab: int, steps: int, chosen: list[int]):
    """Random TTT loss inputs with the draft vocab = the target ids ``chosen``: (d2t, t2d, target logits
    [B, T, V], S step logits [B, T, Vd], loss mask [B, T])."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.tensor([c - i for i, c in enumerate(chosen)])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    target_logits = torch.randn(bsz, seq_len, vocab, generator=g) * 2
    step_logits = [torch.randn(bsz, seq_len, len(chosen), generator=g) for _ in range(steps)]
    loss_mask = (torch.rand(bsz, seq_len, generator=g) > 0.2).long()
    return d2t, t2d, target_logits, step_logits, loss_mask


@pytest.mark.parametrize("temperature", [1.0, 0.5])  # the target's distribution, and sharpened (target_temperature)
def test_ttt_loss_matches_direct_reference(temperature):
    bsz, seq_len, vocab, steps = 2, 7, 10, 3
    chosen = [0, 2, 3, 5, 8, 9]  # draft vocab = these target ids
    d2t, t2d, target_logits, step_logits, loss_mask = _ttt_loss_problem(0, bsz, seq_len, vocab, steps, chosen)
    loss, per_step = eagle3_ttt_loss(step_logits, target_logits, loss_mask, d2t, t2d, decay=0.8,
                                     temperature=temperature)
    total = 0.0
    for s in range(steps):
        ces = []
        for b in range(bsz):
            for i in range(seq_len):
                tok, pos = i + s + 2, i + s + 1  # predicted token, target position that predicts it
                if tok >= seq_len or not loss_mask[b, tok] or int(target_logits[b, pos].argmax()) not in chosen:
                    continue
                p = torch.softmax(target_logits[b, pos, chosen].double() / temperature, -1)
                ces.append(float(-(p * torch.log_softmax(step_logits[s][b, i].double(), -1)).sum()))
        ref = sum(ces) / len(ces) if ces else 0.0
        assert per_step[s].item() == pytest.approx(ref, rel=1e-5)
        total += 0.8**s * ref
    assert loss.item() == pytest.approx(total, rel=1e-5)


def test_feature_loss_matches_direct_reference():
    """F_s: step s's output at i against the fused feature at i+s+1, relative squared error over real pairs."""
    g = torch.Generator().manual_seed(3)
    bsz, seq_len, h, steps = 2, 6, 4, 3
    outputs = [torch.randn(bsz, seq_len, h, generator=g) for _ in range(steps)]
    fused = torch.randn(bsz, seq_len, h, generator=g)
    real = torch.ones(bsz, seq_len, dtype=torch.long)
    real[1, -2:] = 0
    loss, per_step = eagle3_feature_loss(outputs, fused, real, decay=0.5)
    assert len(per_step) == steps - 1  # the last step's output feeds no training step
    total = 0.0
    for s in range(steps - 1):
        errors = [float((outputs[s][b, i] - fused[b, i + s + 1]).double().pow(2).sum()
                        / fused[b, i + s + 1].double().pow(2).sum())
                  for b in range(bsz) for i in range(seq_len - s - 1) if real[b, i] and real[b, i + s + 1]]
        assert per_step[s].item() == pytest.approx(sum(errors) / len(errors), rel=1e-5)
        total += 0.5**s * sum(errors) / len(errors)
    assert loss.item() == pytest.approx(total, rel=1e-5)
    assert eagle3_feature_loss(outputs[:1], fused, real)[0].item() == 0.0  # S = 1: nothing to align


def _chunked_loss(tiny_llama, monkeypatch, draft_vocab_size, **options):
    """(target, head, batch, target output, trainable parameters, training_loss, its gradients) of a 3-step head
    with ``options``, its loss computed in chunks of 5 rows of 150 (several per step)."""
    import specgraft.heads.losses as losses

    monkeypatch.setattr(losses, "LOGITS_CHUNK_ELEMENTS", 5 * 150)
    target = Target(tiny_llama)
    head = _head(target, counts=_counts(target.vocab_size), ttt_steps=3, draft_vocab_size=draft_vocab_size,
                 **options).eval()
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    params = [p for p in head.parameters() if p.requires_grad]
    got = head.training_loss(batch, out)
    return target, head, batch, out, params, got, torch.autograd.grad(got.loss, params)


@pytest.mark.parametrize("draft_vocab_size", [150, None])
def test_aligned_training_loss_and_gradients_equal_the_reference(tiny_llama, monkeypatch, draft_vocab_size):
    """target_temperature and feature_loss_weight: the chunked fast path gives the reference loss
    (eagle3_ttt_loss at the temperature + weight * eagle3_feature_loss), its per-step metrics and its gradients."""
    target, head, batch, out, params, got, got_grads = _chunked_loss(
        tiny_llama, monkeypatch, draft_vocab_size, target_temperature=0.5, feature_loss_weight=0.7)
    outputs = head.ttt_outputs(batch, out)
    soft, per_step = eagle3_ttt_loss([head.lm_head(head.norm(o)) for o in outputs], out.logits, batch["loss_mask"],
                                     head.d2t, head.t2d, decay=0.8, temperature=0.5)
    feature, per_feature = eagle3_feature_loss(outputs, head.input_features(out.hidden_states),
                                               batch["attention_mask"], decay=0.8)
    ref = soft + 0.7 * feature
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(got.loss, ref, rtol=1e-5, atol=1e-6)
    for name, g, r in zip([n for n, p in head.named_parameters() if p.requires_grad], got_grads, ref_grads):
        # fp32 sums in another order: the rounding follows the gradient's size (fc's reaches ~1e2 at init)
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6 * max(1.0, float(r.abs().max())), msg=name)
    for s in range(3):
        assert got.metrics[f"loss/step{s}"].item() == pytest.approx(per_step[s].item(), rel=1e-5)
    for s in range(2):
        assert got.metrics[f"loss/feature/step{s}"].item() == pytest.approx(per_feature[s].item(), rel=1e-5)
    assert feature.item() > 0.0 and "loss/feature/step2" not in got.metrics
    # Training only: the same weights and layout as a plain head's.
    assert head.state_dict().keys() == _head(target, draft_vocab_size=draft_vocab_size).state_dict().keys()


def test_bad_alignment_config(tiny_llama):
    target = Target(tiny_llama)
    cls = head_class("eagle3")
    with pytest.raises(SpecgraftError, match="target_temperature"):
        cls.Config(target_temperature=0.0).resolve(target)
    with pytest.raises(SpecgraftError, match="feature_loss_weight"):
        cls.Config(feature_loss_weight=-1.0).resolve(target)


def test_training_time_test_equals_sequential_decoding(tiny_arch):
    """Step s at index i (parallel over i, diagonal keys) == decoding s tokens after position i with a KV cache."""
    target = Target(tiny_model(tiny_arch))
    head = _head(target, ttt_steps=3, num_layers=2, draft_vocab_size=200).eval()
    seq_len = 8
    ids = torch.randint(6, 300, (1, seq_len))
    out = target(ids, layers=head.required_layers())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        parallel = head.ttt_logits(batch, out)
        feats = head.input_features(out.hidden_states)
        for i in range(seq_len - 1):
            cache = DynamicCache()
            mask = causal_additive_mask(i + 1, None, torch.float32, ids.device)
            hidden, logits = head.draft_forward(ids[:, 1 : i + 2], feats[:, : i + 1], torch.arange(i + 1)[None],
                                                mask, cache)
            hidden = hidden[:, -1:]
            torch.testing.assert_close(logits[0, -1], parallel[0][0, i], atol=1e-5, rtol=1e-5)
            for s in range(1, 3):
                if i + s + 1 >= seq_len:
                    break
                hidden, logits = head.draft_forward(ids[:, i + s + 1 : i + s + 2], hidden, torch.tensor([[i + s]]),
                                                    torch.zeros(1, 1, 1, i + 1 + s), cache)
                torch.testing.assert_close(logits[0, -1], parallel[s][0, i], atol=1e-5, rtol=1e-5)


def test_training_loss_equals_the_reference_loss(tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, counts=_counts(target.vocab_size), ttt_steps=3, draft_vocab_size=150).eval()
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    got = head.training_loss(batch, out)
    with torch.no_grad():
        ref, per_step = eagle3_ttt_loss(head.ttt_logits(batch, out), out.logits, batch["loss_mask"], head.d2t,
                                        head.t2d, decay=0.8)
    assert got.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for s in range(3):
        assert got.metrics[f"loss/step{s}"].item() == pytest.approx(per_step[s].item(), rel=1e-5)
        assert 0.0 <= got.metrics[f"top1/step{s}"].item() <= 1.0
    # An offline cache with the post-norm last layer instead of logits gives the same loss.
    cached = target(batch["input_ids"], batch["attention_mask"], layers=(*head.required_layers(), target.num_layers),
                    logits=False)
    offline = head.training_loss(batch, cached)
    assert offline.loss.item() == pytest.approx(got.loss.item(), rel=1e-5)
    with pytest.raises(SpecgraftError, match="logits"):
        head.training_loss(batch, TargetOutput(logits=None, hidden_states=out.hidden_states))


@pytest.mark.parametrize("draft_vocab_size", [150, None])  # a reduced draft vocabulary and the full one
def test_training_loss_gradients_equal_the_reference_loss_gradients(tiny_llama, monkeypatch, draft_vocab_size):
    """The chunked fast path (small chunks, so several per step) gives the reference loss's gradients for every
    trainable parameter, the lm_head's included."""
    import specgraft.heads.losses as losses

    monkeypatch.setattr(losses, "LOGITS_CHUNK_ELEMENTS", 5 * 150)  # 5 rows of 150 per chunk (1 row of 512)
    target = Target(tiny_llama)
    head = _head(target, counts=_counts(target.vocab_size), ttt_steps=3, draft_vocab_size=draft_vocab_size).eval()
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    params = [p for p in head.parameters() if p.requires_grad]
    got = head.training_loss(batch, out)
    got_grads = torch.autograd.grad(got.loss, params)
    ref, _ = eagle3_ttt_loss(head.ttt_logits(batch, out), out.logits, batch["loss_mask"], head.d2t, head.t2d,
                             decay=0.8)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(got.loss, ref, rtol=1e-5, atol=1e-6)
    names = [n for n, p in head.named_parameters() if p.requires_grad]
    assert "lm_head.weight" in names
    for name, g, r in zip(names, got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)


def test_parameter_names_and_shapes_follow_the_serving_layout(tiny_llama):
    target = Target(tiny_llama)
    h = target.hidden_size
    head = _head(target, draft_vocab_size=100)
    state = head.state_dict()
    proj = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    norms = {f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    expected |= {f"midlayer.{p}" for p in proj | norms}
    assert set(state) == expected
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert state["midlayer.self_attn.o_proj.weight"].shape[0] == h
    assert state["lm_head.weight"].shape == (100, h)
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (100,)
    assert state["t2d"].dtype == torch.bool and state["t2d"].shape == (target.vocab_size,)
    assert head.required_layers() == (1, 2, 3)  # N = 4: (2, N//2, N-3) would repeat a layer, so spread
    assert type(head).needs_target_logits


def test_prepare_from_data_sets_the_draft_vocab_and_reports_coverage(tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, draft_vocab_size=64)
    counts = _counts(target.vocab_size)
    facts = head.prepare_from_data(counts)
    top = torch.sort(counts.double(), descending=True, stable=True).indices[:64].sort().values
    assert torch.equal(head.draft_token_ids(), top)
    assert head.t2d.sum() == 64 and head.t2d[top].all()
    assert facts["draft_vocab_train_coverage"] == pytest.approx(float(counts[top].sum() / counts.sum()))
    assert "draft_vocab_coverage" not in facts  # no held-out counts: no held-out coverage claimed
    heldout = _counts(target.vocab_size, seed=1)
    facts = head.prepare_from_data(counts, heldout)
    assert torch.equal(head.draft_token_ids(), top)  # chosen from token_counts alone
    assert facts["draft_vocab_coverage"] == pytest.approx(float(heldout[top].sum() / heldout.sum()))
    assert facts["draft_vocab_heldout_tokens"] == int(heldout.sum())
    # The lm_head starts from the target's rows of the chosen tokens.
    torch.testing.assert_close(head.lm_head.weight, target.output_head.weight[top])
    with pytest.raises(SpecgraftError, match="vocabulary"):
        head.prepare_from_data(torch.ones(10))
    with pytest.raises(SpecgraftError, match="held-out token counts"):
        head.prepare_from_data(counts, torch.ones(10))


def test_full_vocab_head_has_zero_offsets(tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, counts=_counts(target.vocab_size))
    assert head.config.draft_vocab_size == target.vocab_size  # min(32000, 320)
    assert head.d2t.eq(0).all() and head.t2d.all()


def test_every_architecture_trains_without_touching_the_target(tiny_arch):
    target = Target(tiny_model(tiny_arch))
    head = _head(target, counts=_counts(target.vocab_size), ttt_steps=2, draft_vocab_size=200)
    batch = _batch(seq_len=10)
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers(), logits=True)
    result = head.training_loss(batch, out)
    assert torch.isfinite(result.loss) and set(result.metrics) >= {"loss/step0", "loss/step1", "top1/step1"}
    result.loss.backward()
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in head.parameters())
    assert head.midlayer.self_attn.o_proj.weight.grad.abs().sum() > 0


def test_save_load_round_trip(tmp_path, tiny_llama):
    target = Target(tiny_llama)
    head = _head(target, counts=_counts(target.vocab_size), draft_vocab_size=120, num_layers=2).eval()
    path = head.save_pretrained(tmp_path / "eagle3")
    saved = load_file(str(path / "head.safetensors"))
    assert torch.equal(saved["d2t"], head.d2t) and torch.equal(saved["t2d"], head.t2d)
    loaded = load_head(target, path).eval()
    assert isinstance(loaded, Eagle3Head) and loaded.config == head.config
    assert torch.equal(loaded.draft_token_ids(), head.draft_token_ids())
    batch = _batch()
    out = target(batch["input_ids"], batch["attention_mask"], layers=head.required_layers())
    with torch.no_grad():
        for a, b in zip(head.ttt_logits(batch, out), loaded.ttt_logits(batch, out)):
            assert torch.equal(a, b)


def test_default_feature_layers():
    def layers(n):
        return Target(tiny_model("llama", num_hidden_layers=n)).default_eagle3_layers()

    assert layers(32) == (2, 16, 29)
    assert layers(8) == (2, 4, 5)
    # Shallow targets where (2, N//2, N-3) repeats a layer get three distinct layers spread over the stack.
    assert layers(5) == (1, 3, 4)
    assert layers(4) == (1, 2, 3)
    assert layers(2) == (2, 1, 0)  # clamped into 0..N and already distinct


def test_bad_inputs(tiny_llama):
    target = Target(tiny_llama)
    cls = head_class("eagle3")
    with pytest.raises(SpecgraftError, match="out of range"):
        cls.Config(feature_layers=[1, 2, 5]).resolve(target)
    with pytest.raises(SpecgraftError, match="out of range"):
        cls.Config(feature_layers=[-1, 2, 3]).resolve(target)
    with pytest.raises(SpecgraftError, match="draft_vocab_size"):
        cls.Config(draft_vocab_size=target.vocab_size + 1).resolve(target)
    with pytest.raises(SpecgraftError, match="feature_layers"):
        cls.Config(feature_layers=[]).resolve(target)
    good = cls.Config().resolve(target)
    good.feature_layers = [0, 9]  # e.g. a hand-edited head_config.json
    with pytest.raises(SpecgraftError, match="out of range"):
        Eagle3Head(good, target)


@pytest.mark.parametrize("cpu_flash", [True, False], ids=["cpu-flash-lse", "concatenated-keys"])
def test_ttt_attention_equals_the_explicit_joint_softmax_with_its_gradients(cpu_flash, monkeypatch):
    """Both fused TTT attentions against the written-out formula: scores ``[q_i . K0[j], masked] ++ [q_i . Kr[i]
    for r = 1..s]``, one softmax, values alike; GQA (4 query heads on 2 KV heads), a padded row and queries in the
    transposed layout transformers hands over; outputs and gradients of every step's q, k, v. ``cpu-flash-lse``:
    the block through torch's CPU flash kernel, the diagonal joined by log-sum-exp (the CPU training path);
    ``concatenated-keys``: the diagonal keys as diagonal-masked key blocks through SDPA (every other device)."""
    from types import SimpleNamespace

    from specgraft.heads import layers
    from specgraft.heads.layers import TTTKeys, eagle_attention_forward

    assert layers.cpu_flash_with_lse(torch.zeros(1), 0.0)  # torch still has the CPU flash ops this path needs
    if not cpu_flash:
        monkeypatch.setattr(layers, "cpu_flash_with_lse", lambda *_: False)

    batch, heads, kv_heads, length, dim, steps = 2, 4, 2, 7, 8, 3
    gen = torch.Generator().manual_seed(3)
    qkv = [[torch.randn(batch, length, n, dim, generator=gen).transpose(1, 2).requires_grad_()
            for n in (heads, kv_heads, kv_heads)] for _ in range(steps)]  # each [B, n, T, d], transposed layout
    key_valid = torch.ones(batch, length, dtype=torch.bool)
    key_valid[1, -2:] = False
    mask = causal_additive_mask(length, key_valid, torch.float32, torch.device("cpu"))  # [B, 1, T, T]
    module = SimpleNamespace(layer_idx=0, training=True)
    state = TTTKeys()
    fused = [eagle_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5, eagle_ttt=state)[0]
             for q, k, v in qkv]  # each [B, T, H, d]

    def explicit(s: int) -> torch.Tensor:
        q = qkv[s][0]
        keys = [qkv[r][1].repeat_interleave(heads // kv_heads, dim=1) for r in range(s + 1)]
        values = [qkv[r][2].repeat_interleave(heads // kv_heads, dim=1) for r in range(s + 1)]
        block = q @ keys[0].transpose(-1, -2) * dim ** -0.5 + mask  # [B, H, T, T]
        diag = [(q * k).sum(-1, keepdim=True) * dim ** -0.5 for k in keys[1:]]  # each [B, H, T, 1]
        weights = torch.softmax(torch.cat([block, *diag], dim=-1), dim=-1)
        out = weights[..., :length] @ values[0]
        for r in range(1, s + 1):
            out = out + weights[..., length + r - 1 : length + r] * values[r]
        return out.transpose(1, 2)

    reference = [explicit(s) for s in range(steps)]
    weights = [torch.randn(o.shape, generator=gen) for o in reference]
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(fused, weights)), [t for s in qkv for t in s])
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(reference, weights)),
                                    [t for s in qkv for t in s])
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

# -- HASS: harmonized objective distillation (hass_topk) -----------------------------------------------------------
def test_ttt_loss_with_topk_distillation_matches_direct_reference():
    """Each step gains topk_weight * -sum over the K likeliest tokens of the target's draft-vocab distribution of
    p log q (p restricted to the draft vocab and renormalised there, not over the top-K)."""
    bsz, seq_len, vocab, steps, k, weight = 2, 8, 12, 3, 3, 0.4
    chosen = [0, 1, 3, 4, 6, 8, 9, 11]
    d2t, t2d, target_logits, step_logits, loss_mask = _ttt_loss_problem(3, bsz, seq_len, vocab, steps, chosen)
    plain, plain_steps = eagle3_ttt_loss(step_logits, target_logits, loss_mask, d2t, t2d, decay=0.8)
    loss, per_step = eagle3_ttt_loss(step_logits, target_logits, loss_mask, d2t, t2d, decay=0.8, topk=k,
                                     topk_weight=weight)
    extra = 0.0
    for s in range(steps):
        terms = []
        for b in range(bsz):
            for i in range(seq_len):
                tok, pos = i + s + 2, i + s + 1
                if tok >= seq_len or not loss_mask[b, tok] or int(target_logits[b, pos].argmax()) not in chosen:
                    continue
                p = torch.softmax(target_logits[b, pos, chosen].double(), -1)
                logq = torch.log_softmax(step_logits[s][b, i].double(), -1)
                top = p.argsort(descending=True)[:k]
                terms.append(float(-(p[top] * logq[top]).sum()))
        extra += 0.8**s * weight * (sum(terms) / len(terms) if terms else 0.0)
        assert per_step[s].item() == pytest.approx(plain_steps[s].item(), rel=1e-6)  # L_s: the soft CE alone
    assert loss.item() == pytest.approx(plain.item() + extra, rel=1e-5)


@pytest.mark.parametrize("draft_vocab_size", [150, None])
def test_hass_training_loss_and_gradients_equal_the_reference(tiny_llama, monkeypatch, draft_vocab_size):
    """The chunked path with the top-K term (several chunks per step) gives the reference loss, its per-step
    metrics and its gradients for every trainable parameter."""
    target, head, batch, out, params, got, got_grads = _chunked_loss(
        tiny_llama, monkeypatch, draft_vocab_size, hass_topk=10, hass_topk_weight=0.5)
    step_logits = head.ttt_logits(batch, out)
    ref, per_step = eagle3_ttt_loss(step_logits, out.logits, batch["loss_mask"], head.d2t, head.t2d, decay=0.8,
                                    topk=10, topk_weight=0.5)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(got.loss, ref, rtol=1e-5, atol=1e-6)
    for name, g, r in zip([n for n, p in head.named_parameters() if p.requires_grad], got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    plain = _head(target, counts=_counts(target.vocab_size), ttt_steps=3, draft_vocab_size=draft_vocab_size).eval()
    plain_loss = plain.training_loss(batch, out)
    for s in range(3):
        assert got.metrics[f"loss/step{s}"].item() == pytest.approx(per_step[s].item(), rel=1e-5)
        assert got.metrics[f"loss/step{s}"].item() == pytest.approx(plain_loss.metrics[f"loss/step{s}"].item(),
                                                                    rel=1e-5)  # same weights: the same soft CE
        assert 0.0 < got.metrics[f"loss/topk/step{s}"].item() <= got.metrics[f"loss/step{s}"].item()
    assert "loss/topk/step0" not in plain_loss.metrics
    # Training only: the saved head is the plain one.
    assert plain.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(plain.state_dict()[k], head.state_dict()[k]) for k in head.state_dict())


def test_bad_hass_config(tiny_llama):
    target = Target(tiny_llama)
    cls = head_class("eagle3")
    with pytest.raises(SpecgraftError, match="hass_topk"):
        cls.Config(hass_topk=-1).resolve(target)
    with pytest.raises(SpecgraftError, match="at most 100"):
        cls.Config(draft_vocab_size=100, hass_topk=101).resolve(target)
    with pytest.raises(SpecgraftError, match="hass_topk_weight"):
        cls.Config(hass_topk=10, hass_topk_weight=float("nan")).resolve(target)


def _lm_head_scale_step(folder, scale: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Eagle3Head]:
    """(parameters before, after one AdamW step of the trainer) of an EAGLE-3 head at ``lm_head_lr_scale``."""
    import datasets

    from specgraft.config import Recipe, from_dict
    from specgraft.target import load_target
    from specgraft.train.trainer import HeadTrainer

    generator = torch.Generator().manual_seed(3)
    rows = []
    for prompt, labelled in ((3, 20), (5, 14), (2, 25), (4, 9)):
        ids = torch.randint(6, 262, (prompt + labelled,), generator=generator).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "loss_mask": [0] * prompt + [1] * labelled})
    (folder / "corpus.txt").write_text("unused\n")
    recipe = from_dict(Recipe, {
        "model": {"name_or_path": str(folder / "target")},
        "data": {"path": str(folder / "corpus.txt"), "format": "text", "max_length": 64},
        "head": {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 96, "lm_head_lr_scale": scale},
        "training": {"max_steps": 1, "learning_rate": 1e-2, "warmup_steps": 0, "lr_scheduler": "constant",
                     "max_grad_norm": 0.0, "micro_batch_size": 4, "checkpoint_every": 100, "seed": 5},
        "output": {"dir": str(folder / f"out-{scale}"), "overwrite": True},
        "tracking": {"backend": "none"},
    })
    trainer = HeadTrainer(recipe, target=load_target(folder / "target"), dataset=datasets.Dataset.from_list(rows),
                          show_progress=False)
    trainer.setup()
    try:
        head = trainer.unwrapped().head
        before = {n: p.detach().clone() for n, p in head.named_parameters()}
        trainer.train()
        after = {n: p.detach().clone() for n, p in head.named_parameters()}
    finally:
        trainer.cleanup()
    return before, after, head


def test_lm_head_lr_scale_moves_only_the_lm_head_slower_and_zero_freezes_it_at_the_targets_rows(tmp_path):
    """One AdamW step from the same start: the lm_head's update at scale s is s times the full-rate update (AdamW's
    step is proportional to the group's rate), every other parameter's update is the full-rate run's; at 0 the
    lm_head keeps the target's output rows of the draft vocabulary and is not trained at all."""
    from specgraft.testing import tiny_tokenizer

    tiny_model("llama", seed=1, initializer_range=0.2).save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    runs = {scale: _lm_head_scale_step(tmp_path, scale) for scale in (1.0, 0.25, 0.0)}
    full_before, full_after, _ = runs[1.0]
    full_update = {n: full_after[n] - full_before[n] for n in full_before}
    assert full_update["lm_head.weight"].abs().max() > 5e-3  # ~ lr: the full-rate run does move it
    for scale in (0.25, 0.0):
        before, after, head = runs[scale]
        for name in full_before:
            torch.testing.assert_close(before[name], full_before[name], rtol=0, atol=0)  # the same start
            update = after[name] - before[name]
            expected = full_update[name] * (scale if name == "lm_head.weight" else 1.0)
            torch.testing.assert_close(update, expected, rtol=1e-4, atol=1e-7, msg=f"{name} at scale {scale}")
    _, frozen_after, frozen = runs[0.0]
    assert not frozen.lm_head.weight.requires_grad
    rows = frozen.target.output_head.weight.index_select(0, frozen.draft_token_ids())
    torch.testing.assert_close(frozen_after["lm_head.weight"], rows.detach(), rtol=0, atol=0)
