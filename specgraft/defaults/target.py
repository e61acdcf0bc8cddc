"""The embedded default target: a small Llama shipped inside the package, and its corpus as a dataset.

The model folder (``specgraft/defaults/model/``: ``model.safetensors``, ``config.json``,
``generation_config.json``, tokenizer files and ``training_report.json``) is built by
``scripts/build_default_target.py`` from :mod:`specgraft.defaults.corpus` alone, so ``specgraft demo`` runs with no
download and no data beside the checkout. The report holds the held-out perplexity per domain the build measured.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specgraft.defaults.corpus import DOMAINS, generate_corpus
from specgraft.errors import SpecgraftError

if TYPE_CHECKING:  # heavy imports only where used
    import datasets

    from specgraft.target import Target

#: Where the built target lives inside the package.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "model"
#: The build's report, beside the model.
REPORT_NAME = "training_report.json"
#: ``default_corpus_dataset`` splits: head training data, and held-out data for head evaluation.
DATASET_SPLITS = ("train", "heldout")


def default_target_path() -> Path:
    """The packaged folder of the default target (raises if the package was installed without it)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file() or not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise SpecgraftError(f"the default target is missing from {DEFAULT_MODEL_DIR}; reinstall specgraft, or "
                             "rebuild it with `python scripts/build_default_target.py`")
    return DEFAULT_MODEL_DIR


def load_default_target(**kwargs: Any) -> Target:
    """The default target as a frozen :class:`specgraft.target.Target` (fp32 unless ``dtype=`` says otherwise)."""
    from specgraft.target import load_target

    return load_target(default_target_path(), **kwargs)


def default_training_report() -> dict[str, Any]:
    """The build's ``training_report.json`` (held-out perplexity per domain, build config and timings)."""
    return json.loads((default_target_path() / REPORT_NAME).read_text(encoding="utf-8"))


def corpus_digest(docs: Sequence[str]) -> str:
    """A short SHA-256 of a list of documents (the report records it to show which documents were measured)."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def default_corpus_dataset(
    split: str = "train", n_docs: int = 200, seed: int = 1, domains: Sequence[str] = DOMAINS
) -> datasets.Dataset:
    """A ``datasets.Dataset`` of ``{"text", "domain"}``: ``n_docs`` documents per domain, shuffled together.

    ``split="train"`` draws from the training stream (the target was built with seed 0; any seed gives documents
    of the same distribution), ``"heldout"`` from the held-out stream. Neither overlaps the demo prompts
    (:func:`specgraft.defaults.corpus.demo_prompts`), which come from their own stream.
    """
    import random

    import datasets

    if split not in DATASET_SPLITS:
        raise SpecgraftError(f"unknown default-corpus split {split!r}; use one of {', '.join(DATASET_SPLITS)}")
    rows = [(doc, domain) for domain in domains for doc in generate_corpus(domain, n_docs, seed, split=split)]
    random.Random(f"dataset:{split}:{seed}").shuffle(rows)
    return datasets.Dataset.from_dict({"text": [r[0] for r in rows], "domain": [r[1] for r in rows]})
