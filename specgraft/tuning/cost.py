"""The device cost model: what a speculative step costs on THIS device, dtype and thread count.

``specgraft profile --target PATH [--head DIR ...] [--draft DIR ...] --out profile.json`` measures

* ``step_s``: the wall time of one decoding step of the real :class:`~specgraft.decoding.decoder.SpeculativeDecoder`
  verifying ``n`` tokens at once (the root plus ``n - 1`` draft nodes), for a chain (causal forward) and for a tree
  (4D tree mask), at a KV length of ``--kv-length`` tokens. The draft comes from a zero-cost drafter that returns a
  fixed set of random tokens, so the time is verification plus the decoder's own bookkeeping: exactly what a step
  costs besides drafting. ``n = 1`` is a plain decoding step: the eval's baseline, with the stock kernels or with
  the switched ones where those decode faster. Each value is the slope of generation time over the
  number of steps (two generation lengths, so prefill cancels), median over ``--repeats``.
* ``bookkeeping_s``: the part of each ``step_s`` outside the verification forward and its verdict (the decoder's
  own work per step: tree structure and mask, KV rollback), from the same runs. ``specgraft tune`` adds it to the
  verification time it measures in the calibration run, so one noisy ``step_s`` value does not set the per-step
  overhead it charges every candidate.
* ``forward_s``: the bare target forward of ``n`` new tokens on a ``kv_length`` cache (no decoder), for reference.
* Load drift: every time is taken as a ratio to a bare one-token target forward timed right next to it (each
  ``n``-token step also to a plain step timed right before it) and scaled back with that forward's median over
  the run, so on a shared machine the costs stay comparable with one another even when the absolute speed drifts.
* ``drafters``: per drafter, the time of one ``propose`` call (median over calls) per setting: Medusa per number
  of heads used (one call reads every head once), EAGLE/EAGLE-3 per chain depth and per (top-k, depth) tree,
  a draft model per chain length ``k``; a family with a ``profile_drafter`` hook measures its own settings
  (DFlash: the one block forward, chain and per tree width).

The JSON records the device name, dtype, threads, torch version and the target's identity; :func:`check_profile`
warns (naming both) when a profile from another device or target is used.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgraft.decoding import kv
from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafter import DraftContext, Drafter
from specgraft.decoding.drafters import DraftModelDrafter
from specgraft.decoding.kv import model_device, text_config
from specgraft.decoding.tree import DraftTree
from specgraft.errors import SpecgraftError
from specgraft.evaluation.settings import MAX_REPEATS
from specgraft.heads.registry import draft_model_search, get_family
from specgraft.kernels.exact_attention import attention_kernel_of, kernel_setting, stock_kernels
from specgraft.tuning.search import monotone
from specgraft.tuning.settings import DEFAULT_KV_LENGTH, DEFAULT_REPEATS, DEFAULT_TOKEN_COUNTS
from specgraft.utils.io import atomic_write_json, read_json_meta, require_file
from specgraft.utils.numbers import check_number, check_number_tree

logger = logging.getLogger(__name__)

PROFILE_VERSION = 1
#: Generation lengths (decoding steps) whose time difference gives one step's time.
SHORT_STEPS, LONG_STEPS = 4, 16
#: Timed propose() calls per drafter setting (after one warm-up call); the median counts.
DRAFT_CALLS = 15
#: Settings measured for draft models (a head family measures its own: its ``profile_drafter`` hook).
DRAFT_MODEL_KS = (1, 2, 3, 4, 5, 6, 8)
CATCHUP_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
#: Keys every profile JSON must hold.
REQUIRED_KEYS = ("version", "device", "dtype", "threads", "torch_version", "target", "kv_length", "step_s")


@dataclass
class CostProfile:
    """A measured device cost profile (all times in seconds).

    Attributes:
        device: ``cpu``, ``cuda:0``, ...; ``device_name`` the CPU or GPU model.
        dtype, threads, torch_version: what the numbers were measured with.
        target: the target's identity dict (``name_or_path``, ``architecture``, sizes).
        kv_length: tokens in the KV cache during the measurement.
        step_s: ``{"chain": {n: s}, "tree": {n: s}}``, a decoder step verifying ``n`` tokens (root included).
        bookkeeping_s: like ``step_s``, the part of a step outside the verification forward and its verdict
            (empty in profiles written before it existed).
        forward_s: ``{n: s}``, the bare target forward of ``n`` tokens.
        drafters: ``{label: {"kind": ..., "path": ..., <setting tables>}}`` (see the module docstring).
        linear_kernel: the decode-time matmul layout the times were measured with (``stock`` or ``weight-major``,
            see :mod:`specgraft.kernels.linear`); profiles written before it existed read as ``stock``.
        attention_kernel: the target's decode-time attention (``stock`` or ``exact``, see
            :mod:`specgraft.kernels.exact_attention`); older profiles read as ``stock``.
    """

    device: str
    device_name: str
    dtype: str
    threads: int
    torch_version: str
    target: dict[str, Any]
    kv_length: int
    step_s: dict[str, dict[int, float]]
    bookkeeping_s: dict[str, dict[int, float]] = field(default_factory=dict)
    forward_s: dict[int, float] = field(default_factory=dict)
    drafters: dict[str, dict[str, Any]] = field(default_factory=dict)
    linear_kernel: str = "stock"
    attention_kernel: str = "stock"
    version: int = PROFILE_VERSION

    # -- serialisation -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("step_s", "bookkeeping_s"):
            out[name] = {mode: {str(n): s for n, s in table.items()} for mode, table in getattr(self, name).items()}
        out["forward_s"] = {str(n): s for n, s in self.forward_s.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the cost profile") -> CostProfile:
        fix = "re-run `specgraft profile` to measure a complete profile"
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise SpecgraftError(f"{where} lacks {', '.join(missing)}; {fix}")
        _check_fields(data, where, fix)
        try:
            step, bookkeeping = (_mode_tables(data.get(name) or {}) for name in ("step_s", "bookkeeping_s"))
            if not step.get("chain") or 1 not in step["chain"]:
                raise ValueError("step_s.chain has no 1-token step")
            return cls(device=str(data["device"]), device_name=str(data.get("device_name", data["device"])),
                       dtype=str(data["dtype"]), threads=int(data["threads"]),
                       torch_version=str(data["torch_version"]), target=dict(data["target"]),
                       kv_length=int(data["kv_length"]), step_s=step, bookkeeping_s=bookkeeping,
                       forward_s={int(n): float(s) for n, s in (data.get("forward_s") or {}).items()},
                       drafters=dict(data.get("drafters") or {}),
                       linear_kernel=str(data.get("linear_kernel", "stock")),
                       attention_kernel=str(data.get("attention_kernel", "stock")), version=int(data["version"]))
        except (TypeError, ValueError, AttributeError) as exc:
            raise SpecgraftError(f"{where} has malformed fields ({exc}); {fix}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        file = Path(path)
        require_file(file, "cost profile", f"measure one with `specgraft profile --target ... --out {file}`")
        return cls.from_dict(read_json_meta(file, (), "re-run `specgraft profile`"), where=str(file))

    # -- queries -------------------------------------------------------------------------------------------
    @property
    def plain_step_s(self) -> float:
        """One plain decoding step (1 token verified, no draft) with the stock kernels: the baseline of every
        predicted speedup (profiles written before this rule timed it with ``attention_kernel``)."""
        return self.step_s["chain"][1]

    def step_cost(self, tokens: int, tree: bool) -> float:
        """Seconds of a decoder step verifying ``tokens`` tokens (root included), linear between measurements."""
        table = self.step_s.get(_mode(tokens, tree)) or self.step_s["chain"]
        return _interpolate(table, tokens, "tokens verified")

    def step_prediction(self, tokens: int, tree: bool) -> dict[str, Any]:
        """A tuning prediction's step fields: ``step_s`` (:meth:`step_cost`) and what it verifies
        (``verified_tokens``, ``tree``), by which :func:`specgraft.tuning.tune.step_overhead` finds its parts."""
        return {"step_s": self.step_cost(tokens, tree), "verified_tokens": int(tokens), "tree": bool(tree)}

    def bookkeeping_cost(self, tokens: int, tree: bool) -> float | None:
        """The part of :meth:`step_cost` outside the verification forward and its verdict (linear between
        measurements), or None when the profile did not measure it."""
        table = self.bookkeeping_s.get(_mode(tokens, tree))
        return _interpolate(table, tokens, "tokens verified") if table else None

    def drafter(self, label: str) -> dict[str, Any]:
        if label not in self.drafters:
            known = ", ".join(self.drafters) or "none"
            raise SpecgraftError(f"the cost profile has no drafter {label!r} (it has: {known}); re-run "
                                 "`specgraft profile` with that --head/--draft")
        return self.drafters[label]

    def summary(self) -> dict[str, Any]:
        """What tuned.json and model cards record about the device."""
        return {"device": self.device, "device_name": self.device_name, "dtype": self.dtype,
                "threads": self.threads, "torch_version": self.torch_version, "kv_length": self.kv_length,
                "target": self.target.get("name_or_path"), "plain_step_ms": round(self.plain_step_s * 1e3, 4),
                "linear_kernel": self.linear_kernel, "attention_kernel": self.attention_kernel}


def _mode(tokens: int, tree: bool) -> str:
    """The table a step of ``tokens`` tokens is read from: a root and one node are a chain, tree or not."""
    return "tree" if tree and tokens > 2 else "chain"


#: The time tables of a profile's drafter section (seconds, each > 0).
DRAFTER_TABLES = ("per_call_s", "chain_s", "tree_s", "catchup_s")


def _check_fields(data: dict[str, Any], where: str, fix: str) -> None:
    """The profile's schema: sections of the right JSON type, every time a finite number (> 0 for whole steps and
    forwards, >= 0 for their parts), counts >= 1."""
    for name in ("step_s", "bookkeeping_s", "forward_s", "drafters", "target"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise SpecgraftError(f"{where}: {name} is {type(data[name]).__name__}, not an object; {fix}")
    for name in ("step_s", "bookkeeping_s"):
        for mode, table in (data.get(name) or {}).items():
            if not isinstance(table, dict):
                raise SpecgraftError(f"{where}: {name}.{mode} is {type(table).__name__}, not an object; {fix}")
    # A step or forward takes time (every speed divides by it); the parts of one (bookkeeping, a draft call that
    # rounds to nothing) may be 0.
    for name in ("step_s", "forward_s"):
        check_number_tree(data.get(name) or {}, f"{where}: {name}", fix, low_open=True)
    check_number_tree(data.get("bookkeeping_s") or {}, f"{where}: bookkeeping_s", fix)
    for label, section in (data.get("drafters") or {}).items():
        if not isinstance(section, dict):
            raise SpecgraftError(f"{where}: drafters.{label} is {type(section).__name__}, not an object; {fix}")
        for table in DRAFTER_TABLES:
            if section.get(table) is not None:
                check_number_tree(section[table], f"{where}: drafters.{label}.{table}", fix)
    for name in ("kv_length", "threads"):
        check_number(data.get(name), f"{where}: {name}", fix, low=1)


def _mode_tables(raw: dict[str, Any]) -> dict[str, dict[int, float]]:
    """``{"chain": {n: s}, ...}`` from its JSON form (string keys)."""
    return {str(mode): {int(n): float(s) for n, s in table.items()} for mode, table in raw.items()}


def _interpolate(table: dict[int, float], x: int, what: str) -> float:
    keys = sorted(table)
    if x in table:
        return table[x]
    if x < keys[0] or x > keys[-1]:
        raise SpecgraftError(f"the cost profile measured {what} {keys[0]}..{keys[-1]}, not {x}; re-run "
                             "`specgraft profile` with --token-counts covering it")
    hi = next(k for k in keys if k > x)
    lo = max(k for k in keys if k < x)
    w = (x - lo) / (hi - lo)
    return table[lo] * (1 - w) + table[hi] * w


def device_description(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def check_profile(profile: CostProfile, target_identity: dict[str, Any] | None, device: str | None,
                  threads: int | None = None, linear_kernel: str | None = None,
                  attention_kernel: str | None = None) -> list[str]:
    """Warnings (each naming both sides) when ``profile`` was measured for another target or device."""
    warnings: list[str] = []
    if target_identity is not None:
        mine = profile.target
        fields = ("architecture", "hidden_size", "vocab_size", "num_hidden_layers")
        diffs = [f"{k} {mine.get(k)} vs {target_identity.get(k)}" for k in fields
                 if mine.get(k) is not None and mine.get(k) != target_identity.get(k)]
        if diffs:
            warnings.append(f"the cost profile was measured for target {mine.get('name_or_path')} but this target is "
                            f"{target_identity.get('name_or_path')} ({'; '.join(diffs)}); predictions use the other "
                            "target's costs")
    if device is not None:
        here = f"{device} ({device_description(device)}" + (f", {threads} threads)" if threads else ")")
        there = f"{profile.device} ({profile.device_name}, {profile.threads} threads)"
        same_kind = profile.device.split(":")[0] == str(device).split(":")[0]
        if not same_kind or profile.device_name != device_description(device) or \
                (threads is not None and threads != profile.threads):
            warnings.append(f"the cost profile was measured on {there} but this run is on {here}; the predicted "
                            "speed is for the profile's device")
    if linear_kernel is not None and linear_kernel != profile.linear_kernel:
        warnings.append(f"the cost profile was measured with the {profile.linear_kernel} linear kernel but this run "
                        f"uses {linear_kernel}; re-run `specgraft profile` with --linear-kernel {linear_kernel}, or "
                        f"pass --linear-kernel {profile.linear_kernel} here")
    if attention_kernel is not None and attention_kernel != profile.attention_kernel:
        warnings.append(f"the cost profile was measured with the {profile.attention_kernel} attention kernel but this "
                        f"run uses {attention_kernel}; re-run `specgraft profile` with --attention-kernel "
                        f"{attention_kernel}, or pass --attention-kernel {profile.attention_kernel} here")
    return warnings


# -- measuring ---------------------------------------------------------------------------------------------------
def _median_time(fn: Callable[[], Any], calls: int, sync: Callable[[], None],
                 before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn()`` over ``calls`` timed calls; ``before()`` runs, untimed, ahead of each one."""
    fn()  # warm-up
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync_fn(device: Any) -> Callable[[], None]:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _context_of(model: Any) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)


