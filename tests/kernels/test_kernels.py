"""Decode-time linear kernels: the weight-major forward equals nn.Linear, switching keeps the model's identity, and
greedy speculative decoding with switched layers equals plain decoding with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specgraft.decoding.decoder import SpeculativeDecoder, generate_reference
from specgraft.decoding.drafters import DraftModelDrafter, SelfDrafter
from specgraft.errors import SpecgraftError
from specgraft.kernels import linear as kernels
from specgraft.kernels.linear import (
    AUTO_MIN_SPEEDUP,
    WEIGHT_MAJOR_MAX_ROWS,
    resolve_linear_kernel,
    row_exact_chunk,
    row_exact_linear_class,
    row_exact_probes,
    use_row_exact_linears,
    use_stock_linears,
    use_weight_major_linears,
    weight_major_linear_class,
)
from specgraft.testing import tiny_model
from specgraft.tuning.cost import check_profile


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 4), (WEIGHT_MAJOR_MAX_ROWS,), (1, WEIGHT_MAJOR_MAX_ROWS + 1)])
@torch.no_grad()
def test_weight_major_forward_equals_nn_linear(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape, 48)
    expected = F.linear(x, layer.weight, layer.bias)
    use_weight_major_linears(layer, min_weights=0)
    assert type(layer) is weight_major_linear_class()
    out = layer(x)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if x.numel() // 48 > WEIGHT_MAJOR_MAX_ROWS:  # above the threshold it is nn.Linear's own forward, bit for bit
        assert torch.equal(out, expected)


def test_autograd_falls_back_to_nn_linear_and_gradients_flow():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    reference = nn.Linear(8, 6)
    reference.load_state_dict(layer.state_dict())
    use_weight_major_linears(layer, min_weights=0)
    x = torch.randn(3, 8)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert torch.equal(layer.weight.grad, reference.weight.grad) and torch.equal(layer.bias.grad, reference.bias.grad)


def test_switching_keeps_names_ties_and_identity_and_can_be_undone():
    model = tiny_model("llama", tie_word_embeddings=True)
    before = {k: v for k, v in model.state_dict().items()}
    lm_head = model.get_output_embeddings()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        stock_logits = model(ids).logits
    assert use_weight_major_linears(model, min_weights=0) == len(linears)
    assert use_weight_major_linears(model, min_weights=0) == len(linears)  # idempotent
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    assert model.get_output_embeddings() is lm_head and lm_head.weight is model.get_input_embeddings().weight
    assert all(isinstance(m, nn.Linear) for m in linears)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock_logits, rtol=1e-5, atol=1e-5)
    assert use_stock_linears(model) == len(linears)
    assert all(type(m) is nn.Linear for m in linears)


def test_small_layers_keep_nn_linear_by_default():
    model = tiny_model("llama")  # every weight of the tiny model is below WEIGHT_MAJOR_MIN_WEIGHTS
    assert use_weight_major_linears(model) == 0
    big = nn.Linear(512, 256)
    assert use_weight_major_linears(big) == 1


@torch.no_grad()
def test_greedy_speculative_with_switched_layers_equals_plain_decoding(tiny_arch):
    target = tiny_model(tiny_arch)
    draft = tiny_model(tiny_arch, seed=1, num_hidden_layers=1)
    drafter = DraftModelDrafter(draft, k=3, tree_topk=(2, 2))
    assert drafter.modules() == (draft,) and SelfDrafter(k=2).modules() == ()
    use_weight_major_linears(target, *drafter.modules(), min_weights=0)
    prompt = [7, 42, 3, 99, 12, 5]
    reference = generate_reference(target, prompt, 20)
    for candidate in (None, drafter, SelfDrafter(k=3)):
        assert SpeculativeDecoder(target, drafter=candidate).generate(prompt, 20).generated_ids == reference


@pytest.mark.parametrize("choice,device,dtype,expected", [
    ("auto", "cpu", "bfloat16", "stock"),
    ("auto", "cuda:0", "float32", "stock"),
    ("stock", "cpu", "float32", "stock"),
    ("weight-major", "cuda", "bfloat16", "weight-major"),
])
def test_forced_choices_and_auto_off_fp32_cpu_need_no_measurement(choice, device, dtype, expected, monkeypatch):
    monkeypatch.setattr(kernels, "weight_major_speedup", lambda *m: pytest.fail("measured"))
    assert resolve_linear_kernel(choice, device, dtype, nn.Linear(512, 512)) == expected


@pytest.mark.parametrize("speedup,expected", [(2.0, "weight-major"), (AUTO_MIN_SPEEDUP, "weight-major"),
                                              (1.05, "stock"), (0.5, "stock"), (None, "stock")])
def test_auto_on_fp32_cpu_keeps_the_layout_measured_faster(speedup, expected, monkeypatch):
    """weight-major only when measured at least AUTO_MIN_SPEEDUP times faster on the given modules (it ran at
    half the speed of nn.Linear on one Xeon); stock when nothing is large enough to switch (None)."""
    seen = []
    monkeypatch.setattr(kernels, "weight_major_speedup", lambda *modules: seen.append(modules) or speedup)
    layer = nn.Linear(512, 512)
    assert resolve_linear_kernel("auto", "cpu", "float32", layer) == expected
    assert seen == [(layer,)]
    assert kernels.apply_linear_kernel("auto", "cpu", "float32", layer) == expected
    assert (type(layer) is weight_major_linear_class()) == (expected == "weight-major")


def test_the_measurement_times_the_eligible_layers_only():
    big, small = nn.Linear(512, 256), nn.Linear(16, 16)
    speedup = kernels.weight_major_speedup(nn.Sequential(big, small), rows=(2,), repeats=1)
    assert speedup is not None and 0 < speedup < float("inf")
    assert kernels.weight_major_speedup(small) is None  # below WEIGHT_MAJOR_MIN_WEIGHTS: nothing to time
    assert type(big) is nn.Linear  # measuring switches nothing


def test_bad_kernel_name_is_refused():
    with pytest.raises(SpecgraftError, match="--linear-kernel 'fast' is not one of"):
        resolve_linear_kernel("fast", "cpu", "float32")


def test_profile_measured_with_another_kernel_warns_naming_both():
    from specgraft.tuning.cost import CostProfile

    profile = CostProfile(device="cpu", device_name="x", dtype="float32", threads=2, torch_version="2",
                          target={}, kv_length=8, step_s={"chain": {1: 0.1}, "tree": {}})
    assert profile.linear_kernel == "stock"
    assert CostProfile.from_dict(profile.to_dict()).linear_kernel == "stock"
    (message,) = check_profile(profile, None, None, linear_kernel="weight-major")
    assert "stock linear kernel" in message and "uses weight-major" in message
    assert check_profile(profile, None, None, linear_kernel="stock") == []


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (1, 1, 1)])
@torch.no_grad()
def test_a_padded_single_row_equals_nn_linear(bias, shape):
    """A switched layer told to pad computes one row as two and keeps the first: nn.Linear's result, any leading
    shape; rows > 1 are unaffected by the flag."""
    from specgraft.kernels.linear import padded_single_row_linear

    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape, 48)
    expected = F.linear(x, layer.weight, layer.bias)
    out = padded_single_row_linear(x, layer.weight, layer.bias)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    use_weight_major_linears(layer, min_weights=0)
    layer.weight_major_pad_single_row = True
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    three = torch.randn(3, 48)
    torch.testing.assert_close(layer(three), F.linear(three, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def fake_padding_timings(monkeypatch, two_cost) -> list[int]:
    """Fake clocks for :func:`choose_single_row_padding`: a one-row product 'costs' 0.5 s, a padded one
    ``two_cost(weight)`` s; returns the out-features of every timed call, in order (undo with monkeypatch.undo)."""
    import itertools
    import time

    import specgraft.kernels.linear as kernels

    costs, calls = {}, []
    real_linear = F.linear

    def fake(cost):
        def form(x, weight, bias=None):
            costs["next"] = cost(weight)
            calls.append(weight.shape[0])
            return real_linear(x, weight, bias)
        return form

    clock = itertools.count()
    now = {"t": 0.0}

    def perf_counter():
        # even calls start a timing, odd calls end it, advancing by the cost of the call in between
        if next(clock) % 2:
            now["t"] += costs.pop("next", 0.0)
        return now["t"]

    monkeypatch.setattr(F, "linear", fake(lambda weight: 0.5))
    monkeypatch.setattr(kernels, "padded_single_row_linear", fake(two_cost))
    monkeypatch.setattr(time, "perf_counter", perf_counter)
    return calls


def test_single_row_padding_is_chosen_by_measurement(monkeypatch):
    """Each weight-major layer pads exactly when its padded one-row product measured >= SINGLE_ROW_PAD_MIN_SPEEDUP
    times faster (timings faked: the padded form 'costs' 1 s for the narrow layer and 0.1 s for the wide one, the
    one-row product 0.5 s for both); unswitched layers are not touched; undoing the switch drops the flag. Each
    layer is timed inside sweeps through all layers (as a forward streams the weights), never twice in a row."""
    import specgraft.kernels.linear as kernels

    narrow, wide, untouched = nn.Linear(16, 8), nn.Linear(16, 64), nn.Linear(16, 4)
    use_weight_major_linears(narrow, wide, min_weights=0)
    calls = fake_padding_timings(monkeypatch, lambda weight: 1.0 if weight.shape[0] == 8 else 0.1)
    assert kernels.choose_single_row_padding(narrow, wide, untouched) == 1
    monkeypatch.undo()
    assert len(calls) > 2 and all(a != b for a, b in zip(calls, calls[1:]))  # sweeps: the other layer in between
    assert wide.weight_major_pad_single_row and not narrow.weight_major_pad_single_row
    assert not hasattr(untouched, "weight_major_pad_single_row")
    kernels.use_stock_linears(wide)
    assert type(wide) is nn.Linear and "weight_major_pad_single_row" not in wide.__dict__


def test_layers_of_one_shape_decide_single_row_padding_together(monkeypatch):
    """The decision is per weight shape, on all its layers' timings pooled: a layer whose own (fake) timings would
    pad (0.1 s padded against 0.5 s) follows its shape's pooled median when a same-shape layer times 1.0 s padded,
    so noise in one layer cannot split a shape's layers (real runs padded 125-228 of 213-244 layers per layer)."""
    import specgraft.kernels.linear as kernels

    fast, slow = nn.Linear(16, 64), nn.Linear(16, 64)
    use_weight_major_linears(fast, slow, min_weights=0)
    fake_padding_timings(monkeypatch, lambda weight: 0.1 if weight is fast.weight else 1.0)
    assert kernels.choose_single_row_padding(fast, slow) == 0
    monkeypatch.undo()
    assert not fast.weight_major_pad_single_row and not slow.weight_major_pad_single_row


