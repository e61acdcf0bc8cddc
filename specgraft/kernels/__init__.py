"""CPU kernels the evaluation switches into the target for verification: ``linear`` (weight-major, padded
single-row and row-exact linear layers, and the ``--linear-kernel`` choice), ``exact_attention`` and
``gqa_attention`` (the ``--attention-kernel`` choice), ``rounding`` (how far a verification is from a rounding tie)
and ``choices`` (the import-light list of choices). Built on :mod:`specgraft.decoding`'s KV helpers only.
"""
