"""``python -m benchmarks run [--suite NAME ...] [--quick] [--out DIR]`` — measure both frameworks on this machine.

Suites: ``model`` (same Llama in both frameworks: logits parity, forward and forward+backward) and
``attention`` (every attention backend against torch SDPA and JAX's own kernels); ``all`` runs each. Results go
to ``--out`` (default ``benchmarks/results/<device>/``, or ``.../<device>-quick/`` with ``--quick``): one JSON
per suite, ``report.md`` and plots. ``--quick`` uses tiny shapes so a CPU pass takes a few minutes at most.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

# jax and torch share the GPU in one process: without this jax grabs 75% of device memory at start-up and torch
# SDPA runs out at long sequences. Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from . import common  # noqa: E402

SUITES = ("model", "attention")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run benchmark suites and write JSON + report.md")
    run.add_argument("--suite", action="append", choices=SUITES + ("all",),
                     help="suite to run (repeatable; default: all)")
    run.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    run.add_argument("--impl", action="append", default=None,
                     help="attention suite: keep only these implementations (repeatable, e.g. flash, sdpa:flash)")
    run.add_argument("--max-seq", type=int, default=None,
                     help="attention suite: skip shapes with a longer sequence (to split a long GPU sweep)")
    run.add_argument("--out", default=None, help="output directory (default benchmarks/results/<device>[-quick])")
    args = parser.parse_args(argv)

    suites = list(SUITES) if not args.suite or "all" in args.suite else list(dict.fromkeys(args.suite))
    info = common.env_info()
    info["quick"] = args.quick
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   common.device_slug(info) + ("-quick" if args.quick else ""))
    print(f"device: {info['jax_device']} | jax {info['jax']} | torch {info['torch']} | out: {out}", flush=True)
    results = {}
    for suite in suites:
        t0 = time.perf_counter()
        kwargs = {"impls": args.impl, "max_seq": args.max_seq} if suite == "attention" else {}
        records = importlib.import_module(f"benchmarks.{suite}").run(quick=args.quick, **kwargs)
        results[suite] = records
        common.write_results(out, suite, records, info)
        print(f"\n## {suite} ({time.perf_counter() - t0:.0f} s)\n\n{common.report_table(records)}", flush=True)
        if suite == "attention":
            common.plot_attention(out, records)
    print(f"\nreport: {common.write_report(out, results, info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
