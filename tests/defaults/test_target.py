"""The committed default target: loads offline, is genuinely trained, and its training report is honest."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specgraft.defaults.corpus import DOMAINS, ITEMS, SUM_MAX, SUM_MIN, demo_prompts, generate_corpus
from specgraft.defaults.target import (
    corpus_digest,
    default_corpus_dataset,
    default_target_path,
    default_training_report,
    load_default_target,
)

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_default_target.py"
#: The issue's budget for a committed model file.
MAX_MODEL_BYTES = 4 * 1024 * 1024
#: Held-out perplexity ceilings per domain (an untrained model scores ~1000 everywhere; the committed build has
#: code 1.15, arithmetic 1.58, records 2.02, prose 3.39, see training_report.json).
PPL_CEILING = {"code": 1.4, "arithmetic": 1.8, "records": 2.3, "prose": 4.0}
#: Greedy exact-match floor on fresh two-digit sums whose units do not carry (the committed build: 100%).
NO_CARRY_ACCURACY_FLOOR = 0.75
NO_CARRY_CHECKS = 40
#: A re-measurement of the same documents may differ from the report only by float noise (another CPU or BLAS).
RECHECK_RTOL = 0.01
#: The check documents are a few of the held-out ones: their perplexity is within this factor of the full set's.
RECHECK_LOOSE_FACTOR = 1.5


@pytest.fixture(scope="module")
def model_and_tokenizer():
    path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


@pytest.fixture(scope="module")
def report():
    return default_training_report()


def _greedy(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _perplexity(model, tokenizer, docs: list[str], max_length: int) -> float:
    """Reference: mean token NLL of ``<s> doc </s>`` from the model's own shifted loss, weighted by token count."""
    nll, count = 0.0, 0
    for doc in docs:
        ids = (tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id])[:max_length]
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
        nll += loss * (len(ids) - 1)
        count += len(ids) - 1
    return math.exp(nll / count)


