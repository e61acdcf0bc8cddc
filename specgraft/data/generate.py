"""Batched generation shared by the target's self-distillation (:mod:`specgraft.data.regenerate`) and
distillation's continuations (:mod:`specgraft.distill.data`: sequence-level KD and on-policy student samples).

One rule for both: prompts are left-padded into one batch, every generation knob is explicit (a model's own
generation defaults such as top_k or a repetition penalty stay out), ids past the tokenizer (padding rows of the
embedding matrix, never real text) are never emitted, sampling draws from a forked RNG seeded by the caller (the
caller's RNG stream is untouched, so a resumed run repeats the draws), and each continuation is cut after its first
stop token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def ids_past_tokenizer(model: Any, tokenizer: Any) -> list[int] | None:
    """Output ids of ``model`` that ``tokenizer`` has no token for (None when there are none or no tokenizer)."""
    if tokenizer is None:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = int(head.weight.shape[0]) if head is not None else int(model.config.get_text_config().vocab_size)
    return list(range(len(tokenizer), vocab)) or None


def generation_config(max_new_tokens: int, temperature: float, pad_id: int, stop_ids: Sequence[int],
                      top_p: float = 1.0, suppress_tokens: Sequence[int] | None = None) -> Any:
    """Pure sampling at ``temperature`` with nucleus ``top_p`` (greedy at temperature 0), stopping at any of
    ``stop_ids``, never emitting ``suppress_tokens``."""
    from transformers import GenerationConfig

    sampling = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=top_p if sampling else None,
        top_k=0 if sampling else None,
        repetition_penalty=1.0,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=pad_id,
        suppress_tokens=list(suppress_tokens) if suppress_tokens else None,
    )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T]) of ``prompts`` padded on the left to the longest."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, T]
    for i, p in enumerate(prompts):
        if len(p):
            input_ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            attention_mask[i, width - len(p):] = 1
    return input_ids, attention_mask


@torch.no_grad()
def generate_batch(model: Any, prompts: Sequence[Sequence[int]], config: Any, seed: int
                   ) -> list[tuple[list[int], bool]]:
    """One continuation per prompt: ``(tokens through the first stop token, whether a stop token ended it)``.

    ``config`` is a :func:`generation_config`; sampling draws from a forked RNG seeded with ``seed``, and the model
    is put in eval mode for the call (its mode is restored).
    """
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, config.pad_token_id)
    width = input_ids.shape[1]
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 generation_config=config)
    finally:
        model.train(was_training)
    stops = set(config.eos_token_id or [])
    result = []
    for tokens in out[:, width:].tolist():  # [B, <= max_new_tokens]
        end = next((k for k, t in enumerate(tokens) if t in stops), None)
        result.append((tokens, False) if end is None else (tokens[: end + 1], True))
    return result