def check_fits(model: Any, kv_length: int, max_tokens: int, extra: int = LONG_STEPS) -> None:
    """Refuse a measurement (or tree) that would not fit the target's context."""
    context = _context_of(model)
    needed = kv_length + max_tokens + extra
    if context is not None and needed > context:
        raise SpecgraftError(f"verifying {max_tokens} tokens after a KV length of {kv_length} (plus {extra} decoding "
                             f"steps) needs {needed} positions but the target's context is {context}; lower "
                             "--kv-length or the largest --token-counts/tree size")


def _random_prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    # Skip the lowest ids (special tokens in most vocabularies) so the prompt is ordinary text-like ids.
    low = min(4, vocab - 1)
    return torch.randint(low, vocab, (length,), generator=gen).tolist()


class _FixedDrafter(Drafter):
    """A zero-cost drafter: the same ``size`` random tokens every step (a chain or a depth-1 fan).

    Like the real drafters it reports a q row per node and asks for the target's last hidden state, so the step
    pays the decoder's per-node work on q and the hidden-state outputs, as a head-drafted step does."""

    def __init__(self, size: int, tree: bool, vocab: int, device: Any, num_layers: int) -> None:
        import torch

        self.needs_hidden_states = (num_layers,)
        tokens = torch.tensor(_random_prompt(vocab, size, seed=1), dtype=torch.long, device=device)
        q = torch.full((size, vocab), 1.0 / vocab, device=device)  # [n, V]
        if tree:
            self._tree = DraftTree(tokens=tokens, parents=torch.full((size,), -1, dtype=torch.long, device=device),
                                   q=q, sampled=False)
        else:
            self._tree = DraftTree.chain(tokens, q=q, sampled=False)

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self._tree