def test_committed_folder_is_a_small_offline_llama(model_and_tokenizer, report):
    model, tokenizer = model_and_tokenizer
    path = default_target_path()
    size = (path / "model.safetensors").stat().st_size
    assert size <= MAX_MODEL_BYTES and size == report["model_bytes"]
    assert model.config.model_type == "llama" and type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tokenizer) == report["config"]["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == report["parameters"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert getattr(tokenizer, "chat_template", None) is None  # trained on raw documents, prompts go in as is


def test_load_default_target_gives_a_frozen_target(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    target = load_default_target()
    assert target.identity.architecture == "LlamaForCausalLM"
    assert target.identity.num_hidden_layers == model.config.num_hidden_layers
    assert not any(p.requires_grad for p in target.model.parameters())
    ids = torch.tensor([tokenizer("12 + 30 = ")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(target.model(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("domain", DOMAINS)
def test_tokenizer_round_trips_corpus_text(model_and_tokenizer, domain):
    _, tokenizer = model_and_tokenizer
    for doc in generate_corpus(domain, 20, 7, split="heldout"):
        ids = tokenizer(doc)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == doc
    # Digits are one token each (what makes sums learnable).
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("1234 + 56 = 1290", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == list("1234561290")


def test_report_perplexities_are_low_and_ordered(report):
    ppl = report["heldout"]["perplexity"]
    assert set(ppl) == set(DOMAINS)
    for domain, ceiling in PPL_CEILING.items():
        assert 1.0 < ppl[domain] < ceiling, (domain, ppl[domain])
    # As on real models: code the most predictable domain, free prose the least; the same order holds for the
    # target's confidence in its own greedy output, which is what draft heads must predict.
    assert ppl["code"] < min(ppl["arithmetic"], ppl["records"])
    assert ppl["prose"] > max(ppl["arithmetic"], ppl["records"])
    confidence = report["greedy_confidence"]
    assert confidence["code"] > max(confidence["arithmetic"], confidence["records"])
    assert confidence["prose"] < min(confidence["arithmetic"], confidence["records"])


@pytest.mark.parametrize("domain", DOMAINS)
def test_report_perplexity_is_reproduced(model_and_tokenizer, report, domain):
    """Re-measure the report's check documents from scratch: the report is the model's, not made up."""
    model, tokenizer = model_and_tokenizer
    spec = report["heldout"]
    docs = generate_corpus(domain, spec["check_docs_per_domain"], spec["seed"], split=spec["split"])
    measured = _perplexity(model, tokenizer, docs, spec["max_length"])
    assert corpus_digest(docs) == spec["check_docs_sha256"][domain]  # the corpus is the build's, on any Python
    assert measured == pytest.approx(spec["check_perplexity"][domain], rel=RECHECK_RTOL)
    # The check subset is representative of the full held-out set the headline number comes from.
    assert spec["check_perplexity"][domain] < spec["perplexity"][domain] * RECHECK_LOOSE_FACTOR


@pytest.mark.parametrize(("prompt", "answer"), [("12 + 30 = ", "42"), ("25 + 63 = ", "88"), ("47 + 38 = ", "85")])
def test_greedy_sums_are_right(model_and_tokenizer, prompt, answer):
    model, tokenizer = model_and_tokenizer
    assert _greedy(model, tokenizer, prompt, 3).split("\n")[0] == answer


def test_greedy_sums_are_learnt_not_memorised(model_and_tokenizer):
    """Fresh sums (the demo's seed never made them) are mostly right: the model adds digit pairs."""
    model, tokenizer = model_and_tokenizer
    rng = random.Random("test-sums")
    right = 0
    for _ in range(NO_CARRY_CHECKS):
        a = rng.randint(SUM_MIN, SUM_MAX)
        b = 10 * rng.randint(SUM_MIN // 10, SUM_MAX // 10) + rng.randint(0, 9 - a % 10)
        right += _greedy(model, tokenizer, f"{a} + {b} = ", 4).split("\n")[0] == str(a + b)
    assert right / NO_CARRY_CHECKS >= NO_CARRY_ACCURACY_FLOOR


def test_greedy_code_continuations_are_plausible(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    # The next constructor argument is stored the same way: copied from the signature above.
    prompt = "class User:\n\n    def __init__(self, name, age, active):\n        self.name = name"
    assert _greedy(model, tokenizer, prompt, 8).startswith("\n        self.age = age")
    # A nested block is indented one level deeper than its `if`.
    nested = _greedy(model, tokenizer, "def check(value):\n    if value is None:", 6)
    assert nested.startswith("\n        "), nested


def test_greedy_structured_continuations_follow_their_schemas(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    row = _greedy(model, tokenizer, "sku,item,category,price,stock\nSKU-0012,hammer,tools,12.50,40", 24).split("\n")[1]
    sku, item, category, price, stock = row.split(",")
    assert re.fullmatch(r"SKU-\d{4}", sku) and ITEMS[item] == category  # the category follows from the item
    assert re.fullmatch(r"\d+\.\d\d", price) and stock.isdigit()
    table = _greedy(model, tokenizer, "Table of 7:\n7 x 1 = 7\n7 x 2 = 14", 20)
    assert table.startswith("\n7 x 3 = 21\n7 x 4 = 28")
    ini = _greedy(model, tokenizer, "[server]\nhost = 10.0.9.18", 20)
    assert re.match(r"\d*\nport = \d+\nenabled = (true|false)\ntimeout = \d+", ini), ini


def test_default_corpus_dataset_is_disjoint_from_the_demo_prompts():
    ds = default_corpus_dataset("train", n_docs=5, seed=1)
    assert ds.column_names == ["text", "domain"] and len(ds) == 5 * len(DOMAINS)
    assert sorted(set(ds["domain"])) == sorted(DOMAINS)
    assert default_corpus_dataset("train", n_docs=5, seed=1)["text"] == ds["text"]
    heldout = default_corpus_dataset("heldout", n_docs=5, seed=1)
    assert not set(heldout["text"]) & set(ds["text"])
    prompts = [p["turns"][0] for p in demo_prompts(3, seed=0)]
    assert not any(doc.startswith(p) for doc in [*ds["text"], *heldout["text"]] for p in prompts)


def test_committed_tokenizer_is_the_build_scripts(report, monkeypatch):
    """Rebuilding the tokenizer with the script and the recorded config gives the committed one (deterministic)."""
    loader = importlib.util.spec_from_file_location("build_default_target", BUILD_SCRIPT)
    build = importlib.util.module_from_spec(loader)
    monkeypatch.setitem(sys.modules, loader.name, build)  # dataclasses look their module up there
    loader.loader.exec_module(build)
    cfg = report["config"]
    texts = [doc for domain in DOMAINS
             for doc in generate_corpus(domain, cfg["tokenizer_docs_per_domain"], cfg["seed"] + 1)]
    rebuilt = json.loads(build.build_tokenizer(texts, cfg["vocab_size"]).backend_tokenizer.to_str())
    committed = json.loads((default_target_path() / "tokenizer.json").read_text(encoding="utf-8"))
    assert rebuilt["model"]["vocab"] == committed["model"]["vocab"]
    assert rebuilt["model"]["merges"] == committed["model"]["merges"]
