"""``python -m benchmarks.train_example [...]``: the README's spelling of ``python -m benchmarks train-example``.

The example is ``benchmarks/tools/train_example.py``; this module only runs it.
"""

import sys

from .tools.train_example import main

if __name__ == "__main__":
    sys.exit(main())