def measure_steps(model: Any, kv_length: int, token_counts: Sequence[int], repeats: int,
                  ref: _Reference) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """``({"chain": {n: r}, "tree": {n: r}}, bookkeeping)``: decoder step time verifying n tokens, in units of
    ``ref``, and the part of it outside the verification forward and its verdict (the decoder's own work: tree,
    mask, KV rollback), same keys.

    Each measurement of ``n`` tokens is paired with a plain step measured right before it (and the plain step with
    the reference forward), and medians of the ratios are kept: on a shared machine the load drifts, and pairing
    cancels it the way the eval's interleaved baseline does."""
    vocab = int(text_config(model).vocab_size)
    device = model_device(model)
    prompt = _random_prompt(vocab, kv_length)

    def slope(decoder: SpeculativeDecoder, n: int = 1) -> tuple[float, float] | None:
        # The decoder prunes drafts deeper than remaining - 1 tokens, so a chain of n - 1 nodes is verified whole
        # only while n or more tokens remain: both runs leave n, and their difference is steps of exactly n tokens
        # (random drafts are rejected, so each step emits one token). Returns (step, its non-verify part).
        short = decoder.generate(prompt, n + SHORT_STEPS)
        long = decoder.generate(prompt, n + LONG_STEPS)
        steps = long.num_steps - short.num_steps
        if steps <= 0:
            return None
        step = (long.wall_time_s - short.wall_time_s) / steps

        def rest(r: Any) -> float:  # the run outside its prefill and verification: only bookkeeping is left
            return r.wall_time_s - r.prefill_time_s - r.verify_time_s

        return step, (rest(long) - rest(short)) / steps

    # The plain step is the eval's baseline: plain decoding with the stock kernels (the user's own), or with the
    # switched kernels when they run it faster (evaluation.report.summarize_records), so the speedups predicted here
    # are the ones an eval measures. Verification ratios are taken against it: against a slower stock step every
    # small verification would read as costing no more than plain decoding (the ratios are floored at 1).
    with stock_kernels(model):
        plain = SpeculativeDecoder(model, None, drafter=None, ignore_eos=True)
    kernel_plain = (SpeculativeDecoder(model, None, drafter=None, ignore_eos=True)
                    if kernel_setting(model) != "stock" else None)

    def plain_slope() -> tuple[float, float] | None:
        with stock_kernels(model):
            stock = slope(plain)
        own = slope(kernel_plain) if kernel_plain is not None else None
        timed = [s for s in (stock, own) if s is not None]
        return min(timed, key=lambda s: s[0]) if timed else None

    layers = int(text_config(model).num_hidden_layers)
    decoders = {(mode, int(n)): SpeculativeDecoder(
        model, None, drafter=_FixedDrafter(n - 1, mode == "tree", vocab, device, layers), ignore_eos=True)
                for mode in ("chain", "tree") for n in token_counts if n > (2 if mode == "tree" else 1)}
    plain_slope()  # warm-up
    for decoder in decoders.values():
        decoder.generate(prompt, SHORT_STEPS)  # warm-up
    plain_times: list[float] = []
    ratios: dict[tuple[str, int], list[float]] = {key: [] for key in decoders}
    bookkeeping: dict[tuple[str, int], list[float]] = {("chain", 1): [], **{key: [] for key in decoders}}
    for _ in range(repeats):
        for key, decoder in decoders.items():
            unit = ref.time()
            base, step = plain_slope(), slope(decoder, key[1] if key[0] == "chain" else 1)
            if base is not None and base[0] > 0:
                plain_times.append(base[0] / unit)
                bookkeeping["chain", 1].append(base[1] / base[0])
                if step is not None:
                    ratios[key].append(step[0] / base[0])
                    bookkeeping[key].append(step[1] / base[0])
    if not plain_times:
        raise SpecgraftError("could not time a plain decoding step (the decoder stopped early); raise --kv-length "
                             "headroom or check the target")
    plain_s = statistics.median(plain_times)
    parts: dict[str, dict[int, float]] = {"chain": {}, "tree": {}}
    for (mode, n), values in bookkeeping.items():
        if values:
            parts[mode][n] = max(statistics.median(values), 0.0) * plain_s
    return step_table(plain_s, ratios), parts


