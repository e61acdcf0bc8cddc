"""The model card (``README.md``) of an exported head: Hub metadata, what the head is, how it was trained, how
well it drafts (from the eval report) and copy-paste serving commands.

The card is built only from the head's config, the resolved recipe and the eval report: it never sees a token
or any credential.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.evaluation.report_reader import is_plain
from specgraft.heads.registry import get_family

FORMAT_TAGS = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt-llm", "llamacpp": "gguf",
               "native": "specgraft"}
FORMAT_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM", "llamacpp": "llama.cpp (GGUF)",
                "native": "specgraft (native)"}

#: An ``ORG/NAME`` Hub repo id.
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def is_hub_id(name: str) -> bool:
    """True for an ``ORG/NAME`` Hub repo id that is not also a local path (a folder path is no Hub id)."""
    return bool(HUB_REPO_ID.match(name)) and ".." not in name and not Path(name).expanduser().exists()


#: Draft length used in the example commands.
EXAMPLE_DRAFT_TOKENS = 3

_REPORT_COLUMNS = (
    ("tau", "tau", 2),
    ("alpha_exact", "alpha", 3),
    ("speedup_mean_of_ratios", "speedup (mean of ratios)", 2),
    ("speedup_ratio_of_totals", "speedup (ratio of totals)", 2),
    ("tokens_per_s", "tokens/s", 1),
    ("baseline_tokens_per_s", "baseline tokens/s", 1),
    ("num_prompts", "prompts", 0),
)


def render_model_card(head_meta: Mapping[str, Any], recipe_dict: Mapping[str, Any] | None,
                      report: Mapping[str, Any] | None, format: str, repo_id: str | None,
                      *, license: str | None = None) -> str:
    """A Hub model card for an exported head.

    Args:
        head_meta: the head's ``head_config.json`` content (``head_type``, ``config``, ``target``, optional
            ``training`` summary, ``num_parameters``), optionally with ``base_model`` (the target's Hub id),
            ``license``, ``export_notes`` and ``local_path``.
        recipe_dict: the resolved training recipe (``recipe.yaml`` as a dict), or None.
        report: the eval report (see ``specgraft eval``), or None.
        format: the export format (vllm | sglang | trtllm | native).
        repo_id: the Hub repo the card is for (commands use it; a local path or a placeholder otherwise).
        license: overrides ``head_meta["license"]`` (default ``other``).
    """
    head_type = str(head_meta.get("head_type", "?"))
    target = head_meta.get("target") or {}
    base = str(head_meta.get("base_model") or target.get("name_or_path") or "the target model")
    where = repo_id or str(head_meta.get("local_path") or "PATH/TO/THIS/FOLDER")
    lic = license or head_meta.get("license") or "other"
    text = _card_text(head_type)
    name = text.title if text is not None else head_type
    tags = ["speculative-decoding", "draft-model", head_type,
            FORMAT_TAGS.get(format, format), "specgraft"]
    lines = ["---", *_hub_metadata(base, lic), "library_name: specgraft",
             "tags:", *[f"- {t}" for t in dict.fromkeys(tags)], "---", ""]
    lines += [f"# {name} draft head for {base}", ""]
    lines += _about(head_meta, head_type, text, base, format)
    lines += _serving(head_meta, head_type, text, base, format, where)
    lines += _training(head_meta, recipe_dict)
    lines += _evaluation(report)
    notes = list(head_meta.get("export_notes") or [])
    if notes:
        lines += ["## Export notes", "", *[f"- {n}" for n in notes], ""]
    lines += ["---", "", f"Made with specgraft (`specgraft export --format {format}`)."]
    return "\n".join(lines).rstrip() + "\n"


def _hub_metadata(base: str, lic: str) -> list[str]:
    """The card's ``base_model`` / ``base_model_relation`` / ``license*`` lines, as the Hub's metadata rules want.

    ``base_model`` must be a Hub repo id (a local path is wrong metadata): it is left out otherwise (the exporter
    warns). A draft head is weights that run only on top of the target, hence ``base_model_relation: adapter``.
    ``license: other`` needs ``license_name`` and ``license_link``: a head derived from the target follows the
    target's license, so they point at the target's repo.
    """
    lines = []
    if is_hub_id(base):
        lines += [f"base_model: {_yaml_str(base)}", "base_model_relation: adapter"]
    if lic != "other":
        lines.append(f"license: {_yaml_str(lic)}")
    elif is_hub_id(base):
        lines += ['license: "other"', 'license_name: "same-as-base-model"',
                  f"license_link: {_yaml_str(f'https://huggingface.co/{base}')}"]
    return lines


def _yaml_str(value: str) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML scalar, quotes and all


def _card_text(head_type: str) -> Any:
    """The family's :class:`~specgraft.heads.family.CardText` (None for a type no family registers)."""
    try:
        return get_family(head_type).card
    except SpecgraftError:
        return None


def _about(meta: Mapping[str, Any], head_type: str, text: Any, base: str, fmt: str) -> list[str]:
    cfg = meta.get("config") or {}
    target = meta.get("target") or {}
    params = meta.get("num_parameters")
    size = f" ({params / 1e6:.1f}M trainable parameters)" if isinstance(params, (int, float)) else ""
    what = text.describe(cfg, size) if text is not None else f"A {head_type} draft head{size}."
    return [
        what, "",
        f"It only proposes tokens: the target ({base}, {target.get('architecture', '?')}, "
        f"{target.get('num_hidden_layers', '?')} layers, hidden size {target.get('hidden_size', '?')}, vocabulary "
        f"{target.get('vocab_size', '?')}) verifies every proposal, so outputs are the target's own (lossless); "
        "the draft changes only the speed.", "",
        f"Files are in the **{FORMAT_NAMES.get(fmt, fmt)}** layout "
        f"({'one GGUF file' if fmt == 'llamacpp' else 'safetensors'}).", "",
    ]


def _tuned_section(tuned: Mapping[str, Any] | None) -> list[str]:
    """Where the serving numbers below come from: the tuned setting and the device it was tuned on."""
    if not tuned:
        return [f"The draft lengths below are examples ({EXAMPLE_DRAFT_TOKENS}); `specgraft tune` chooses them for "
                "your device.", ""]
    device = tuned.get("device") or {}
    setting = {k: v for k, v in (tuned.get("setting") or {}).items() if k != "paths"}
    lines = ["### Tuned setting", "",
             f"Chosen by `specgraft tune` on {device.get('device')} ({device.get('device_name')}, "
             f"{device.get('dtype')}, {device.get('threads')} thread(s), KV length {device.get('kv_length')}"
             + (f", {device['linear_kernel']} linear kernel" if device.get("linear_kernel") else "")
             + f"): `{json.dumps(setting)}`."]
    predicted, measured = tuned.get("predicted") or {}, (tuned.get("measured") or {}).get("tuned") or {}
    if is_plain(setting):
        best = (tuned.get("measured") or {}).get("best") or {}
        lines.append("No drafting setting was faster than plain decoding on that device"
                     + (f" (the best measured {best['speedup_ratio_of_totals']:.2f}x)"
                        if isinstance(best.get("speedup_ratio_of_totals"), (int, float)) else "")
                     + ", so the commands below use example draft lengths.")
        lines += ["A device where verifying several tokens costs about one forward (a GPU) changes the answer: "
                  "re-run `specgraft tune` there.", ""]
        return lines
    if predicted.get("speedup") is not None:
        line = f"Predicted speedup {predicted['speedup']:.2f}x over plain decoding on that device"
        if measured.get("speedup_ratio_of_totals") is not None:
            line += f"; measured {measured['speedup_ratio_of_totals']:.2f}x (tau {measured.get('tau', 0):.2f})"
        lines.append(line + ".")
    lines += ["Another device has other costs: re-run `specgraft tune` there.", ""]
    return lines


def _serving(meta: Mapping[str, Any], head_type: str, text: Any, base: str, fmt: str, where: str) -> list[str]:
    tuned = meta.get("tuned") or None
    engines = (tuned or {}).get("engines") or {}
    cfg = meta.get("config") or {}
    if text is not None and text.vllm_tokens_are_heads:
        # vLLM maps a Medusa draft's num_speculative_tokens onto its number of heads: it must be exactly that.
        n = int(cfg.get("num_heads", EXAMPLE_DRAFT_TOKENS))
    else:
        n = int(engines.get("vllm", {}).get("num_speculative_tokens", EXAMPLE_DRAFT_TOKENS))
    sgl = engines.get("sglang") or {"speculative_num_steps": n, "speculative_eagle_topk": 1,
                                    "speculative_num_draft_tokens": n + 1}
    lines = ["## Serving", ""] + _tuned_section(tuned)
    method = text.vllm_method if text is not None else None
    if method is not None:
        vllm_here = fmt == "vllm"
        vllm_where = where if vllm_here else "PATH/TO/VLLM/EXPORT"
        lines += ["### vLLM", ""]
        if not vllm_here:
            lines += [f"Export the head with `specgraft export HEAD_DIR --format vllm --out DIR` first; this folder "
                      f"is in the {FORMAT_NAMES.get(fmt, fmt)} layout.", ""]
        if text.config_is_self_contained:
            lines += ["The config carries a `speculators_config`, so the draft folder alone is enough:", "",
                      "```bash", f"vllm serve {vllm_where}", "```", "", "or, with the target named explicitly:", ""]
        spec = json.dumps({"model": vllm_where, "method": method, "num_speculative_tokens": n})
        lines += ["```bash", f"vllm serve {base} --speculative-config '{spec}'", "```", ""]
    lines += ["### SGLang", ""]
    algo = text.sglang_algorithm if text is not None else None
    if algo is None:
        lines += [f"SGLang does not serve {text.title if text is not None else head_type} heads; use "
                  f"{'vLLM' if method else 'the specgraft decoder'}"
                  f"{' or TensorRT-LLM' if text is not None and text.trtllm_lines else ''}.", ""]
    else:
        sgl_where = where if fmt == "sglang" else "PATH/TO/SGLANG/EXPORT"
        if fmt != "sglang":
            lines += [f"Export with `--format sglang` first (SGLang's {algo} draft reads a different layout).", ""]
        if text.sglang_args is not None:
            flags = text.sglang_args(cfg, engines.get("sglang") or {})
        else:
            flags = (f"--speculative-num-steps {sgl['speculative_num_steps']} --speculative-eagle-topk "
                     f"{sgl['speculative_eagle_topk']} --speculative-num-draft-tokens "
                     f"{sgl['speculative_num_draft_tokens']}")
        lines += ["```bash", f"python -m sglang.launch_server --model-path {base} \\",
                  f"  --speculative-algorithm {algo} --speculative-draft-model-path {sgl_where} \\",
                  f"  {flags}",
                  "```", "", "SGLang counts the root token in `--speculative-num-draft-tokens`; vLLM's "
                  "`num_speculative_tokens` does not.", ""]
    lines += _llamacpp_lines(meta, text, fmt, where)
    if fmt == "trtllm" and text is not None and text.trtllm_lines is not None:
        trt = engines.get("trtllm") or {}
        lines += ["### TensorRT-LLM", ""]
        lines += text.trtllm_lines(cfg, base, where, trt, int(trt.get("max_draft_len", EXAMPLE_DRAFT_TOKENS)))
    return lines


def llamacpp_serve_lines(target: str, draft: str, spec_type: str, draft_tokens: int) -> list[str]:
    """The ``llama-server`` command that serves ``draft`` for ``target`` (a fenced bash block, as card lines)."""
    return ["```bash", f"llama-server -m {target} -md {draft} --spec-type {spec_type} \\",
            f"  --spec-draft-n-max {draft_tokens} --spec-draft-p-min 0", "```"]


def llamacpp_tuned_lines(tuned: Mapping[str, Any] | None) -> list[str]:
    """Where the llama.cpp draft length comes from: ``specgraft tune --engine llamacpp`` (measured in llama.cpp), or
    an example when the folder was never tuned for llama.cpp."""
    if not tuned:
        return [f"The draft length below is an example ({EXAMPLE_DRAFT_TOKENS}); `specgraft tune --engine llamacpp` "
                "chooses it in llama.cpp on your machine.", ""]
    device = tuned.get("device") or {}
    where = f"{device.get('cpu')}, {device.get('threads')} thread(s)"
    measured = tuned.get("measured") or {}
    k = int(tuned.get("draft_tokens") or 0)
    acceptance = tuned.get("acceptance_per_position")
    if k == 0:
        evens = tuned.get("break_even_tau") or {}
        least = min(evens.items(), key=lambda kv: kv[1], default=None)
        line = (f"`specgraft tune --engine llamacpp` found that speculation does not pay in llama.cpp on {where}: "
                f"llama.cpp accepted {acceptance} per draft position")
        if least is not None:
            line += (f", while even the cheapest draft length ({least[0]}) needs an acceptance length of "
                     f"{float(least[1]):.2f} tokens per step to match plain decoding")
        if measured.get("speedup") is not None:
            line += f" (measured {measured['speedup']:.2f}x at draft length {measured.get('draft_tokens')})"
        return [line + ". The command below uses the example draft length; a faster device or a head that "
                "accepts more changes the answer.", ""]
    line = (f"Draft length {k} was chosen in llama.cpp by `specgraft tune --engine llamacpp` on {where} "
            f"(predicted {float((tuned.get('predicted_speedup') or {}).get(str(k), 0)):.2f}x plain decoding")
    if measured.get("speedup") is not None:
        line += (f"; measured {measured['speedup']:.2f}x: {measured.get('tokens_per_s')} vs "
                 f"{measured.get('plain_tokens_per_s')} tokens/s")
    return [line + "). Another machine has other costs: re-run it there.", ""]


def _llamacpp_lines(meta: Mapping[str, Any], text: Any, fmt: str, where: str) -> list[str]:
    """The llama.cpp serve command (``llama-server -md``) of a family llama.cpp serves."""
    spec_type = text.llamacpp_spec_type if text is not None else None
    if spec_type is None:
        return []
    lines = ["### llama.cpp", ""]
    info = meta.get("llamacpp") or {}
    if fmt != "llamacpp":
        return lines + ["Export with `--format llamacpp --target-gguf TARGET.gguf` first: llama.cpp reads one GGUF "
                        "draft that carries the target's tokenizer and the fused layer ids as llama.cpp numbers them. "
                        "Do not convert an sglang folder with llama.cpp's own converter: for EAGLE-3 it ignores "
                        "`eagle_config.eagle_aux_hidden_state_layer_ids` and silently falls back to default layers.",
                        ""]
    n = int(info.get("draft_tokens") or EXAMPLE_DRAFT_TOKENS)
    target = info.get("target_gguf") or "TARGET.gguf"
    draft = f"{where}/{info.get('draft_file', 'draft.gguf')}"
    return lines + llamacpp_tuned_lines(info.get("tuned")) + [
                    "Serve with the target GGUF this draft was exported for "
                    f"(`{target}`, whose tokenizer it carries):", "",
                    *llamacpp_serve_lines(target, draft, spec_type, n), "",
                    "`--spec-draft-n-max` is the draft length (chain); `--spec-draft-p-min 0` drafts the full length "
                    "(raise it to stop a chain at low draft confidence).", ""]


def _training(meta: Mapping[str, Any], recipe: Mapping[str, Any] | None) -> list[str]:
    lines = ["## Training", ""]
    summary = meta.get("training") or {}
    if not recipe and not summary:
        return lines + ["No training recipe was saved with this head.", ""]
    recipe = recipe or {}
    data, training, head = recipe.get("data") or {}, recipe.get("training") or {}, recipe.get("head") or {}
    if recipe.get("description"):
        lines += [str(recipe["description"]), ""]
    rows = []
    if data:
        regen = " (assistant turns regenerated by the target)" if data.get("regenerate") else ""
        rows.append(("data", f"`{data.get('path')}` ({data.get('format', 'auto')}, max length "
                             f"{data.get('max_length')}){regen}"))
    if training:
        batch = training.get("micro_batch_size")
        accum = training.get("gradient_accumulation_steps", 1)
        rows += [("steps", training.get("max_steps")), ("learning rate", f"{training.get('learning_rate')} "
                 f"({training.get('lr_scheduler', 'cosine')}, warm-up {training.get('warmup_steps', 0)})"),
                 ("batch", f"{batch} x {accum} accumulation per process"),
                 ("features", training.get("features"))]
    if head:
        rows.append(("head", ", ".join(f"{k}={v}" for k, v in head.items() if v is not None)))
    if summary:
        rows += [("steps done", summary.get("steps")), ("tokens seen", summary.get("tokens_seen"))]
        if "draft_vocab_coverage" in summary:
            rows.append(("draft-vocab coverage (held-out rows)",
                         f"{100 * float(summary['draft_vocab_coverage']):.1f}%"))
        if "draft_vocab_train_coverage" in summary:
            rows.append(("draft-vocab coverage (rows it was counted from)",
                         f"{100 * float(summary['draft_vocab_train_coverage']):.1f}%"))
    lines += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows if v is not None], ""]
    return lines


