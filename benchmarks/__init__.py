"""Benchmarks of both twins on this machine: ``python -m benchmarks run|report|compile|readme|train-example``.

Rooms: ``suites/`` (one module per ``--suite``), ``report/`` (records, tables, report.md, plots, README section),
``tools/`` (deviceless compile, block search, GPU session); ``measure.py`` and ``twins.py`` are shared.
"""

import jaxattn  # noqa: E402, F401 - before any jax import: a quiet start with the gpu-compile extra (spec.cuda_quiet)
