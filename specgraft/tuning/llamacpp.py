"""Tune speculative decoding for llama.cpp: the engine's own step costs, its own acceptance, its own measured speed.

``specgraft profile --engine llamacpp`` and ``specgraft tune --engine llamacpp`` run the pinned llama.cpp build
(``llama-server``, :mod:`specgraft.export.llamacpp_engine`) with the target GGUF and a ``--format llamacpp`` draft:

* **Costs** (:func:`measure_costs`, on a seeded random prompt, so the costs do not depend on the user's prompts):
  plain decoding's milliseconds per token, and for every draft length ``K`` the milliseconds per speculative step
  (one draft call of ``K`` tokens, one verification of ``K + 1`` rows by the target, and the engine's bookkeeping).
  Each comes from ``llama-server``'s own ``timings.predicted_ms`` of a server started with the exact serve flags;
  the step count from its per-step ``accepted A/D draft tokens`` log lines. The draft call alone is the engine's
  own draft timer (``dur(b,g,a)`` of its speculative statistics, printed only at ``-lv 4``, so it is read from a
  second server per ``K`` whose extra logging never touches the step costs); verification is the step minus it.
* **Acceptance** is calibrated in llama.cpp itself: one run at the longest draft length on the calibration prompts,
  counting per draft position how often the engine accepted it (its per-step log lines, over the steps that drafted
  the full length). Not specgraft's own eval: the engine serves a GGUF target (often quantized) with ggml kernels,
  and what it accepts is what the speed depends on. A greedy chain's first ``k`` draft tokens do not depend on the
  draft length, so ``tau(K) = 1 + sum_{i<K} a_i`` predicts every shorter length from that one run.
  The calibration run serves plain decoding beside it, which also calibrates the step cost: real prompts accept more
  than the profile's random one, and each accepted token costs the engine a little more per step, so the
  calibration step's cost in plain tokens minus the profile's at the same length (never below 0: a negative
  difference is timing noise) is added to every length's step.
* **Prediction**: ``speedup(K) = tau(K) / (step(K) / plain)``, step and plain in the same run (a ratio, so a busy
  machine's drift cancels); the fastest ``K`` is chosen, or plain decoding when none beats plain by
  ``--min-speedup``. ``step(K) / plain`` is the **break-even acceptance length** of ``K``: the tau at which it
  only matches plain decoding.
* **Confirmation**: plain decoding and the chosen ``K`` (when plain is chosen: the predicted best ``K``, to show
  that it does not pay) served side by side, the prompts interleaved, the measured speeds next to the predicted.

The tuned record (``tuned-llamacpp.json``) goes beside the head or draft folder; ``specgraft export --format
llamacpp`` reads it for the card's serve flags (``--spec-draft-n-max``).
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.tuning.settings import LLAMACPP_MAX_DRAFT, LLAMACPP_NEW_TOKENS, LLAMACPP_ROUNDS

#: The llama.cpp tuned record beside a head / draft folder (``tuned.json`` is specgraft's own decoder's).
LLAMACPP_TUNED_NAME = "tuned-llamacpp.json"
PROFILE_KIND = "llamacpp-cost-profile"
PROFILE_VERSION = 1
#: Draft-model architecture -> llama.cpp ``--spec-type`` (any other architecture: a plain draft model).
PLAIN_DRAFT_SPEC_TYPE = "draft-simple"
_DRAFT_STATS = re.compile(r"statistics\s+\S+: #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+).*?"
                          r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


# -- what one configuration did --------------------------------------------------------------------------------------
@dataclass
class EngineTotals:
    """Totals of one llama-server configuration over its requests (the engine's own counters)."""

    tokens: int = 0
    decode_ms: float = 0.0
    steps: int = 0
    """Verification steps (one ``accepted A/D`` line each)."""
    accepted: int = 0
    drafted: int = 0
    draft_ms: float = 0.0
    """The engine's draft timer (servers at ``-lv 4`` only)."""
    draft_calls: int = 0
    full_steps: int = 0
    """Steps that drafted the configured length (acceptance per position is counted over these)."""
    accepted_at: list[int] = field(default_factory=list)
    """Per draft position: full-length steps that accepted it."""

    def add(self, timings: Mapping[str, Any], steps: Sequence[tuple[int, int]], draft_length: int) -> None:
        self.tokens += int(timings.get("predicted_n", 0))
        self.decode_ms += float(timings.get("predicted_ms", 0.0))
        self.steps += len(steps)
        self.accepted += sum(a for a, _ in steps)
        self.drafted += sum(d for _, d in steps)
        if len(self.accepted_at) < draft_length:
            self.accepted_at += [0] * (draft_length - len(self.accepted_at))
        for accepted, drafted in steps:
            if drafted == draft_length:
                self.full_steps += 1
                for i in range(min(accepted, draft_length)):
                    self.accepted_at[i] += 1

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    @property
    def plain_tokens(self) -> int:
        """Tokens decoded without a draft (the first comes from the prompt pass; near the end no draft fits)."""
        return max(0, self.tokens - 1 - self.steps - self.accepted)

    def acceptance_per_position(self) -> list[float]:
        return [n / self.full_steps for n in self.accepted_at] if self.full_steps else []


# -- the cost profile ------------------------------------------------------------------------------------------------
@dataclass
class LlamacppProfile:
    """llama.cpp's step costs on one machine for one target GGUF + draft GGUF pair."""

    target_gguf: str
    draft_gguf: str
    spec_type: str
    threads: int
    cpu: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    plain_ms: float
    """Plain decoding, milliseconds per token."""
    step_ms: dict[int, float]
    """Draft length K -> milliseconds per speculative step (draft call + verification of K + 1 rows)."""
    draft_ms: dict[int, float] = field(default_factory=dict)
    """Draft length K -> milliseconds per draft call (the engine's own timer)."""
    engine: str = ""

    def verify_ms(self, k: int) -> float | None:
        """Milliseconds of a step spent outside the draft call (verification of K + 1 rows and bookkeeping)."""
        return self.step_ms[k] - self.draft_ms[k] if k in self.draft_ms else None

    def break_even_tau(self, k: int) -> float:
        """The acceptance length (tokens per step) at which draft length ``k`` only matches plain decoding."""
        return self.step_ms[k] / self.plain_ms

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"], out["version"] = PROFILE_KIND, PROFILE_VERSION
        out["step_ms"] = {str(k): v for k, v in self.step_ms.items()}
        out["draft_ms"] = {str(k): v for k, v in self.draft_ms.items()}
        out["verify_ms"] = {str(k): self.verify_ms(k) for k in self.step_ms}
        out["break_even_tau"] = {str(k): round(self.break_even_tau(k), 4) for k in self.step_ms}
        return out

    def save(self, path: Path) -> None:
        from specgraft.utils.io import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> LlamacppProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SpecgraftError(f"cannot read the llama.cpp cost profile {path}: {exc}; measure one with "
                                 "`specgraft profile --engine llamacpp`") from None
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise SpecgraftError(f"{path} is not a llama.cpp cost profile (kind {PROFILE_KIND!r}); measure one with "
                                 "`specgraft profile --engine llamacpp`")
        try:
            return cls(target_gguf=str(data["target_gguf"]), draft_gguf=str(data["draft_gguf"]),
                       spec_type=str(data["spec_type"]), threads=int(data["threads"]), cpu=str(data["cpu"]),
                       prompt_tokens=int(data["prompt_tokens"]), new_tokens=int(data["new_tokens"]),
                       rounds=int(data["rounds"]), plain_ms=float(data["plain_ms"]),
                       step_ms={int(k): float(v) for k, v in data["step_ms"].items()},
                       draft_ms={int(k): float(v) for k, v in (data.get("draft_ms") or {}).items()},
                       engine=str(data.get("engine", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecgraftError(f"{path} lacks a field of a llama.cpp cost profile ({exc}); measure it again with "
                                 "`specgraft profile --engine llamacpp`") from None


# -- prediction and choice (pure: unit-tested with recorded costs) -------------------------------------------------
@dataclass
class Prediction:
    draft_tokens: int
    tau: float
    step_ms: float
    tokens_per_s: float
    speedup: float
    break_even_tau: float


def expected_tau(acceptance_per_position: Sequence[float], k: int) -> float:
    """Tokens per step of a greedy chain of ``k`` draft tokens: 1 + the acceptance rates of its positions."""
    if k > len(acceptance_per_position):
        raise SpecgraftError(f"acceptance is calibrated for draft lengths up to {len(acceptance_per_position)}, "
                             f"not {k}; calibrate at the longest draft length you search")
    return 1.0 + float(sum(acceptance_per_position[:k]))


def predict(profile: LlamacppProfile, acceptance_per_position: Sequence[float], step_offset: float = 0.0,
            plain_ms: float | None = None) -> list[Prediction]:
    """Predicted speed of every profiled draft length (ascending K).

    A step costs ``profile.step_ms[K] / profile.plain_ms + step_offset`` plain tokens (the offset: what the
    calibration run's steps cost beyond the profile's, see :func:`step_offset_of`); ``plain_ms``: plain decoding's
    milliseconds per token on the prompts (default: the profile's)."""
    plain_ms = profile.plain_ms if plain_ms is None else plain_ms
    out = []
    for k in sorted(profile.step_ms):
        if k > len(acceptance_per_position):
            continue
        tau = expected_tau(acceptance_per_position, k)
        step_in_plain_tokens = profile.break_even_tau(k) + step_offset
        speedup = tau / step_in_plain_tokens
        out.append(Prediction(k, round(tau, 4), round(step_in_plain_tokens * plain_ms, 4),
                              round(1000.0 * speedup / plain_ms, 3), round(speedup, 4),
                              round(step_in_plain_tokens, 4)))
    return out


def step_offset_of(profile: LlamacppProfile, calibration: EngineTotals, plain: EngineTotals) -> tuple[float, float]:
    """(step offset in plain tokens, plain milliseconds per token) from the calibration run on the prompts: its
    speculative step at the longest draft length, in plain tokens of the plain run beside it, minus the profile's.
    The profile's random prompt is drafted and accepted rarely; real prompts accept more, and each accepted token
    costs the engine a little more work per step (the draft's pass over the accepted rows, their sampling). Measured
    as a ratio to plain decoding in the same run, so a machine's load drifts out; never below 0."""
    n = max(profile.step_ms)
    plain_ms = plain.decode_ms / max(plain.tokens, 1)
    if calibration.steps == 0:
        return 0.0, plain_ms
    step_ms = (calibration.decode_ms - calibration.plain_tokens * plain_ms) / calibration.steps
    # One-sided: accepting more never makes a step cheaper, so a negative difference is timing noise.
    return max(0.0, step_ms / plain_ms - profile.break_even_tau(n)), plain_ms


def choose(predictions: Sequence[Prediction], min_speedup: float = 1.0) -> Prediction | None:
    """The fastest draft length, or None (plain decoding) when none is predicted ``min_speedup`` times as fast."""
    best = max(predictions, key=lambda p: p.tokens_per_s, default=None)
    return best if best is not None and best.speedup >= min_speedup else None


def does_not_pay(predictions: Sequence[Prediction], acceptance_per_position: Sequence[float]) -> str:
    """Why no draft length pays: each length's acceptance vs the acceptance length it would need."""
    best = min(predictions, key=lambda p: p.break_even_tau - p.tau)
    why = (f"speculation does not pay in llama.cpp here: at every draft length a step costs more than the tokens "
           f"it yields (closest: K={best.draft_tokens} yields tau {best.tau:.2f} tokens per step but needs "
           f"{best.break_even_tau:.2f} to match plain decoding, a step costing {best.break_even_tau:.2f} plain "
           f"tokens); measured acceptance per position {[round(a, 3) for a in acceptance_per_position]}")
    if all(p.break_even_tau >= p.draft_tokens + 1 for p in predictions):
        why += ("; a step of K drafts costs more than K + 1 plain tokens at every K, so even a draft accepted every "
                "time would not pay: verifying several rows at once is no cheaper per row than decoding them here")
    return why


# -- checks -----------------------------------------------------------------------------------------------------------
def draft_spec_type(draft_gguf: Path) -> str:
    """llama.cpp's ``--spec-type`` for a draft GGUF (by its architecture)."""
    from specgraft.gguf import inspect_gguf
    from specgraft.heads.registry import family_names, get_family

    # Our llama.cpp exports name their GGUF architecture after the family (``eagle3``, ``dflash``); any other
    # architecture is a plain draft model.
    architecture = inspect_gguf(draft_gguf)
    card = get_family(architecture).card if architecture in family_names() else None
    return (card.llamacpp_spec_type if card is not None else None) or PLAIN_DRAFT_SPEC_TYPE


def check_draft_for_target(draft_gguf: Path, target_gguf: Path) -> None:
    """Refuse a draft GGUF that does not carry the target GGUF's tokenizer (every ``--format llamacpp`` export does):
    llama.cpp would either refuse it or draft tokens of another vocabulary."""
    import gguf

    from specgraft.export.llamacpp import read_target_gguf

    target = read_target_gguf(target_gguf)
    reader = gguf.GGUFReader(str(draft_gguf))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpecgraftError(f"{draft_gguf} carries no tokenizer, so it is not a `--format llamacpp` draft; export the "
                             f"head with `specgraft export HEAD --format llamacpp --target-gguf {target_gguf}`")
    draft_tokens = [str(t) for t in tokens.contents()]
    if draft_tokens != target.tokens:
        differ = sum(a != b for a, b in zip(draft_tokens, target.tokens)) + abs(len(draft_tokens) - len(target.tokens))
        raise SpecgraftError(f"{draft_gguf} is not a draft for {target_gguf}: its tokenizer differs ({differ} "
                             f"token(s)); export the head for this target with `specgraft export HEAD --format "
                             f"llamacpp --target-gguf {target_gguf}`")
    arch = str(reader.fields["general.architecture"].contents())
    # A feature-reading draft (EAGLE-3, DFlash) also names the target's sizes: a same-tokenizer sibling model of
    # another size is not its target.
    hidden = reader.fields.get(f"{arch}.target_hidden_size")
    if hidden is not None and int(hidden.contents()) != target.hidden_size:
        raise SpecgraftError(f"{draft_gguf} reads {int(hidden.contents())}-wide target features, but {target_gguf} "
                             f"is {target.hidden_size} wide: it is a draft for another target")
    layers = reader.fields.get(f"{arch}.target_layers")
    if layers is not None:
        ids = [int(i) for i in layers.contents()]
        if ids and max(ids) > target.block_count:
            raise SpecgraftError(f"{draft_gguf} reads target layer {max(ids)}, but {target_gguf} has "
                                 f"{target.block_count} layers: it is a draft for another target")


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), else the platform's name for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# -- measuring in the engine -----------------------------------------------------------------------------------------
def spec_flags(draft_gguf: Path, spec_type: str, k: int) -> list[str]:
    """The serve flags of draft length ``k`` (the same flags the card prints)."""
    return ["-md", str(draft_gguf), "--spec-type", spec_type, "--spec-draft-n-max", str(k), "--spec-draft-p-min", "0"]


def _draft_timer(log: str) -> tuple[int, float] | None:
    """(draft calls, draft milliseconds) so far: the last speculative statistics line of a ``-lv 4`` server."""
    found = _DRAFT_STATS.findall(log)
    if not found:
        return None
    calls = found[-1]
    return int(calls[1]), float(calls[4])


def run_interleaved(target_gguf: Path, configs: Mapping[str, tuple[list[str], int]],
                    prompts: Sequence[Sequence[int]], new_tokens: int, threads: int, rounds: int = 1,
                    progress: bool = True) -> tuple[dict[str, EngineTotals], dict[str, list[list[int]]]]:
    """Serve every configuration (``name -> (extra flags, draft length)``) at once, one ``llama-server`` each, and
    send each prompt to all of them in a rotating order (a busy machine slows every configuration alike).
    Returns each configuration's totals and its generated token ids per request."""
    from specgraft.export.llamacpp_engine import LlamaServer

    context = max(len(p) for p in prompts) + new_tokens + 64
    ctx_size = max(512, 1 << (context - 1).bit_length())
    servers = {name: LlamaServer(["-m", str(target_gguf), *flags], threads=threads, ctx_size=ctx_size)
               for name, (flags, _) in configs.items()}
    totals = {name: EngineTotals() for name in configs}
    outputs: dict[str, list[list[int]]] = {name: [] for name in configs}
    timers: dict[str, tuple[int, float]] = {}
    started = []
    try:
        for server in servers.values():
            started.append(server.__enter__())
        names = list(configs)
        turn = 0
        for round_ in range(rounds):
            for i, ids in enumerate(prompts):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    completion = servers[name].complete(ids, new_tokens)
                    totals[name].add(completion.timings, completion.steps, configs[name][1])
                    outputs[name].append(completion.tokens)
                    timer = _draft_timer(completion.log)
                    if timer is not None:
                        calls, ms = timer
                        before = timers.get(name, (0, 0.0))
                        totals[name].draft_calls += calls - before[0]
                        totals[name].draft_ms += ms - before[1]
                        timers[name] = timer
                if progress:
                    print(f"  round {round_ + 1}/{rounds}, prompt {i + 1}/{len(prompts)}", flush=True)
    finally:
        for server in started:
            server.__exit__(None, None, None)
    return totals, outputs


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A seeded random token-id prompt (ids past the first few: no control tokens)."""
    rng = random.Random(seed)
    low = min(16, vocab_size - 1)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def measure_costs(target_gguf: Path, draft_gguf: Path, *, max_draft: int = LLAMACPP_MAX_DRAFT,
                  kv_length: int = 256, new_tokens: int = LLAMACPP_NEW_TOKENS, rounds: int = LLAMACPP_ROUNDS,
                  threads: int = 1, progress: bool = True) -> LlamacppProfile:
    """llama.cpp's plain token and speculative step costs (draft lengths 1..``max_draft``) on a seeded random
    prompt whose KV length averages ``kv_length`` while decoding."""
    from specgraft.export.llamacpp import read_target_gguf
    from specgraft.export.llamacpp_engine import LLAMACPP_VERSION, llamacpp_bin

    llamacpp_bin()  # the one-line refusal (with the build command) before anything starts
    check_draft_for_target(draft_gguf, target_gguf)
    spec_type = draft_spec_type(draft_gguf)
    target = read_target_gguf(target_gguf)
    prompt_length = max(4, kv_length - new_tokens // 2)
    prompt = random_prompt(len(target.tokens), prompt_length)
    configs: dict[str, tuple[list[str], int]] = {"plain": ([], 0)}
    for k in range(1, max_draft + 1):
        configs[f"k{k}"] = (spec_flags(draft_gguf, spec_type, k), k)
        # The draft timer is printed only at log verbosity 4; its logging stays out of the step costs above.
        configs[f"k{k}-timed"] = ([*spec_flags(draft_gguf, spec_type, k), "-lv", "4"], k)
    totals, _ = run_interleaved(target_gguf, configs, [prompt], new_tokens, threads, rounds, progress)
    plain_ms = totals["plain"].decode_ms / max(totals["plain"].tokens, 1)
    step_ms, draft_ms = {}, {}
    for k in range(1, max_draft + 1):
        t = totals[f"k{k}"]
        if t.steps == 0:
            raise SpecgraftError(f"llama.cpp made no speculative step at draft length {k} (no `accepted` lines in its "
                                 "log); is the draft GGUF a draft llama.cpp can serve?")
        step_ms[k] = (t.decode_ms - t.plain_tokens * plain_ms) / t.steps
        timed = totals[f"k{k}-timed"]
        if timed.draft_calls:
            draft_ms[k] = timed.draft_ms / timed.draft_calls
    return LlamacppProfile(target_gguf=str(target_gguf), draft_gguf=str(draft_gguf), spec_type=spec_type,
                           threads=threads, cpu=cpu_name(), prompt_tokens=prompt_length, new_tokens=new_tokens,
                           rounds=rounds, plain_ms=plain_ms, step_ms=step_ms, draft_ms=draft_ms,
                           engine=f"llama.cpp of llama-cpp-python {LLAMACPP_VERSION}")


# -- prompts ---------------------------------------------------------------------------------------------------------
def engine_prompts(target_gguf: Path, texts: Sequence[str], threads: int) -> list[list[int]]:
    """The prompts as llama.cpp tokenizes them: through the GGUF's chat template when it has one, else as raw text."""
    import gguf

    from specgraft.export.llamacpp_engine import LlamaServer

    has_template = gguf.GGUFReader(str(target_gguf)).fields.get("tokenizer.chat_template") is not None
    out = []
    with LlamaServer(["-m", str(target_gguf)], threads=threads, trace_steps=False) as server:
        for text in texts:
            if has_template:
                prompt = server.post("/apply-template", {"messages": [{"role": "user", "content": text}]})["prompt"]
            else:
                prompt = text
            out.append([int(t) for t in server.post("/tokenize", {"content": prompt, "add_special": True})["tokens"]])
    return out


# -- the tuned record -----------------------------------------------------------------------------------------------
def read_llamacpp_tuned(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The llama.cpp tuned record of a head / draft folder (None when it was never tuned for llama.cpp)."""
    path = Path(folder) / LLAMACPP_TUNED_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecgraftError(f"cannot read {path}: {exc}; re-run `specgraft tune --engine llamacpp`") from None
    if not isinstance(record, dict) or "draft_tokens" not in record:
        raise SpecgraftError(f"{path} is not a llama.cpp tuned record; re-run `specgraft tune --engine llamacpp`")
    return record


def tuned_for_target(folder: str | os.PathLike, target_gguf_name: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The folder's llama.cpp tuned record when it was tuned with this target GGUF (by file name), and warnings."""
    record = read_llamacpp_tuned(folder)
    if record is None:
        return None, []
    if record.get("target_gguf") != target_gguf_name:
        return None, [f"{Path(folder) / LLAMACPP_TUNED_NAME} was tuned with {record.get('target_gguf')}, not "
                      f"{target_gguf_name}; the card keeps the example draft length: re-run `specgraft tune "
                      "--engine llamacpp` with this target"]
    return record, []


def card_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """What an export's card needs of a tuned record."""
    predictions = record.get("predictions") or []
    return {"draft_tokens": record["draft_tokens"], "device": record.get("device"),
            "measured": record.get("measured"), "acceptance_per_position":
                (record.get("calibration") or {}).get("acceptance_per_position"),
            "break_even_tau": {str(p["draft_tokens"]): p["break_even_tau"] for p in predictions},
            "predicted_speedup": {str(p["draft_tokens"]): p["speedup"] for p in predictions}}


def tuned_record(profile: LlamacppProfile, acceptance: Sequence[float], predictions: Sequence[Prediction],
                 chosen: Prediction | None, measured: Mapping[str, Any], calibration: Mapping[str, Any],
                 min_speedup: float) -> dict[str, Any]:
    """What ``tuned-llamacpp.json`` holds: the chosen draft length (0: plain decoding), its serve flags, and the
    numbers behind it."""
    return {
        "engine": profile.engine, "target_gguf": Path(profile.target_gguf).name, "spec_type": profile.spec_type,
        "draft_tokens": chosen.draft_tokens if chosen is not None else 0,
        "serve_flags": (["--spec-type", profile.spec_type, "--spec-draft-n-max", str(chosen.draft_tokens),
                         "--spec-draft-p-min", "0"] if chosen is not None else []),
        "device": {"cpu": profile.cpu, "threads": profile.threads},
        "min_speedup": min_speedup,
        "costs": {k: v for k, v in profile.to_dict().items() if k not in ("kind", "version")},
        "calibration": dict(calibration, acceptance_per_position=[round(a, 4) for a in acceptance]),
        "predictions": [asdict(p) for p in predictions],
        "measured": dict(measured),
    }