def step_table(plain_s: float, ratios: dict[tuple[str, int], list[float]]) -> dict[str, dict[int, float]]:
    """``{"chain": {n: s}, "tree": {n: s}}`` from the plain step and each ``(mode, n)``'s step / plain ratios.

    Verifying n >= 2 tokens is the one-token forward with more rows, so it never costs less than a plain step: a
    median ratio below 1 is drift between the paired runs (or a plain step slowed by the BLAS's one-row product) and
    is read as 1, so the tuner does not over-predict every small tree. Each table is then made
    non-decreasing in n (:func:`~specgraft.tuning.search.monotone`)."""
    out: dict[str, dict[int, float]] = {"chain": {1: plain_s}, "tree": {}}
    for (mode, n), values in ratios.items():
        if values:
            out[mode][n] = max(statistics.median(values), 1.0) * plain_s
    return {mode: monotone(table) for mode, table in out.items()}


class _Reference:
    """A bare one-token target forward timed next to each drafter measurement: drafter costs are kept as ratios
    to it (times its overall median), so load drift between settings cancels."""

    def __init__(self, model: Any, kv_length: int, calls: int) -> None:
        import torch

        self.model, self.kv_length, self.calls = model, kv_length, calls
        self.cache = kv.new_cache()
        vocab = int(kv.text_config(model).vocab_size)
        self.ids = torch.tensor([_random_prompt(vocab, kv_length + 1)], device=kv.model_device(model))
        self.sync = _sync_fn(kv.model_device(model))
        with torch.no_grad():
            model(input_ids=self.ids[:, :kv_length], cache=self.cache, use_cache=True, logits_to_keep=1)
        self.samples: list[float] = []

    def forward(self) -> None:
        """One untimed one-token target forward (the KV cache is cut back after it)."""
        import torch

        with torch.no_grad():
            self.model(input_ids=self.ids[:, self.kv_length:], cache=self.cache, use_cache=True)
        kv.crop_cache(self.cache, self.kv_length)

    def time(self) -> float:
        value = _median_time(self.forward, self.calls, self.sync)
        self.samples.append(value)
        return value

    def relative(self, measure: Callable[[], float]) -> float:
        """``measure()`` as a ratio to the reference timed just before it."""
        ref = self.time()
        return measure() / ref

    def scale(self, table: dict[Any, Any]) -> dict[Any, Any]:
        """Ratios (nested tables too) -> seconds, at the median reference over the whole measurement."""
        median = statistics.median(self.samples)
        return {key: self.scale(value) if isinstance(value, dict) else value * median for key, value in table.items()}


