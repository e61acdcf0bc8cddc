"""Decode-time linear kernels: few-row matmuls in the layout the CPU's BLAS runs fast.

A decoder step multiplies every weight by only a handful of rows (1 token for plain decoding, 2-16 for a
verification or a draft block). ``nn.Linear`` computes ``x @ W^T``; with the weights streamed from memory, MKL's
general GEMM in that layout costs about twice its matrix-vector product as soon as there are two rows or more. The
same product written ``(W @ x^T)^T`` keeps the weight as the tall operand and, on some CPUs, runs at about the
one-row cost up to some 16 rows; from a few dozen rows on the two layouts cost the same. The results differ only by
float rounding (another summation order); the decoder's lossless guarantee holds because plain and speculative
decoding run the same kernels.

The gain is a property of the CPU and its BLAS, not of the model: on other CPUs the weight-major form is the slower
one from 2 rows on. So ``auto`` measures instead of assuming: it times one sweep over the
models' own eligible layers at 2-16 rows in both layouts (:func:`weight_major_speedup`, about a second) and switches
only where weight-major is measured at least :data:`AUTO_MIN_SPEEDUP` times faster.

:func:`use_weight_major_linears` switches the ``nn.Linear`` layers of the models a decoder runs (target, head, draft
model) in place: same parameters (ties kept), same state-dict names, same module identity, so nothing else notices.
Layers fall back to ``nn.Linear``'s own forward above ``max_rows`` rows and whenever autograd records (training).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.kernels.choices import LINEAR_KERNELS

logger = logging.getLogger(__name__)


AUTO_PROBE_ROWS = (2, 4, 8, 16)
"""Row counts ``auto`` times both layouts at: a verification or draft block (1 row is a matrix-vector product
either way)."""

AUTO_PROBE_REPEATS = 3
"""Alternating timed sweeps per layout; ``auto`` compares the medians."""

AUTO_MIN_SPEEDUP = 1.1
"""``auto`` switches to weight-major only when it is measured at least this much faster: near parity the choice
would flip with timing noise between runs (and a cost profile records which kernel it was measured with)."""

WEIGHT_MAJOR_MAX_ROWS = 16
"""Rows up to which the weight-major form is used; from 24 rows on it measured no faster than ``nn.Linear``."""

SINGLE_ROW_PAD_MIN_SPEEDUP = 1.1
"""A switched layer computes a single row as two (the row twice, one result kept) when that is measured at least this
much faster than its one-row product (:func:`choose_single_row_padding`)."""

SINGLE_ROW_PAD_REPEATS = 5
"""Alternating timed calls per layout and layer when choosing the single-row form; the medians count."""

ROW_EXACT_MAX_ROWS = 64
"""The most rows one product of a row-exact layer (:func:`use_row_exact_linears`) multiplies: the probe checks every
row count up to it, and a call with more rows is split, so no product runs at a row count nobody checked. 64 covers
the default trees (EAGLE 60 tokens, Medusa 64) and a verification's root row in at most two products."""

WEIGHT_MAJOR_MIN_WEIGHTS = 1 << 16
"""Layers with fewer weights keep ``nn.Linear``: their product is a few microseconds either way and the extra
transposes would only add dispatch overhead (the tiny stories260K and demo targets are all below it)."""


def resolve_linear_kernel(choice: str, device: str, dtype: str, *modules: Any) -> str:
    """``weight-major`` or ``stock`` for a ``--linear-kernel`` choice on ``device`` / ``dtype``: ``auto`` is
    stock except for fp32 on CPU, where it is what :func:`weight_major_speedup` measures faster on ``modules``
    (stock when they have no layer large enough to switch)."""
    if choice not in LINEAR_KERNELS:
        raise SpecgraftError(f"--linear-kernel {choice!r} is not one of {', '.join(LINEAR_KERNELS)}; pick one of them")
    if choice != "auto":
        return choice
    on_cpu = str(device).split(":")[0] == "cpu"
    if not (on_cpu and str(dtype) in ("float32", "torch.float32")):
        return "stock"
    speedup = weight_major_speedup(*modules)
    if speedup is None:
        return "stock"
    kernel = "weight-major" if speedup >= AUTO_MIN_SPEEDUP else "stock"
    logger.info("linear kernel auto: weight-major measured %.2fx the speed of nn.Linear at %s rows on this "
                "machine's layers -> %s", speedup, "/".join(map(str, AUTO_PROBE_ROWS)), kernel)
    return kernel


