"""Training data: readers for conversations and plain text, tokenisation with assistant-only loss masks,
packing, on-disk caching, batching, and target self-distillation (``specgraft.data.regenerate``).

The package does not re-export ``regenerate``: the name belongs to the submodule
(``from specgraft.data.regenerate import regenerate``), which ``python -m`` must be able to run.
"""

from specgraft.data.collate import pad_collate, token_frequencies
from specgraft.data.dataset import build_dataset
from specgraft.data.readers import load_records
from specgraft.data.tokenize import prompt_ids, tokenize_conversation, tokenize_text

__all__ = [
    "build_dataset",
    "load_records",
    "pad_collate",
    "prompt_ids",
    "token_frequencies",
    "tokenize_conversation",
    "tokenize_text",
]
