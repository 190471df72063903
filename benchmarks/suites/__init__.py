"""The suites of ``python -m benchmarks run --suite NAME``: one module each, ``run(quick, ...) -> records``.

from benchmarks.suites import model; records = model.run(quick=True)
"""

from ..report.records import SUITES  # the suites' order, which reports follow too

__all__ = ["SUITES"]