def _eligible_layers(modules: tuple[Any, ...], min_weights: int = WEIGHT_MAJOR_MIN_WEIGHTS) -> list[Any]:
    """The layers :func:`use_weight_major_linears` would switch (plain ``nn.Linear`` with enough weights)."""
    from torch import nn

    cls = weight_major_linear_class()
    return [layer for layer in _linear_layers(modules)
            if type(layer) in (nn.Linear, cls) and layer.weight.numel() >= min_weights]


def weight_major_speedup(*modules: Any, rows: tuple[int, ...] = AUTO_PROBE_ROWS,
                         repeats: int = AUTO_PROBE_REPEATS) -> float | None:
    """How many times faster the weight-major form runs ``modules``' eligible layers than ``nn.Linear``: the
    median time of a sweep through every such layer (each once, as a forward streams them) at each of ``rows``,
    the two layouts alternating; None when no layer is eligible. Inputs are random: the speed of a dense product
    does not depend on the values."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    layers = _eligible_layers(modules)
    if not layers:
        return None

    def stock(layer: Any, x: Any) -> Any:
        return F.linear(x, layer.weight, layer.bias)

    def weight_major(layer: Any, x: Any) -> Any:
        return weight_major_linear(x, layer.weight, layer.bias)
    inputs = {(r, layer.in_features, layer.weight.dtype, layer.weight.device):
              torch.randn(r, layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)
              for r in rows for layer in layers}

    def sweep(forward: Any) -> float:
        start = time.perf_counter()
        for r in rows:
            for layer in layers:
                forward(layer, inputs[(r, layer.in_features, layer.weight.dtype, layer.weight.device)])
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"stock": [], "weight-major": []}
    with torch.no_grad():
        sweep(stock)  # warm-up: first-call allocations and BLAS initialisation
        sweep(weight_major)
        for _ in range(repeats):
            times["stock"].append(sweep(stock))
            times["weight-major"].append(sweep(weight_major))
    return statistics.median(times["stock"]) / statistics.median(times["weight-major"])


def inference_rows(layer: Any, input: Any) -> int:  # noqa: A002 - F.linear's name
    """Rows ``layer`` multiplies in this call, or 0 when autograd records it (training keeps ``nn.Linear``'s own
    product) or the input is empty: the test both switched forwards make before choosing their product."""
    import torch

    if torch.is_grad_enabled() and (input.requires_grad or layer.weight.requires_grad):
        return 0
    return input.numel() // layer.in_features if layer.in_features else 0


@functools.cache  # one class, built on first use, so importing this module does not import torch
def weight_major_linear_class() -> type:
    """The ``nn.Linear`` subclass :func:`use_weight_major_linears` switches layers to."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class WeightMajorLinear(nn.Linear):
        """``nn.Linear`` whose inference forward on at most ``max_rows`` rows computes ``(W @ x^T)^T``."""

        weight_major_max_rows: int = WEIGHT_MAJOR_MAX_ROWS
        #: Compute a single row as two (see :func:`choose_single_row_padding`); off unless measured faster.
        weight_major_pad_single_row: bool = False

        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
            rows = inference_rows(self, input)
            if not rows or rows > self.weight_major_max_rows:
                return F.linear(input, self.weight, self.bias)
            if rows == 1 and self.weight_major_pad_single_row:
                return padded_single_row_linear(input, self.weight, self.bias)
            return weight_major_linear(input, self.weight, self.bias)

    return WeightMajorLinear