def measure_forwards(model: Any, kv_length: int, token_counts: Sequence[int], repeats: int) -> dict[int, float]:
    """``{n: s}``: the bare target forward of n tokens on a kv_length cache."""
    import torch

    vocab = int(kv.text_config(model).vocab_size)
    device = kv.model_device(model)
    sync = _sync_fn(device)
    cache = kv.new_cache()
    prompt = torch.tensor([_random_prompt(vocab, kv_length + max(token_counts))], device=device)
    with torch.no_grad():
        model(input_ids=prompt[:, :kv_length], cache=cache, use_cache=True, logits_to_keep=1)
        out = {}
        for n in token_counts:
            def step(n: int = n) -> None:
                model(input_ids=prompt[:, kv_length: kv_length + n], cache=cache, use_cache=True)
                kv.crop_cache(cache, kv_length)
            out[int(n)] = _median_time(step, repeats, sync)
    return out


def _draft_context(model: Any, prompt: list[int], needs: Sequence[int], full: bool) -> Any:
    """A DraftContext after ``prompt``: all hidden states (``full``) or only the last position's."""
    import torch

    device = kv.model_device(model)
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    hidden: dict[int, torch.Tensor] = {}
    if needs:
        with torch.no_grad():
            out = model(input_ids=ids[None, :-1], output_hidden_states=True, logits_to_keep=1)
        hidden = {int(i): out.hidden_states[int(i)][0] for i in needs}
    start = 0
    if not full:
        start = len(prompt) - 2
        hidden = {i: h[-1:] for i, h in hidden.items()}
    return DraftContext(token_ids=ids, prompt_length=len(prompt), hidden_start=start, hidden_states=hidden,
                        max_depth=1 << 20, remaining_tokens=1 << 20)


