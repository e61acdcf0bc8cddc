"""Training data: readers for conversations and plain text, tokenisation with assistant-only loss masks,
packing, on-disk caching, batching, and target self-distillation (``specgraft.data.regenerate``).

The package does not re-export ``regenerate``: the name belongs to the submodule
(``from specgraft.data.regenerate import regenerate``), which ``python -m`` must be able to run.
"""

from specgraft.utils.lazy import lazy_exports

_EXPORTS = {
    "pad_collate": "collate",
    "token_frequencies": "collate",
    "build_dataset": "dataset",
    "load_records": "readers",
    "prompt_ids": "tokenize",
    "tokenize_conversation": "tokenize",
    "tokenize_text": "tokenize",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "build_dataset",
    "load_records",
    "pad_collate",
    "prompt_ids",
    "token_frequencies",
    "tokenize_conversation",
    "tokenize_text",
]