def weight_major_linear(input: Any, weight: Any, bias: Any = None) -> Any:  # noqa: A002 - F.linear's name
    """``F.linear(input, weight, bias)`` computed as ``(W @ x^T)^T`` (the weight as the tall operand)."""
    import torch

    flat = input.reshape(-1, weight.shape[1])  # [rows, in]
    if bias is None:
        out = torch.mm(weight, flat.t())  # [out, rows]
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, flat.t())
    return out.t().contiguous().reshape(*input.shape[:-1], weight.shape[0])


def padded_single_row_linear(input: Any, weight: Any, bias: Any = None) -> Any:  # noqa: A002 - F.linear's name
    """``F.linear`` of one row computed as the weight-major product of that row twice, the first result kept.

    On some CPUs the BLAS's matrix-vector product is far slower than its two-column product for a tall weight (a
    vocabulary projection above all), so plain decoding would pay per token a cost that a verification step does
    not."""
    import torch

    flat = input.reshape(1, weight.shape[1])
    # A real second row: an expanded (stride-0) one can send the BLAS down a slower path than the one-row product.
    # cat, not repeat: cat is the cheaper copy, and a forward pads every eligible layer.
    out = weight_major_linear(torch.cat([flat, flat]), weight, bias)[:1]  # [1, out]
    return out.reshape(*input.shape[:-1], weight.shape[0])