def _time_propose(drafter: Any, model: Any, prompt: list[int], calls: int, ref: _Reference) -> float:
    """Median seconds of one ``propose`` + ``accept``, each timed right after a target forward, as in decoding.

    Timed back to back instead, a small drafter keeps its weights and activations in the CPU's caches and runs
    faster than it does between the target's forwards, so the tuner would under-charge drafting."""
    needs = tuple(int(i) for i in drafter.needs_hidden_states)
    drafter.bind(model)
    drafter.reset()
    drafter.propose(_draft_context(model, prompt, needs, full=True))  # catch up on the whole prompt once
    ctx = _draft_context(model, prompt, needs, full=False)
    def step() -> None:
        drafter.propose(ctx)
        drafter.accept([], 0)  # the eval's drafting time includes the verdict's bookkeeping

    return _median_time(step, calls, _sync_fn(model_device(model)), before=ref.forward)


def measure_head(head: Any, head_type: str, model: Any, kv_length: int, calls: int,
                 ref: _Reference) -> dict[str, Any]:
    """A drafter section for a Medusa or EAGLE head (see the module docstring), in units of ``ref``."""
    prompt = _random_prompt(int(text_config(model).vocab_size), kv_length)

    def timed(drafter: Any) -> float:
        return ref.relative(lambda: _time_propose(drafter, model, prompt, calls, ref))

    search = get_family(head_type).search
    if search is None:
        raise SpecgraftError(f"{head_type} heads have no tunable drafting settings to profile; evaluate them with "
                             "`specgraft eval` at their defaults")
    # The family's search measures its own settings (Medusa: per heads and tree nodes; EAGLE: per depth and top-k;
    # DFlash: one block forward per width).
    return search.profile_drafter(head, timed)