# --- row-exact layers (the linear half of --attention-kernel exact) ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_row_exact_chunk_is_the_largest_row_count_computed_row_by_row(dtype):
    """Every row count up to the probed chunk gives each row its one-row bits, on fresh random inputs too; one more
    row does not on the probe's inputs (the negative control: the probe stops where this machine's GEMM changes its
    summation, SmolLM2's width here)."""
    max_rows = 40
    chunk = row_exact_chunk(576, 576, True, str(dtype), "cpu", torch.get_num_threads(), max_rows)
    assert 1 <= chunk <= max_rows
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(576, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    for x in [torch.randn(max_rows + 1, 576, generator=gen).to(dtype) for _ in range(3)]:
        alone = torch.cat([F.linear(x[r : r + 1], weight, bias) for r in range(max_rows + 1)])
        for rows in range(1, chunk + 1):
            assert torch.equal(F.linear(x[:rows], weight, bias), alone[:rows]), rows
    if chunk < max_rows:
        differs_after = False
        for w, x, b in row_exact_probes(576, 576, True, str(dtype), "cpu", chunk + 1):
            alone = torch.cat([F.linear(x[r : r + 1], w, b) for r in range(chunk + 1)])
            differs_after |= not torch.equal(F.linear(x, w, b), alone)
        assert differs_after


@torch.no_grad()
def test_the_order_revealing_probe_sees_a_regrouped_sum_that_random_values_hide(monkeypatch):
    """Negative control for the probe: a linear whose multi-row product sums each row in another order (the
    difference a bf16 GEMM showed on stories260K's v_proj, invisible to a random probe at that width) is caught."""
    real = F.linear

    def regrouped(x, weight, bias=None):
        if x.shape[0] == 1:
            return real(x, weight, bias)
        # the same products, summed exactly (float64) and rounded once: another grouping than any fp32 kernel's
        exact = real(x.double(), weight.double(), None if bias is None else bias.double())
        return exact.to(x.dtype)

    monkeypatch.setattr(F, "linear", regrouped)
    row_exact_chunk.cache_clear()
    try:
        assert row_exact_chunk(32, 64, False, "bfloat16", "cpu", 1, 8) == 1
    finally:
        monkeypatch.undo()
        row_exact_chunk.cache_clear()


@torch.no_grad()
def test_row_exact_layers_compute_every_row_of_a_61_row_call_as_its_one_row_call():
    """The default EAGLE tree's verification (60 tokens + the root) through a SmolLM2-sized bf16 layer: exact at any
    chunk, one row per product where the machine's GEMM regroups from 2 rows on."""
    torch.manual_seed(0)
    layer = nn.Linear(576, 1536).to(torch.bfloat16)
    x = torch.randn(1, 61, 576).to(torch.bfloat16)
    alone = torch.cat([layer(x[:, r : r + 1]) for r in range(61)], dim=1)  # [1, 61, 1536]
    chunk, switched = use_row_exact_linears(layer)
    assert switched == 1 and type(layer) is row_exact_linear_class() and layer.row_chunk == chunk
    assert torch.equal(layer(x), alone)
    assert use_row_exact_linears(layer) == (chunk, 1) and type(layer) is row_exact_linear_class()  # idempotent


def test_one_chunk_for_all_layers_the_smallest_any_shape_shows(monkeypatch):
    """A shape whose probe agrees can still differ on real inputs (SmolLM2's k_proj), so every layer gets the
    smallest chunk; where one shape differs already at 2 rows every row is its own product."""
    chunks = {(6, 8): 32, (4, 8): 64}
    monkeypatch.setattr(kernels, "row_exact_chunk", lambda out_f, in_f, *args: chunks[(out_f, in_f)])
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(8, 4))
    assert use_row_exact_linears(model) == (32, 2)
    assert [layer.row_chunk for layer in model] == [32, 32]
    chunks[(4, 8)] = 1
    fresh = nn.Sequential(nn.Linear(8, 6), nn.Linear(8, 4))
    assert use_row_exact_linears(fresh) == (1, 2) and [layer.row_chunk for layer in fresh] == [1, 1]
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(fresh[0](x), torch.cat([F.linear(x[r : r + 1], fresh[0].weight, fresh[0].bias)
                                                   for r in range(5)]))


def test_a_split_call_is_consecutive_products_and_training_is_untouched(monkeypatch):
    monkeypatch.setattr(kernels, "row_exact_chunk", lambda *args: 5)
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    plain_weight = layer.weight
    assert use_row_exact_linears(layer) == (5, 1) and layer.weight is plain_weight
    assert dict(layer.named_parameters()).keys() == {"weight", "bias"}
    real_linear, calls = F.linear, []

    def counting(x, *args):
        calls.append(x.numel() // x.shape[-1])
        return real_linear(x, *args)

    monkeypatch.setattr(F, "linear", counting)
    x = torch.randn(2, 7, 8)
    with torch.no_grad():
        out = layer(x)
    assert calls == [5, 5, 4] and out.shape == (2, 7, 6)
    expected = torch.cat([real_linear(part, layer.weight, layer.bias) for part in x.reshape(14, 8).split(5)])
    assert torch.equal(out, expected.reshape(2, 7, 6))
    calls.clear()
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()  # autograd records: one plain product, gradients flow
    assert calls == [14] and layer.weight.grad is not None and xg.grad.shape == x.shape