def choose_single_row_padding(*modules: Any, repeats: int = SINGLE_ROW_PAD_REPEATS) -> int:
    """For every weight-major layer inside ``modules``, time its one-row product both ways (``F.linear``, and
    :func:`padded_single_row_linear`) and pad where that is at least :data:`SINGLE_ROW_PAD_MIN_SPEEDUP` times
    faster; returns how many layers pad. Plain decoding's every product is one row, so this is the baseline's
    speed: it must be as fast as this machine allows.

    Each layer is timed inside sweeps through all of them in order, one sweep per form, alternating: so its weights
    come from wherever a forward finds them. Layers of one shape decide together, on their pooled medians. Timed
    alone and repeated, a layer's weights sit in the CPU's caches; a forward streams the whole model, and a
    streamed one-row product can be much slower than its two-row form where a cached one is not: timed alone, only
    layers too large for any cache (the lm_head) would pad, and a one-token forward would keep paying more than a
    two-token one."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    cls = weight_major_linear_class()
    layers = [layer for layer in _linear_layers(modules) if type(layer) is cls]
    if not layers:
        return 0
    rows = {(layer.in_features, layer.weight.dtype, layer.weight.device):
            torch.randn(1, layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)
            for layer in layers}
    inputs = [rows[(layer.in_features, layer.weight.dtype, layer.weight.device)] for layer in layers]
    forms = {"one": F.linear, "two": padded_single_row_linear}
    times: dict[str, list[list[float]]] = {name: [[] for _ in layers] for name in forms}
    with torch.no_grad():
        for sweep in range(repeats + 1):  # the first sweep of each form warms up and is not counted
            for name, form in forms.items():
                for i, (layer, x) in enumerate(zip(layers, inputs)):
                    start = time.perf_counter()
                    form(x, layer.weight, layer.bias)
                    elapsed = time.perf_counter() - start
                    if sweep:
                        times[name][i].append(elapsed)
    # One decision per weight shape (and dtype, device, bias), from all its layers' timings pooled: the BLAS picks
    # its path by shape, and per-layer medians near the threshold flipped between processes (125-228 of SmolLM2's
    # 213-244 layers padded in eight runs), moving the plain-decoding baseline with them.
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, layer in enumerate(layers):
        key = (tuple(layer.weight.shape), layer.weight.dtype, layer.weight.device, layer.bias is not None)
        groups.setdefault(key, []).append(i)
    padded = 0
    for members in groups.values():
        one = statistics.median(t for i in members for t in times["one"][i])
        two = statistics.median(t for i in members for t in times["two"][i])
        pad = one / two >= SINGLE_ROW_PAD_MIN_SPEEDUP
        for i in members:
            layers[i].weight_major_pad_single_row = pad
        padded += pad * len(members)
    return padded


def _linear_layers(modules: tuple[Any, ...]) -> Any:
    """Every ``nn.Linear`` (subclasses included) inside ``modules``, each once (modules may share layers)."""
    from torch import nn

    seen: set[int] = set()
    for module in modules:
        for layer in module.modules() if module is not None else ():
            if isinstance(layer, nn.Linear) and id(layer) not in seen:
                seen.add(id(layer))
                yield layer


def use_weight_major_linears(*modules: Any, max_rows: int = WEIGHT_MAJOR_MAX_ROWS,
                             min_weights: int = WEIGHT_MAJOR_MIN_WEIGHTS) -> int:
    """Switch every plain ``nn.Linear`` inside ``modules`` with at least ``min_weights`` weights to the
    weight-major forward, in place; returns how many layers were switched (already switched ones count again, so
    the call is idempotent). Subclasses of ``nn.Linear`` (PEFT layers, quantised layers) are left alone: their
    forward is their own."""
    if max_rows < 1:
        raise SpecgraftError(f"max_rows must be at least 1, got {max_rows}")
    cls = weight_major_linear_class()
    layers = _eligible_layers(modules, min_weights)
    for layer in layers:
        layer.__class__ = cls  # the pattern torch.nn.utils.parametrize uses: same object, new forward
        layer.weight_major_max_rows = int(max_rows)
    return len(layers)


def use_stock_linears(*modules: Any) -> int:
    """Undo :func:`use_weight_major_linears`; returns how many layers were switched back."""
    from torch import nn

    cls = weight_major_linear_class()
    switched = 0
    for layer in _linear_layers(modules):
        if type(layer) is cls:
            layer.__class__ = nn.Linear
            del layer.weight_major_max_rows
            layer.__dict__.pop("weight_major_pad_single_row", None)
            switched += 1
    return switched


def row_exact_probes(out_features: int, in_features: int, bias: bool, dtype: str, device: str,
                     rows: int) -> tuple[tuple[Any, Any, Any], ...]:
    """The (weight, input [rows, in], bias) pairs :func:`row_exact_chunk` compares row counts on: random values,
    and the order-revealing ones (see there)."""
    import torch

    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    gen = torch.Generator().manual_seed(0)
    random_weight = torch.randn(out_features, in_features, generator=gen)
    random_x = torch.randn(rows, in_features, generator=gen)
    bias_t = torch.randn(out_features, generator=gen).to(device=device, dtype=torch_dtype) if bias else None
    revealing = torch.zeros(out_features, in_features)
    if in_features >= 3:
        big, small = 2.0 ** 12, 2.0 ** -14  # small < half an fp32 ulp of big: lost when added to it first
        for row in revealing:
            i, j, k = torch.randperm(in_features, generator=gen)[:3].tolist()
            row[i], row[j], row[k] = big, small, -big
    return tuple((w.to(device=device, dtype=torch_dtype), x.to(device=device, dtype=torch_dtype), b)
                 for w, x, b in ((random_weight, random_x, bias_t),
                                 (revealing, torch.ones(rows, in_features), None)))


@functools.cache
def row_exact_chunk(out_features: int, in_features: int, bias: bool, dtype: str, device: str, threads: int,
                    max_rows: int = ROW_EXACT_MAX_ROWS) -> int:
    """The most rows ``F.linear`` may multiply in one call at this weight shape so that every row's result equals
    its one-row product bit for bit, for every row count up to it; 1 when two rows already differ.

    The BLAS picks its kernel by shape: a bf16 GEMM may compute a row alone and beside a few dozen others the same
    way and change kernels above that, or sum a small projection's row in another order from 3 rows on; MKL's fp32
    GEMM differs from 2 rows on. Probed once per shape, dtype, device and thread count (the kernel choice may follow
    the threads) with two inputs: random values, and order-revealing ones, where each output sums a large weight, a
    weight below half its ulp and the large one negated (at random positions), times ones: the small term survives in
    one summation order and vanishes in another, so a kernel that regroups a row's sum shows it in every such output
    instead of only where random values happen to sit on a rounding boundary (the random probe passed that v_proj,
    and a 5-row verification then changed a greedy token). Stops at the first row count that differs."""
    import torch
    import torch.nn.functional as F

    if max_rows < 1:
        raise SpecgraftError(f"max_rows must be at least 1, got {max_rows}")
    chunk = max_rows
    with torch.no_grad():
        for weight, x, b in row_exact_probes(out_features, in_features, bias, dtype, device, max_rows):
            alone = [F.linear(x[:1], weight, b)]  # [1, out] per row, computed as rows are needed
            for rows in range(2, chunk + 1):
                alone.append(F.linear(x[rows - 1 : rows], weight, b))
                if not torch.equal(F.linear(x[:rows], weight, b), torch.cat(alone)):
                    chunk = rows - 1
                    break
    return chunk


@functools.cache  # one class, built on first use, so importing this module does not import torch
def row_exact_linear_class() -> type:
    """The ``nn.Linear`` subclass :func:`use_row_exact_linears` switches layers to."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RowExactLinear(nn.Linear):
        """``nn.Linear`` whose inference forward multiplies at most ``row_chunk`` rows per product (more are split
        into consecutive products of ``row_chunk`` rows), so each row is computed as its one-row call computes it."""

        row_chunk: int = ROW_EXACT_MAX_ROWS

        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
            rows = inference_rows(self, input)
            if not rows or rows <= self.row_chunk:
                return F.linear(input, self.weight, self.bias)
            flat = input.reshape(rows, self.in_features)  # [rows, in]
            out = torch.cat([F.linear(part, self.weight, self.bias) for part in flat.split(self.row_chunk)])
            return out.reshape(*input.shape[:-1], self.out_features)

    return RowExactLinear


