"""``python -m benchmarks check-stability --suite model --runs 3 [--quick]``: run suites several times, each run in a
fresh process, and report how much each row's JAX speed-up moved between runs.

    python -m benchmarks check-stability --suite model --quick --runs 3    # exit 0: every row within ±15%

A paired measurement (``twincore.timing``) bounds the noise inside one process; what differs from process to
process (thread placement, memory layout, the machine's other jobs) only shows across runs, as pyperf's worker
processes show it. Each run is ``python -m benchmarks run --suite S --out <out>/run-<i>``; per row (``tables.
speedup_rows``, rows every run timed) the record holds each run's speed-up, their spread (max / min) and ``agree``
(spread <= ``--max-spread``, default 1.15: ±15% around the middle, the issue's target). Written to
``<out>/stability.json`` (default ``benchmarks/results/local/stability/``); exit 0 when every row agrees, 1 when
one does not, 2 on bad flags. The processes are ``tools/repeat.py``'s, the ones ``run --repeat N`` pools: the
committed quick records come from ``run --quick --repeat 3``, whose rows the processes disagree on are labelled
``unstable`` and left out of the README's medians (benchmarks/NOTES.md, "Trustworthy numbers").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..report.records import SUITES, check_out_dir, default_out, write_text_atomic
from ..report.tables import row_paired, speedup_rows
from .repeat import run_processes


def rows_of(records: list[dict]) -> dict[tuple, dict]:
    """``{row key: {"ratio", "unstable"}}`` of one run's records, the rows both frameworks timed."""
    keys, rows = speedup_rows(records)
    out = {}
    for key, cells, ratio in rows:
        if ratio == ratio:  # not NaN
            out[tuple(zip(keys, key))] = {"ratio": ratio, "unstable": bool((row_paired(cells) or {}).get("unstable"))}
    return out


def compare_runs(runs: list[dict[tuple, dict]], max_spread: float) -> list[dict]:
    """Per row timed in every run: the runs' speed-ups, spread = max / min, ``agree`` = spread <= ``max_spread``."""
    common = [k for k in runs[0] if all(k in r for r in runs[1:])]
    out = []
    for key in common:
        ratios = [r[key]["ratio"] for r in runs]
        spread = max(ratios) / min(ratios)
        out.append(
            {
                "row": {k: v for k, v in key},
                "ratios": ratios,
                "spread": spread,
                "agree": spread <= max_spread,
                "unstable_in_runs": sum(r[key]["unstable"] for r in runs),
            }
        )
    return out


def main(argv=None, prog: str = "python -m benchmarks check-stability") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", action="append", choices=SUITES, required=True, help="suite to check (repeatable)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per suite (default 3, at least 2)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, as `run --quick`")
    p.add_argument("--max-spread", type=float, default=1.15, help="largest accepted max/min of a row (default 1.15)")
    p.add_argument("--out", default=None, help="directory (default benchmarks/results/local/stability, untracked)")
    args = p.parse_args(argv)
    if args.runs < 2:
        p.error(f"--runs {args.runs}: need at least 2 runs to compare")
    if not args.max_spread >= 1:
        p.error(f"--max-spread {args.max_spread}: must be a number >= 1 (max / min of the runs' ratios)")
    try:
        out = check_out_dir(args.out if args.out is not None else default_out("stability"))
    except ValueError as e:
        p.error(str(e))
    suites = list(dict.fromkeys(args.suite))
    try:
        done = run_processes(suites, args.runs, args.quick, out)
    except RuntimeError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    runs = {s: [rows_of(d[s]) for d in done] for s in suites}
    env = [{s: d["_env"][s].get("loadavg") for s in suites} | {"wall_s": d["_env"]["wall_s"]} for d in done]
    result = {s: compare_runs(runs[s], args.max_spread) for s in suites}
    record = {"runs": args.runs, "quick": args.quick, "max_spread": args.max_spread, "loadavg": env, "suites": result}
    write_text_atomic(os.path.join(out, "stability.json"), json.dumps(record, indent=1) + "\n")
    bad = 0
    for s, rows in result.items():
        print(f"\n{s}: JAX speed-up per run, spread = max / min (agree: <= {args.max_spread:g})")
        for r in rows:
            row = ", ".join(f"{k}={v}" for k, v in r["row"].items())
            ratios = " ".join(f"{x:.2f}x" for x in r["ratios"])
            mark = "agree" if r["agree"] else "MOVED"
            print(f"  {row}: {ratios}  spread {r['spread']:.2f}  {mark}")
            bad += not r["agree"]
    print(f"\n{bad} of {sum(map(len, result.values()))} rows moved more than {args.max_spread:g}x; wrote {out}")
    return 1 if bad else 0
