"""The report room: result records on disk, markdown tables, ``report.md``, plots and the README results section.

It imports nothing else of ``benchmarks`` (only ``twincore`` at most): suites and tools contribute their own
tables with ``tables.register_table`` / ``build.register_dir_report``.
"""