def _fmt(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.{digits}f}" if digits else f"{int(value)}"


def _evaluation(report: Mapping[str, Any] | None) -> list[str]:
    lines = ["## Evaluation", ""]
    if not report:
        return lines + ["No evaluation report was attached. `specgraft eval` measures tau (mean tokens per target "
                        "forward, bonus token included), acceptance by depth and speedup per domain.", ""]
    settings = report.get("settings") or {}
    if settings:
        parts = [f"{k}={settings[k]}" for k in ("temperature", "top_p", "top_k", "max_new_tokens") if k in settings]
        lines += [f"Settings: {', '.join(parts)}" + (" (lossy)" if settings.get("lossy") else "") + ".", ""]
    header = "| domain | " + " | ".join(label for _, label, _ in _REPORT_COLUMNS) + " |"
    lines += [header, "|" + "---|" * (len(_REPORT_COLUMNS) + 1)]
    rows = list((report.get("domains") or {}).items())
    if report.get("overall"):
        rows.append(("**overall**", report["overall"]))
    for name, values in rows:
        values = values or {}
        lines.append(f"| {name} | " + " | ".join(_fmt(values.get(k), d) for k, _, d in _REPORT_COLUMNS) + " |")
    lines.append("")
    overall = report.get("overall") or {}
    depth = overall.get("acceptance_by_depth")
    if depth:
        lines += ["Acceptance by draft depth (overall): " + ", ".join(_fmt(x, 3) for x in depth) + ".", ""]
    if "baseline_kernels" in overall:  # reports from before it timed the baseline with the eval's own kernels
        chosen = overall["baseline_kernels"]
        lines += [f"Baseline: plain decoding with {'the stock kernels' if chosen == 'stock' else chosen} in the same "
                  f"dtype and process ({_fmt(overall.get('baseline_tokens_per_s'), 1)} tokens/s); plain decoding "
                  f"with the stock kernels: {_fmt(overall.get('plain_stock_tokens_per_s'), 1)} tokens/s"
                  + (f", with the eval's kernels: {_fmt(overall.get('plain_kernel_tokens_per_s'), 1)} tokens/s"
                     if overall.get("plain_kernel_tokens_per_s") is not None else "") + ".", ""]
    if "lossless_check" in overall:
        lines += [f"Lossless check: {overall['lossless_check']}.", ""]
    titles = {"tau_by_domain": "tau by domain", "acceptance_by_depth": "acceptance by depth",
              "speedup_by_domain": "speedup by domain"}
    for key, file in (report.get("plots") or {}).items():
        lines += [f"![{titles.get(key, key)}]({str(file).rsplit('/', 1)[-1]})", ""]
    return lines
