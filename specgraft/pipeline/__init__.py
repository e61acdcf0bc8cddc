"""The pipeline, once: train -> evaluate -> tune -> export as library functions with typed parameters.

The ``specgraft`` commands (:mod:`specgraft.commands`), the demos (:mod:`specgraft.demos`) and the benchmarks all
call these; each step is what its command does without the argument parsing and the printing:

* :mod:`~specgraft.pipeline.train`: :func:`~specgraft.pipeline.train.train_head`,
  :func:`~specgraft.pipeline.train.distill_draft`;
* :mod:`~specgraft.pipeline.evaluate`: :class:`~specgraft.pipeline.evaluate.DrafterChoice`,
  :func:`~specgraft.pipeline.evaluate.load_drafter`, :func:`~specgraft.pipeline.evaluate.evaluate`;
* :mod:`~specgraft.pipeline.tune`: :func:`~specgraft.pipeline.tune.load_head_source`,
  :func:`~specgraft.pipeline.tune.load_draft_source`, :func:`~specgraft.pipeline.tune.measure_cost_profile`,
  :func:`~specgraft.pipeline.tune.tune_drafter`;
* export: :func:`specgraft.export.exporter.export_head` (typed already; the exporters live in :mod:`specgraft.export`).

The package sits above decoding, kernels, tuning, evaluation, training and export, and below the commands and the
demos: nothing in the library imports it.
"""
