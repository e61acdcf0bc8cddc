"""Build the embedded default target of ``specgraft demo``: tokenizer, trained Llama, and its report.

Deterministic end to end (fixed seeds, one thread, ``torch.use_deterministic_algorithms``): the same torch and
tokenizers versions give the same files (the corpus is the same on every Python). Steps:

1. generate the procedural corpus (:mod:`specgraft.defaults.corpus`, ``train`` split);
2. train a byte-level BPE (digits split one per token, so sums are learnable) and wrap it as a
   ``PreTrainedTokenizerFast`` that prepends ``<s>``;
3. train a small ``LlamaForCausalLM`` on packed ``<s> doc </s>`` sequences mixing the domains;
4. measure held-out perplexity per domain (``heldout`` split, never trained on), greedy accuracy on held-out sums,
   and example greedy continuations of the demo prompts; write everything to ``training_report.json`` beside the
   model, tokenizer and configs.

Usage::

    python scripts/build_default_target.py                   # rebuild specgraft/defaults/model/ (~10 min, 1 core)
    python scripts/build_default_target.py --out /tmp/t --steps 20   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

# One thread, set before torch starts its pool: CPU kernels are deterministic per thread count, and the build is
# meant to be reproduced on a laptop (or a shared 2-core CI runner) anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from specgraft.defaults.corpus import DOMAINS, SUM_MAX, SUM_MIN, demo_prompts, generate_corpus  # noqa: E402
from specgraft.defaults.target import DEFAULT_MODEL_DIR, REPORT_NAME, corpus_digest  # noqa: E402
from specgraft.utils.io import atomic_path, atomic_write_json  # noqa: E402

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Everything that decides the built files (recorded in the report)."""

    seed: int = 0
    # tokenizer
    vocab_size: int = 1024
    tokenizer_docs_per_domain: int = 1500
    # model
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    # training: every step sees tokens_per_step packed tokens, in rows of the phase's length (short rows are ~2x
    # cheaper per token than 512; the later phases teach the positions up to max_position_embeddings). Small steps
    # win at this budget: 512 tokens x 4000 steps beat 2048 x 1000 on every domain (sums: 61% vs 16% right).
    tokens_per_step: int = 512
    steps: int = 12000
    seq_len_phases: tuple[tuple[int, float], ...] = ((128, 0.7), (256, 0.9), (512, 1.0))
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 500
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    #: share of training tokens per domain
    domain_weights: tuple[tuple[str, float], ...] = (
        ("code", 0.15), ("arithmetic", 0.45), ("records", 0.2), ("prose", 0.2),
    )
    log_every: int = 500
    # evaluation
    eval_seed: int = 0
    eval_docs_per_domain: int = 64
    check_docs_per_domain: int = 4
    eval_max_length: int = 512
    arithmetic_checks: int = 200
    example_prompts_per_domain: int = 2
    example_new_tokens: int = 48
    confidence_prompts_per_domain: int = 8


# --- tokenizer --------------------------------------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE over ``texts`` (digits one per token), ``<s>`` prepended by the post-processor."""
    tok = Tokenizer(models.BPE())
    # Digits first: every digit is its own pre-token, so numbers are never merged and sums stay learnable.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, model_max_length=BuildConfig.max_position_embeddings,
    )


def encode_docs(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> list[list[int]]:
    """``<s> doc </s>`` ids of each document."""
    return [ids + [EOS_ID] for ids in tokenizer(docs, verbose=False)["input_ids"]]


# --- data ---------------------------------------------------------------------------------------------------------


def training_stream(tokenizer: PreTrainedTokenizerFast, cfg: BuildConfig) -> tuple[torch.Tensor, dict[str, int]]:
    """``steps * tokens_per_step`` packed ``<s> doc </s>`` tokens mixing the domains by ``domain_weights``."""
    needed = cfg.steps * cfg.tokens_per_step
    docs: list[list[int]] = []
    tokens_per_domain = {}
    for domain, weight in cfg.domain_weights:
        want, n = math.ceil(needed * weight * 1.02), 256
        while True:  # grow the request until enough tokens (a longer request extends a shorter one)
            encoded = encode_docs(tokenizer, generate_corpus(domain, n, cfg.seed))
            got = sum(map(len, encoded))
            if got >= want:
                break
            n = math.ceil(n * want / max(got, 1) * 1.05) + 1
        count = 0
        for ids in encoded:
            if count >= want:
                break
            docs.append(ids)
            count += len(ids)
        tokens_per_domain[domain] = count
    random.Random(f"pack:{cfg.seed}").shuffle(docs)
    stream = [t for ids in docs for t in ids]
    if len(stream) < needed:
        raise RuntimeError(f"packed stream too short: {len(stream)} < {needed}")
    return torch.tensor(stream[:needed]), tokens_per_domain


def seq_len_at(step: int, cfg: BuildConfig) -> int:
    """The row length of ``step`` under ``seq_len_phases`` (phase ends as fractions of the run)."""
    for seq_len, end in cfg.seq_len_phases:
        if step < end * cfg.steps:
            return seq_len
    return cfg.seq_len_phases[-1][0]


# --- model --------------------------------------------------------------------------------------------------------


def make_model(cfg: BuildConfig) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        rms_norm_eps=1e-5, rope_theta=10000.0,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config).float()


