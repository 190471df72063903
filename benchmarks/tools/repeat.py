"""Suites measured in several fresh processes and pooled into one record per row (``run --repeat N``), the runs
``check-stability`` compares.

    runs = run_processes(["model"], 3, quick=True, out="/tmp/rep")   # [{suite: records}, ...], one per process
    records = pool_records([r["model"] for r in runs])                # one record list, every row pooled
    write_pooled(runs, "benchmarks/results/local/cpu-quick")          # <suite>.json + report.md + plots

A pair (``measure.timeit_paired``) bounds the noise inside one process; what moves from process to process (thread
placement, memory layout, the machine's other jobs) shows only across processes, as pyperf's worker processes show
it. :func:`pool_records` keeps, per record, the median of the processes' medians with the processes' p10/p90
envelope and each process's median (``process_median_ms``), and per row one pair pooled over the processes
(``twincore.timing.pooled_ratio``: a hierarchical bootstrap interval, ``unstable`` where the processes
disagree by more than ``UNSTABLE_SPREAD``). Subprocesses and not ``multiprocessing``: each run is exactly the
command a user types, jax and torch imported fresh.
"""

from __future__ import annotations

import collections
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

from twincore.timing import pooled_ratio

from ..report.build import rebuild_report
from ..report.records import impl_label, read_results, write_results
from ..report.tables import MEASURED

# throughput fields of a record: the same work per call, so they scale with 1 / median time
RATES = ("tokens_per_s", "tflops", "mfu")