def measure_draft_model(draft: Any, model: Any, kv_length: int, calls: int, ref: _Reference) -> dict[str, Any]:
    prompt = _random_prompt(int(text_config(model).vocab_size), kv_length)
    chain = {str(k): ref.relative(lambda k=k: _time_propose(DraftModelDrafter(draft, k=k), model, prompt, calls, ref))
             for k in DRAFT_MODEL_KS}
    chain = {str(k): v for k, v in monotone({int(k): v for k, v in chain.items()}).items()}
    # Each step the draft first catches up on the accepted tokens and the bonus (one here): the cost of catching up
    # on c tokens lets the tuner charge the expected number instead.
    unit = ref.time()
    catchup = {str(c): t / unit for c, t in monotone(measure_forwards(draft, kv_length, CATCHUP_TOKENS,
                                                                      calls)).items()}
    return {"kind": draft_model_search().kind, "chain_s": chain, "catchup_s": catchup}


def check_measure_args(kv_length: int | None, repeats: int = DEFAULT_REPEATS) -> None:
    """Refuse a KV length below 2 or a repeat count outside [1, MAX_REPEATS] (checked before anything loads)."""
    if kv_length is not None and kv_length < 2:
        raise SpecgraftError(f"--kv-length must be at least 2, got {kv_length}; pass your typical prompt + answer "
                             "length")
    if not 1 <= repeats <= MAX_REPEATS:
        raise SpecgraftError(f"--repeats must be in [1, {MAX_REPEATS}], got {repeats}")


def measure_profile(target: Any, *, device: str, dtype: str, threads: int, kv_length: int = DEFAULT_KV_LENGTH,
                    token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, repeats: int = DEFAULT_REPEATS,
                    heads: Sequence[tuple[str, Any, str]] = (), drafts: Sequence[tuple[str, Any]] = (),
                    draft_calls: int = DRAFT_CALLS, linear_kernel: str = "stock") -> CostProfile:
    """Measure a :class:`CostProfile` for ``target`` (a Target) and the given heads ``(label, head, head_type)``
    and draft models ``(label, model)``; ``linear_kernel`` names the kernel the modules were switched to (recorded,
    not applied: see :func:`specgraft.kernels.linear.apply_linear_kernel`)."""
    import torch

    counts = sorted({int(n) for n in token_counts})
    if not counts or counts[0] < 1:
        raise SpecgraftError(f"--token-counts must be positive integers, got {list(token_counts)}")
    if 1 not in counts:
        counts = [1] + counts
    check_measure_args(kv_length, repeats)
    model = target.model
    check_fits(model, kv_length, max(counts), extra=max(counts) + LONG_STEPS)
    logger.info("measuring decoder steps for %s tokens at KV length %d", counts, kv_length)
    # Every time is measured as a ratio to a bare one-token forward timed next to it, and scaled back with that
    # forward's median over the whole run, so steps and drafters share one time base despite load drift.
    ref = _Reference(model, kv_length, draft_calls)
    step, bookkeeping = measure_steps(model, kv_length, counts, repeats, ref)
    forward = measure_forwards(model, kv_length, counts, repeats)
    drafters: dict[str, dict[str, Any]] = {}
    tables = DRAFTER_TABLES
    for label, head, head_type in heads:
        logger.info("measuring the %s drafter", label)
        drafters[label] = {**measure_head(head, head_type, model, kv_length, draft_calls, ref), "path": label}
    for label, draft in drafts:
        logger.info("measuring the draft model %s", label)
        drafters[label] = {**measure_draft_model(draft, model, kv_length, draft_calls, ref), "path": label}
    step, bookkeeping = ref.scale(step), ref.scale(bookkeeping)
    for section in drafters.values():
        for table in tables:
            if table in section:
                section[table] = ref.scale(section[table])
    return CostProfile(device=str(device), device_name=device_description(str(device)), dtype=str(dtype),
                       threads=int(threads), torch_version=str(torch.__version__), target=target.identity.to_dict(),
                       kv_length=int(kv_length), step_s=step, bookkeeping_s=bookkeeping, forward_s=forward,
                       drafters=drafters,
                       linear_kernel=str(linear_kernel), attention_kernel=attention_kernel_of(model))
