"""The end-to-end demos of ``specgraft demo`` (:mod:`specgraft.commands.demo`): ``stories`` on the embedded default
target, ``smollm2`` on SmolLM2-135M-Instruct, and the ``steps`` both share. Every step is a call of
:mod:`specgraft.pipeline`; the drafters' recipes are ``recipes/demo/*.yaml`` (shipped inside the package as
``specgraft/demos/recipes/``, which ``recipes/demo`` links to in a checkout).
"""
