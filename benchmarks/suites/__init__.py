"""The suites of ``python -m benchmarks run --suite NAME``: one module each, ``run(quick, ...) -> records``.

from benchmarks.suites import model; records = model.run(quick=True)
"""

SUITES = ("model", "attention", "remat", "decode", "plan", "train", "compile")
