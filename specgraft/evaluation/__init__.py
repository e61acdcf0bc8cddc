"""Measuring drafters: ``report`` (decode prompt sets with a drafter and with plain decoding) and ``render``
(report.json / report.md / plots per domain), ``report_reader`` (the one reader of reports, profiles and
tuned.json), ``prompts`` (prompt-set readers), ``loading`` (devices, dtypes, draft models) and ``settings``
(:class:`~specgraft.evaluation.settings.EvalSettings`). `specgraft eval` runs them through
:mod:`specgraft.pipeline.evaluate`.
"""
