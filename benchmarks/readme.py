"""``python -m benchmarks.readme [--check]``: the README's spelling of ``python -m benchmarks readme``.

The generator is ``benchmarks/report/readme.py``; this module only runs it.
"""

import sys

from .report.readme import main

if __name__ == "__main__":
    sys.exit(main())
