"""The embedded default target of ``specgraft demo`` and the procedural corpus it was trained on.

:mod:`specgraft.defaults.corpus` generates the corpus (code, arithmetic, records, prose);
:mod:`specgraft.defaults.target` locates and loads the packaged model built by ``scripts/build_default_target.py``.
"""