def lr_at(step: int, cfg: BuildConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, stream: torch.Tensor, cfg: BuildConfig) -> list[dict[str, float]]:
    """AdamW over ``stream`` [steps * tokens_per_step] in order; returns the logged loss curve."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    model.train()
    curve, running, start = [], 0.0, time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        seq_len = seq_len_at(step, cfg)
        batch = stream[step * cfg.tokens_per_step:(step + 1) * cfg.tokens_per_step].view(-1, seq_len)  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            n = (step % cfg.log_every) + 1
            seconds = round(time.perf_counter() - start, 1)
            curve.append({"step": step + 1, "seq_len": seq_len, "loss": round(running / n, 4), "seconds": seconds})
            print(f"step {step + 1}/{cfg.steps} loss {running / n:.4f} ({seconds:.0f}s)", flush=True)
            running = 0.0
    model.eval()
    return curve


# --- evaluation ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, docs: list[str], max_length: int) -> float:
    """Token perplexity of ``<s> doc </s>`` (truncated to ``max_length``), every token after ``<s>`` predicted."""
    nll, count = 0.0, 0
    for ids in encode_docs(tokenizer, docs):
        ids = torch.tensor([ids[:max_length]])  # [1, T]
        logits = model(input_ids=ids).logits[0, :-1].double()  # [T-1, V]
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)


@torch.no_grad()
def greedy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` (stops at ``</s>``), decoded."""
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def arithmetic_accuracy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, cfg: BuildConfig) -> dict:
    """Greedy exact-match accuracy on held-out ``a + b = `` (a, b uniform two-digit numbers, like the corpus's sums),
    split by whether the units carry."""
    rng = random.Random(f"arithmetic-check:{cfg.eval_seed}")
    tally = {"no_carry": [0, 0], "carry": [0, 0]}
    wrong = []
    for _ in range(cfg.arithmetic_checks):
        a, b = rng.randint(SUM_MIN, SUM_MAX), rng.randint(SUM_MIN, SUM_MAX)
        answer = greedy(model, tokenizer, f"{a} + {b} = ", 4).split("\n")[0].strip()
        kind = "carry" if a % 10 + b % 10 >= 10 else "no_carry"
        tally[kind][0] += answer == str(a + b)
        tally[kind][1] += 1
        if answer != str(a + b) and len(wrong) < 6:
            wrong.append(f"{a} + {b} = {answer}")
    result: dict[str, Any] = {k: {"n": n, "accuracy": round(ok / max(n, 1), 4)} for k, (ok, n) in tally.items()}
    result["all"] = {"n": cfg.arithmetic_checks,
                     "accuracy": round(sum(ok for ok, _ in tally.values()) / cfg.arithmetic_checks, 4)}
    result["wrong_examples"] = wrong
    return result


@torch.no_grad()
def greedy_confidence(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, cfg: BuildConfig) -> dict:
    """Per domain, the mean probability of the chosen token along greedy continuations of demo prompts.

    A proxy for how predictable the target's own output is, which is what draft heads must predict.
    """
    result: dict[str, float] = {}
    for domain in DOMAINS:
        probs = []
        for item in demo_prompts(cfg.confidence_prompts_per_domain, cfg.eval_seed + 1):
            if item["category"] != domain:
                continue
            ids = torch.tensor([tokenizer(item["turns"][0])["input_ids"]])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=cfg.example_new_tokens, output_scores=True,
                                 return_dict_in_generate=True)
            for step_scores in out.scores:  # [1, V] per generated token
                probs.append(step_scores.softmax(-1).max().item())
        result[domain] = round(sum(probs) / len(probs), 4)
    return result


def evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, cfg: BuildConfig) -> dict[str, Any]:
    heldout: dict[str, Any] = {
        "split": "heldout", "seed": cfg.eval_seed, "docs_per_domain": cfg.eval_docs_per_domain,
        "max_length": cfg.eval_max_length, "check_docs_per_domain": cfg.check_docs_per_domain,
        "perplexity": {}, "check_perplexity": {}, "check_docs_sha256": {},
    }
    for domain in DOMAINS:
        docs = generate_corpus(domain, cfg.eval_docs_per_domain, cfg.eval_seed, split="heldout")
        check = docs[: cfg.check_docs_per_domain]
        heldout["perplexity"][domain] = round(perplexity(model, tokenizer, docs, cfg.eval_max_length), 4)
        heldout["check_perplexity"][domain] = round(perplexity(model, tokenizer, check, cfg.eval_max_length), 4)
        heldout["check_docs_sha256"][domain] = corpus_digest(check)
        print(f"held-out perplexity {domain}: {heldout['perplexity'][domain]:.3f}", flush=True)
    examples = []
    for item in demo_prompts(cfg.example_prompts_per_domain, cfg.eval_seed):
        prompt = item["turns"][0]
        examples.append({"domain": item["category"], "prompt": prompt,
                         "greedy": greedy(model, tokenizer, prompt, cfg.example_new_tokens)})
    return {"heldout": heldout, "arithmetic_sums": arithmetic_accuracy(model, tokenizer, cfg),
            "greedy_confidence": greedy_confidence(model, tokenizer, cfg), "examples": examples}


# --- main ---------------------------------------------------------------------------------------------------------


def build(out: Path, cfg: BuildConfig) -> dict[str, Any]:
    """Build tokenizer + model into ``out`` (atomically) and return the report written beside them."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    tok_texts = [doc for domain in DOMAINS
                 for doc in generate_corpus(domain, cfg.tokenizer_docs_per_domain, cfg.seed + 1)]
    tokenizer = build_tokenizer(tok_texts, cfg.vocab_size)
    data, tokens_per_domain = training_stream(tokenizer, cfg)
    t_data = time.perf_counter() - t0
    print(f"tokenizer + data: {t_data:.0f}s, {data.numel()} training tokens {tokens_per_domain}", flush=True)

    model = make_model(cfg)
    curve = train(model, data, cfg)
    t_train = time.perf_counter() - t0 - t_data
    metrics = evaluate(model, tokenizer, cfg)

    n_params = sum(p.numel() for p in model.parameters())
    with atomic_path(out) as tmp:
        model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        report = {
            "description": "specgraft's embedded default target: a small Llama trained by "
                           "scripts/build_default_target.py on the procedural corpus of specgraft.defaults.corpus",
            "config": dataclasses.asdict(cfg),
            "parameters": n_params,
            "model_bytes": (tmp / "model.safetensors").stat().st_size,
            "training_tokens": data.numel(),
            "training_tokens_per_domain": tokens_per_domain,
            "loss_curve": curve,
            **metrics,
            "build_seconds": {"tokenizer_and_data": round(t_data, 1), "training": round(t_train, 1),
                              "total": round(time.perf_counter() - t0, 1)},
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                            "threads": torch.get_num_threads()},
        }
        atomic_write_json(tmp / REPORT_NAME, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="output folder (default: the package's)")
    parser.add_argument("--steps", type=int, default=BuildConfig.steps, help="training steps (smoke runs: fewer)")
    parser.add_argument("--seed", type=int, default=BuildConfig.seed)
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(BuildConfig(), steps=args.steps, seed=args.seed)
    report = build(args.out, cfg)
    summary = {k: report[k] for k in ("parameters", "model_bytes", "build_seconds")}
    summary["perplexity"] = report["heldout"]["perplexity"]
    sums = report["arithmetic_sums"]
    summary["arithmetic_accuracy"] = {k: sums[k]["accuracy"] for k in ("all", "no_carry", "carry")}
    summary["greedy_confidence"] = report["greedy_confidence"]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
