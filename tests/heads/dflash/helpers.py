"""Shared helpers of the DFlash tests: heads, decoder contexts, self-generated data and a short training loop."""

from __future__ import annotations

import torch

from specgraft.decoding.decoder import SpeculativeDecoder
from specgraft.decoding.drafter import DraftContext
from specgraft.heads.dflash.config import resolve_dflash_config
from specgraft.heads.dflash.model import DFlashHead
from specgraft.target import Target


def make_head(target: Target, seed: int = 0, **fields) -> DFlashHead:
    """A freshly built head with seeded initialisation (fields as in resolve_dflash_config)."""
    torch.manual_seed(seed)
    return DFlashHead.build(target, resolve_dflash_config(target, **fields))


def context_for(target: Target, tokens: torch.Tensor, layers, start: int = 0, **kwargs) -> DraftContext:
    """The DraftContext the decoder would build for ``tokens`` (root = last) with features from ``start``."""
    out = target(tokens[None, :-1], layers=layers)
    return DraftContext(token_ids=tokens, prompt_length=len(tokens), hidden_start=start,
                        hidden_states={i: h[0, start:] for i, h in out.hidden_states.items()},
                        max_depth=kwargs.pop("max_depth", 16), **kwargs)


def self_generated(target: Target, rows: int, new_tokens: int, prompt_len: int = 4, seed: int = 0) -> torch.Tensor:
    """[rows, prompt_len + new_tokens]: random prompts and the target's own greedy continuations."""
    g = torch.Generator().manual_seed(seed)
    decoder = SpeculativeDecoder(target, ignore_eos=True)
    data = []
    for _ in range(rows):
        prompt = torch.randint(6, 250, (prompt_len,), generator=g).tolist()
        data.append(prompt + decoder.generate(prompt, new_tokens).generated_ids)
    return torch.tensor(data)


def train_head(target: Target, data: torch.Tensor, steps: int, lr: float = 3e-3, **fields) -> DFlashHead:
    """Full-batch steps on ``data`` (the target is frozen, so its outputs are computed once); anchors are drawn
    from the global RNG seeded per step."""
    head = make_head(target, **fields)
    batch = {"input_ids": data, "attention_mask": torch.ones_like(data), "loss_mask": torch.ones_like(data)}
    out = target(data, batch["attention_mask"], layers=head.required_layers())
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    for step in range(steps):
        torch.manual_seed(step)
        loss = head.training_loss(batch, out).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()
