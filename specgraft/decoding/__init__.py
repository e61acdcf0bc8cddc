"""Lossless speculative decoding: the lowest layer of the package.

``drafter`` (the :class:`~specgraft.decoding.drafter.Drafter` protocol and its DraftContext), ``tree`` (draft trees
and tree-attention masks), ``verify`` (greedy and lossless sampling verification), ``kv`` (cache rollback and masks
on stock transformers models), ``decoder`` (SpeculativeDecoder, generate_reference), ``drafters`` (the draft-model,
self and random drafters), ``acceptance`` (per-depth acceptance statistics) and ``metrics`` (tau, speedup, closed
forms). Nothing here knows a head family, a kernel choice, tuning or the command line.
"""