def run_processes(
    suites: Iterable[str],
    runs: int,
    quick: bool,
    out: str,
    extra: Iterable[str] = (),
    log: Callable[[str], None] = print,
) -> list[dict[str, list[dict]]]:
    """``python -m benchmarks run --suite S ... --out <out>/run-<i>`` ``runs`` times, one fresh process each
    (stdout dropped, stderr shown; ``suites`` may be ``["all"]``); returns each run's ``{suite: records}`` for
    every suite it wrote, and their ``{suite: env, "wall_s": seconds}`` under ``"_env"``.
    Raises RuntimeError naming the run when one exits non-zero."""
    suites, found_all = list(suites), []
    for i in range(runs):
        run_dir = f"{out}/run-{i}"
        cmd = [sys.executable, "-m", "benchmarks", "run", "--out", run_dir] + ["--quick"] * quick
        cmd += [a for s in suites for a in ("--suite", s)] + list(extra)
        log(f"process {i + 1}/{runs}: {' '.join(cmd[1:])}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"process {i + 1} of {runs} exited with status {proc.returncode}: {' '.join(cmd)}")
        found = read_results(run_dir)
        run = {s: d["records"] for s, d in found.items()}
        run["_env"] = {s: found[s].get("env") or {} for s in run} | {"wall_s": time.perf_counter() - t0}
        found_all.append(run)
    return found_all


def _row_key(r: dict) -> tuple:
    """The row a record belongs to (``tables.speedup_rows``' grouping: every key that is not a result)."""
    return tuple(sorted((k, repr(v)) for k, v in r.items() if k not in MEASURED and k != "suite"))


def _timed(r: dict | None) -> bool:
    return r is not None and r.get("status", "ok") == "ok" and isinstance(r.get("median_ms"), (int, float))


def _pool_times(same: list[dict]) -> dict:
    """One record from the same record of every process: median of medians, p10/p90 envelope, rates rescaled."""
    first, med = same[0], [r["median_ms"] for r in same]
    out = {k: v for k, v in first.items() if k != "paired"}
    out["median_ms"] = statistics.median(med)
    out["process_median_ms"] = med
    if all(isinstance(r.get("p10_ms"), (int, float)) for r in same):
        out["p10_ms"] = min(r["p10_ms"] for r in same)
    if all(isinstance(r.get("p90_ms"), (int, float)) for r in same):
        out["p90_ms"] = max(r["p90_ms"] for r in same)
    if all(isinstance(r.get("iters"), int) for r in same):
        out["iters"] = sum(r["iters"] for r in same)
    if all(isinstance(r.get("cv"), (int, float)) for r in same):
        out["cv"] = max(r["cv"] for r in same)
    for k in RATES:
        if isinstance(first.get(k), (int, float)) and first["median_ms"] > 0:
            out[k] = first[k] * first["median_ms"] / out["median_ms"]
    mems = [r["peak_mem_bytes"] for r in same if isinstance(r.get("peak_mem_bytes"), (int, float))]
    if mems:
        out["peak_mem_bytes"] = max(mems)
    return out


def _pool_pair(pairs: list[dict]) -> dict:
    """Every process's pair of one row pooled (``pooled_ratio``); the implementations each process paired are kept."""
    pooled = pooled_ratio([p["ratios"] for p in pairs])
    named = [(p["jax_impl"], p["torch_impl"]) for p in pairs if "jax_impl" in p and "torch_impl" in p]
    if named:
        (jax_impl, torch_impl), _ = collections.Counter(named).most_common(1)[0]
        pooled.update(jax_impl=jax_impl, torch_impl=torch_impl, process_impls=[list(n) for n in named])
    return pooled


def pool_records(runs: list[list[dict]]) -> list[dict]:
    """The records of one suite from several processes as one list in the first process's order: a record timed in
    every process pooled (:func:`_pool_times`), any other as the first process has it (``processes`` = how many
    timed it); per row, the pairs of every process pooled when each process paired that row (records that carry
    a pair without per-round ``ratios``, from before pooling existed, are not pooled), carried by the records
    that carried it in the first process that paired it."""
    if not runs or not all(runs):
        raise ValueError("pool_records: need at least one process's records, none empty")
    index = [{(_row_key(r), impl_label(r)): r for r in run} for run in runs]
    out = []
    for r in runs[0]:
        same = [ix.get((_row_key(r), impl_label(r))) for ix in index]
        timed = sum(map(_timed, same))
        if timed == len(runs):
            out.append(_pool_times(same))
        else:  # untimed everywhere (a remat record's bytes, a skip) as it is; timed somewhere: say where
            out.append({k: v for k, v in r.items() if k != "paired"} | ({"processes": timed} if timed else {}))
    rows = collections.defaultdict(list)  # row key -> pooled records
    for rec in out:
        rows[_row_key(rec)].append(rec)
    for key, recs in rows.items():
        per_process = []  # (pair, impl labels carrying it) per process
        for ix in index:
            carriers = [r for (rk, _), r in ix.items() if rk == key and isinstance(r.get("paired"), dict)]
            if carriers:
                per_process.append((carriers[0]["paired"], {impl_label(r) for r in carriers}))
        if len(per_process) != len(runs) or not all("ratios" in p for p, _ in per_process):
            continue
        pooled, labels = _pool_pair([p for p, _ in per_process]), per_process[0][1]
        for rec in recs:
            if impl_label(rec) in labels:
                rec["paired"] = pooled
    return out


def write_pooled(runs: list[dict], out: str) -> list[str]:
    """Writes ``<out>/<suite>.json`` for every suite all ``runs`` (:func:`run_processes`) measured, pooled
    (:func:`pool_records`), its env the first process's plus ``repeat`` (the number of processes) and each
    process's load (``process_loadavg``), then ``report.md`` and the plots (``report.build.rebuild_report``).
    Returns the paths written."""
    suites = [s for s in runs[0] if s != "_env" and all(s in r for r in runs)]
    if not suites:
        raise ValueError("write_pooled: no suite was measured by every process")
    written = []
    for s in suites:
        envs = [r["_env"][s] for r in runs]
        env = {
            **envs[0],
            "repeat": len(runs),
            "loadavg_end": envs[-1].get("loadavg_end"),
            "process_loadavg": [e.get("loadavg") for e in envs],
        }
        written.append(write_results(out, s, pool_records([r[s] for r in runs]), env))
    return written + rebuild_report(out)