def use_row_exact_linears(*modules: Any, max_rows: int = ROW_EXACT_MAX_ROWS) -> tuple[int, int]:
    """Switch every plain ``nn.Linear`` inside ``modules`` to :func:`row_exact_linear_class`, in place (same
    parameters, ties, names and identity, as :func:`use_weight_major_linears`), all with one chunk: the smallest
    :func:`row_exact_chunk` of their shapes. One chunk for all, not one per shape, because a shape whose random probe
    agrees may still differ on real inputs: a difference shows only where another summation order happens to cross a
    rounding boundary, and SmolLM2's k_proj [192, 576] agreed on random inputs at every row count up to 64, yet
    computed row 43 of a real 61-row bf16 call differently (the GEMM changes kernels at 33 rows whatever the shape).

    Returns ``(chunk, layers switched)``; at chunk 1 (a product already computes a row differently beside one other
    row) every row is its own product, the one-row product plain decoding computes: exact, at the cost of reading
    the weights once per row. Subclasses of ``nn.Linear`` (weight-major, PEFT, quantised layers) are left alone.
    Idempotent."""
    import torch
    from torch import nn

    cls = row_exact_linear_class()
    layers = [layer for layer in _linear_layers(modules) if type(layer) in (nn.Linear, cls)]
    chunk = min((row_exact_chunk(layer.out_features, layer.in_features, layer.bias is not None,
                                 str(layer.weight.dtype), str(layer.weight.device), torch.get_num_threads(), max_rows)
                 for layer in layers), default=max_rows)
    for layer in layers:
        layer.__class__ = cls
        layer.row_chunk = chunk
    return chunk, len(layers)


def apply_linear_kernel(choice: str, device: str, dtype: str, *modules: Any) -> str:
    """Resolve ``choice`` for ``device``/``dtype`` (``auto`` measures on ``modules``) and switch ``modules`` to it;
    returns the resolved kernel name (recorded in reports and cost profiles, whose timings depend on it)."""
    kernel = resolve_linear_kernel(choice, device, dtype, *modules)
    if kernel == "weight-major":
        count = use_weight_major_linears(*modules)
        padded = choose_single_row_padding(*modules)
        logger.info("linear kernel: weight-major for up to %d rows (%d layers; %d compute one row as two, measured "
                    "faster here)", WEIGHT_MAJOR_MAX_ROWS, count, padded)
    return kernel
