"""Markdown tables of result records: JAX and torch side by side with the speed-up column, per suite.

print(suite_table("model", records))   # report_table, or the suite's own layout (SUITE_TABLES)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from . import compile_tables
from .records import impl_label

# Record keys that are results, not row keys of the report table (``device``: where that framework ran, so JAX and
# torch share a row even when they ran on different devices).
MEASURED = {
    "median_ms",
    "p10_ms",
    "p90_ms",
    "tflops",
    "tokens_per_s",
    "peak_mem_bytes",
    "mfu",
    "max_abs_diff",
    "status",
    "reason",
    "impl",
    "framework",
    "iters",
    "measured",
    "summary",
    "device",
    "cv",
    "paired",
    "loadavg",
    "processes",
    "process_median_ms",
    "first_call_s",
}
SPEEDUP_COLUMN = "JAX speed-up = torch time / JAX time"
SPEEDUP_NOTE = (
    f"**{SPEEDUP_COLUMN}**: where the two were timed as a pair (alternating rounds), the median of the per-round "
    "ratios with its 95% interval, `unstable` when the interval spans more than 1.5x or the per-round times vary "
    "by a CV above 0.25 (pooled over processes, `run --repeat N`: also when the processes' speed-ups differ by more "
    "than 1.15x), `no difference shown` when the interval includes 1.00x; otherwise the fastest torch median over "
    "the fastest JAX median in that row. Above 1.00x JAX is faster, below it torch is."
)
# suite name -> fn(records) -> markdown, for suites whose records need their own layout
SUITE_TABLES: dict[str, Callable[[list[dict]], str]] = {
    "compile": compile_tables.suite_tables,
    "suite_memory": compile_tables.suite_memory_table,
}


def _fmt(r: dict) -> str:
    if r.get("status", "ok") != "ok":
        return "—"
    if "median_ms" not in r:  # an untimed record (e.g. the remat suite's bytes): its own summary
        return str(r.get("summary", ""))
    s = f"{r['median_ms']:.3g} ms"
    if r.get("tflops"):
        s += f" ({r['tflops']:.3g} TF/s)"
    elif r.get("tokens_per_s"):
        s += f" ({r['tokens_per_s']:.3g} tok/s)"
    return s


def speedup_rows(records: Iterable[dict]) -> tuple[list[str], list[tuple[tuple, dict, float]]]:
    """The rows of :func:`report_table`: ``(row keys, [(key values, {impl: record}, speed-up)])``, one row per
    shape/pass (records agreeing on every non-:data:`MEASURED` key). Speed-up = :data:`SPEEDUP_COLUMN`: the
    fastest ok torch ``median_ms`` over the fastest ok JAX one in that row (> 1: JAX is faster; for a
    throughput row, the same tokens in both, it is JAX tokens/s over torch tokens/s); NaN unless both
    frameworks timed that row. The one definition the report and the README (``report.readme``) use."""
    records = list(records)
    keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in MEASURED and k != "suite"]
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault(tuple(r.get(k) for k in keys), {})[impl_label(r)] = r
    out = []
    for key, cells in rows.items():
        best = {
            fw: min(
                (
                    c["median_ms"]
                    for c in cells.values()
                    if c.get("framework") == fw
                    and c.get("status", "ok") == "ok"
                    and isinstance(c.get("median_ms"), (int, float))
                ),
                default=math.nan,
            )
            for fw in ("jax", "torch")
        }
        both = best["jax"] == best["jax"] and best["torch"] == best["torch"]  # neither is NaN
        ratio = best["torch"] / best["jax"] if both else math.nan
        paired = row_paired(cells)
        out.append((key, cells, paired["ratio"] if paired and both else ratio))
    return keys, out


def row_paired(cells: dict) -> dict | None:
    """The paired measurement of a row (``twincore.timing.paired_ratio``'s dict, carried by its records when
    the suite timed JAX and torch alternately), or None. A row merged from several runs (``records.read_results``)
    may carry several pairs naming different implementations (``jax_impl``/``torch_impl``): then only the pair of
    the row's fastest JAX and fastest torch implementation is the row's, and None (the plain ratio of medians)
    when no run paired those two."""
    pairs = [c["paired"] for c in cells.values() if isinstance(c.get("paired"), dict)]
    named = {(p.get("jax_impl"), p.get("torch_impl")) for p in pairs}
    if len(named) <= 1 or (None, None) in named:
        return pairs[0] if pairs else None
    fastest = tuple(
        min(
            (
                c
                for c in cells.values()
                if c.get("framework") == fw
                and c.get("status", "ok") == "ok"
                and isinstance(c.get("median_ms"), (int, float))
            ),
            key=lambda c: c["median_ms"],
            default={},
        ).get("impl")
        for fw in ("jax", "torch")
    )
    return next((p for p in pairs if (p.get("jax_impl"), p.get("torch_impl")) == fastest), None)


def format_ratio(ratio: float, paired: dict | None) -> str:
    """A speed-up cell: ``1.31x``, with a pair's interval ``1.31x [1.22–1.40]``, ``unstable`` where it is, and
    ``no difference shown`` where a stable interval includes 1 (not a finding either way)."""
    if math.isnan(ratio):
        return ""
    if not paired:
        return f"{ratio:.2f}x"
    lo, hi = paired["ci"]
    label = " unstable" if paired.get("unstable") else " no difference shown" if lo <= 1.0 <= hi else ""
    return f"{ratio:.2f}x [{lo:.2f}–{hi:.2f}]{label}"


def report_table(records: Iterable[dict]) -> str:
    """Markdown table: one row per shape/pass, one column per implementation, and :data:`SPEEDUP_COLUMN`
    (fastest torch time / fastest JAX time; > 1 means JAX is faster), rows from :func:`speedup_rows`."""
    records = list(records)
    impls = list(dict.fromkeys(impl_label(r) for r in records))
    keys, rows = speedup_rows(records)
    head = "| " + " | ".join(keys + impls + [SPEEDUP_COLUMN]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(impls) + 1)]
    for key, cells, ratio in rows:
        vals = ["" if v is None else str(v) for v in key] + [_fmt(cells[i]) if i in cells else "" for i in impls]
        lines.append("| " + " | ".join(vals + [format_ratio(ratio, row_paired(cells))]) + " |")
    return "\n".join(lines)


def suite_table(suite: str, records: list[dict]) -> str:
    """The markdown table of one suite: the one it registered (:data:`SUITE_TABLES`, e.g. the ``compile``
    suite's kernel and program tables), else :func:`report_table` (JAX and torch side by side)."""
    return SUITE_TABLES.get(suite, report_table)(records)
