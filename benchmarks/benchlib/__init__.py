"""Code the benchmark scripts share: their result files (:mod:`benchlib.results`), the stories260K target and its
held-out TinyStories split (:mod:`benchlib.stories`), and running specgraft commands as timed stages
(:mod:`benchlib.stages`).

The scripts run as ``python benchmarks/<script>.py``, so ``benchmarks/`` is on their import path and they import
``benchlib`` directly; nothing here is part of the installed ``specgraft`` package."""
