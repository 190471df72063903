"""Benchmarks of both twins on this machine: ``python -m benchmarks run|report|compile|readme|train-example``.

Rooms: ``suites/`` (one module per ``--suite``), ``report/`` (records, tables, report.md, plots, README section),
``tools/`` (deviceless compile, block search, GPU session); ``measure.py`` and ``twins.py`` are shared.
"""
