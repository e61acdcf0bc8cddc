"""Speculative decoding and its evaluation.

Modules: ``drafter`` (the Drafter interface and DraftContext), ``tree`` (DraftTree and tree-attention masks),
``verify`` (greedy and lossless sampling verification), ``kv`` (cache rollback and masks on stock transformers
models), ``decoder`` (SpeculativeDecoder, generate_reference), ``drafters`` (DraftModelDrafter, SelfDrafter,
RandomDrafter) and ``metrics`` (tau, acceptance by depth, alpha_exact, speedup, closed-form simulator).
"""
