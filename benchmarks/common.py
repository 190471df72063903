"""Timing, environment and report helpers shared by every benchmark suite (CONVENTIONS §9).

Timing: warm-up calls first (compilation, autotuning and allocator growth stay out), then ``iters`` timed calls,
each closed by ``jax.block_until_ready`` / ``torch.cuda.synchronize``; we report the median and the 10th/90th
percentiles (the loop and statistics are ``jaxattn.spec.timing``'s, the synchronisation and peak memory
``jaxattn.profiling`` / ``torchref.profiling``'s, so trainers and benchmarks time alike). A record is a flat
dict; a suite returns a list of them and ``write_results`` stores ``<out>/<suite>.json`` (environment +
records) and a ``report.md`` with JAX and torch side by side (``rebuild_report`` redoes it from the JSON).
Every file is written to a temporary file in the same directory and moved into place (``os.replace``) only
when complete, so an existing result is never replaced by an empty or partial one (CONVENTIONS §9).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import sys
import tempfile
import textwrap
import time
from typing import Any, Callable, Iterable, Optional

from jaxattn.spec.timing import time_calls

# Record keys that are results, not row keys of the report table (``device``: where that framework ran, so JAX and
# torch share a row even when they ran on different devices).
MEASURED = {"median_ms", "p10_ms", "p90_ms", "tflops", "tokens_per_s", "peak_mem_bytes", "mfu", "max_abs_diff",
            "status", "reason", "impl", "framework", "iters", "measured", "summary", "device"}


def _sync(out: Any = None) -> None:
    """Wait for device work behind ``out`` with each loaded framework's ``profiling.synchronize`` (jax arrays,
    torch tensors, or pytrees of them); a framework that is not imported is not touched."""
    if "jax" in sys.modules:
        from jaxattn.profiling import synchronize as jax_sync

        if out is not None:  # None: nothing of jax's to wait for (jax_sync() would wait on every live array)
            jax_sync(out)
    if "torch" in sys.modules:
        from torchref.profiling import synchronize as torch_sync

        torch_sync(out)


def timeit(fn: Callable, *args, warmup: int = 3, iters: int = 20, **kwargs) -> dict:
    """Median wall time of ``fn(*args, **kwargs)`` over ``iters`` synchronized calls after ``warmup`` calls
    (``jaxattn.spec.timing.time_calls``, the loop both profiling modules use, closed by :func:`_sync`)."""
    return time_calls(fn, *args, warmup=warmup, iters=iters, sync=_sync, **kwargs)


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool, backward: bool = False) -> float:
    """FlashAttention convention: forward 4*B*H*Sq*Sk*D (halved when causal); forward+backward = 3.5x forward."""
    f = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), keyed by a substring of the device name; for MFU.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0,
                    "L4": 121.0, "A10G": 70.0}


def peak_tflops(device_name: str) -> Optional[float]:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_name.lower():
            return value
    return None


def jax_device_name() -> str:
    import jax

    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform) if d.platform != "cpu" else f"cpu ({platform.processor() or platform.machine()})"


def jax_peak_memory() -> Optional[int]:
    """Peak bytes in use on the first jax device since start (None where the backend keeps no stats, e.g. CPU)."""
    from jaxattn.profiling import peak_memory_bytes

    return peak_memory_bytes(host_fallback=False)


def jax_compiled_memory(fn: Callable, *args) -> Optional[int]:
    """Bytes XLA assigns to jitted ``fn`` at ``args`` (arguments + outputs + temporaries - aliased), or None."""
    from jaxattn.profiling import compiled_memory

    try:
        ma = compiled_memory(fn, *args)
    except Exception:  # a backend that cannot analyse (or lower) this function: no number, not a failure
        return None
    return None if ma is None else ma["total"]


def torch_reset_peak() -> None:
    from torchref.profiling import reset_peak_memory

    reset_peak_memory()


def torch_peak_memory() -> Optional[int]:
    """``torch.cuda.max_memory_allocated`` since the last :func:`torch_reset_peak` (None on CPU)."""
    from torchref.profiling import peak_memory_bytes

    return peak_memory_bytes(host_fallback=False)


def env_info() -> dict:
    """Device name, host and library versions for a result file."""
    info = {"python": platform.python_version(), "host": platform.node(), "time_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for mod in ("jax", "jaxlib", "flax", "optax", "torch", "triton", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # not installed
            info[mod] = None
    try:
        info["jax_device"] = jax_device_name()
        import jax

        info["jax_backend"] = jax.default_backend()
    except Exception as e:  # pragma: no cover
        info["jax_device"] = f"unavailable: {e}"
    try:
        import torch

        info["torch_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:
        info["torch_device"] = None
    return info


def device_slug(info: dict) -> str:
    name = info.get("jax_device") or "unknown"
    name = "cpu" if name.startswith("cpu") else name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-").lower()


def check_out_dir(out_dir: str) -> str:
    """``out_dir`` as an absolute path, after checking that results can be written there (before any work).

    The directory may not exist yet (it is created when the first result is written); then its nearest
    existing parent must be a writable directory. Checked by creating and removing a probe file, which also
    catches read-only filesystems and root on them. Raises ValueError naming the path and the reason."""
    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {out_dir!r}: {path} exists and is not a directory")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"--out {out_dir!r}: cannot create it, {probe} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".benchmarks-write-test-", dir=probe)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ValueError(f"--out {out_dir!r} is not writable: cannot create a file in {probe} "
                         f"({e.strerror or e}); pick a writable directory") from None
    return path


@contextlib.contextmanager
def atomic_path(path: str):
    """Yields a temporary path beside ``path``; when the block completes it is fsynced and moved onto ``path``
    (``os.replace``, with the umask's permissions); when the block raises it is removed and ``path`` is left
    untouched."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text_atomic(path: str, text: str) -> str:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
    return path


def write_results(out_dir: str, suite: str, records: list[dict], info: dict) -> str:
    """Writes ``<out_dir>/<suite>.json`` atomically; refuses an empty record list (it would erase a result)."""
    if not records:
        raise ValueError(f"write_results: no records for suite {suite!r}; refusing to replace "
                         f"{os.path.join(out_dir, suite + '.json')} with an empty result")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{suite}.json")
    text = json.dumps({"env": info, "suite": suite, "records": records}, indent=1, default=str)
    return write_text_atomic(path, text)


def read_results(out_dir: str) -> dict[str, dict]:
    """``{suite: {"env", "suite", "records"}}`` for every readable ``<suite>.json`` in ``out_dir``."""
    found = {}
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(out_dir, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("records"), list) and data.get("suite"):
            found[data["suite"]] = data
    return found


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


SPEEDUP_COLUMN = "JAX speed-up = torch time / JAX time"
SPEEDUP_NOTE = (f"**{SPEEDUP_COLUMN}**: the fastest torch median over the fastest JAX median in that row; "
                "above 1.00x JAX is faster, below it torch is.")
# Suites written by ``python -m benchmarks compile`` / ``plan`` / ``block_search``: deviceless compiles with
# their own report layout, not JAX-vs-torch timings; ``report`` leaves them to their own commands.
COMPILED_SUITES = ("kernels", "programs", "plan", "block_search")


def _impl(r: dict) -> str:
    return f"{r.get('framework', '?')}:{r.get('impl', '?')}"


def speedup_rows(records: Iterable[dict]) -> tuple[list[str], list[tuple[tuple, dict, float]]]:
    """The rows of :func:`report_table`: ``(row keys, [(key values, {impl: record}, speed-up)])``, one row per
    shape/pass (records agreeing on every non-:data:`MEASURED` key). Speed-up = :data:`SPEEDUP_COLUMN`: the
    fastest ok torch ``median_ms`` over the fastest ok JAX one in that row (> 1: JAX is faster; for a
    throughput row, the same tokens in both, it is JAX tokens/s over torch tokens/s); NaN unless both
    frameworks timed that row. The one definition the report and the README (``benchmarks.readme``) use."""
    records = list(records)
    keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in MEASURED and k != "suite"]
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault(tuple(r.get(k) for k in keys), {})[_impl(r)] = r
    out = []
    for key, cells in rows.items():
        best = {fw: min((c["median_ms"] for c in cells.values() if c.get("framework") == fw
                         and c.get("status", "ok") == "ok" and isinstance(c.get("median_ms"), (int, float))),
                        default=math.nan) for fw in ("jax", "torch")}
        ratio = best["torch"] / best["jax"] if best["jax"] == best["jax"] and best["torch"] == best["torch"] else math.nan
        out.append((key, cells, ratio))
    return keys, out


def report_table(records: Iterable[dict]) -> str:
    """Markdown table: one row per shape/pass, one column per implementation, and :data:`SPEEDUP_COLUMN`
    (fastest torch time / fastest JAX time; > 1 means JAX is faster), rows from :func:`speedup_rows`."""
    records = list(records)
    impls = list(dict.fromkeys(_impl(r) for r in records))
    keys, rows = speedup_rows(records)
    head = "| " + " | ".join(keys + impls + [SPEEDUP_COLUMN]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(impls) + 1)]
    for key, cells, ratio in rows:
        vals = ["" if v is None else str(v) for v in key] + [_fmt(cells[i]) if i in cells else "" for i in impls]
        lines.append("| " + " | ".join(vals + ["" if math.isnan(ratio) else f"{ratio:.2f}x"]) + " |")
    return "\n".join(lines)


def suite_table(suite: str, records: list[dict]) -> str:
    """The markdown table of one suite: :func:`report_table` (JAX and torch side by side), except for the
    ``compile`` suite, whose kernel and program records keep ``benchmarks.compile``'s own two tables."""
    if suite == "compile":
        from .compile import suite_tables

        return suite_tables(records)
    return report_table(records)


def render_report(suites: list[tuple[str, list[dict], Optional[str]]], info: dict, generated_by: str,
                  plots: Optional[dict] = None) -> str:
    """The markdown of ``report.md``: a header naming the device, how it was made and the environment, then per
    ``(suite, records, measured_at)`` its table (``measured_at`` None: this run), the skipped implementations and
    its plot (``plots``: ``{suite: file name beside report.md}``)."""
    parts = [f"# Benchmark report — {info.get('jax_device')}", "", generated_by, "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in info.items() if v is not None), "",
             SPEEDUP_NOTE, ""]
    for suite, recs, when in suites:
        parts += [f"## {suite}", ""] + ([f"From {suite}.json, measured at {when}.", ""] if when else [])
        parts += [suite_table(suite, recs), ""]
        skipped = [r for r in recs if r.get("status") == "skipped"]
        if skipped:
            parts += ["Skipped: " + "; ".join(f"{_impl(r)} ({r.get('reason')})" for r in
                                              {_impl(r): r for r in skipped}.values()), ""]
        if (plots or {}).get(suite):
            parts += [f"![{suite} plot]({plots[suite]})", ""]
    return "\n".join(parts)


def _plots_in(out_dir: str, suites: Iterable[str]) -> dict:
    """``{suite: PNG file name}`` for the suites whose plot exists in ``out_dir``."""
    return {s: PLOT_FILES[s] for s in suites
            if s in PLOT_FILES and os.path.isfile(os.path.join(out_dir, PLOT_FILES[s]))}


def write_report(out_dir: str, results: dict[str, list[dict]], info: dict) -> str:
    """``report.md`` for this run's ``results`` plus every other suite whose JSON is already in ``out_dir``
    (a run of one suite keeps the others' tables), with links to the plots there, written atomically."""
    earlier = {k: v for k, v in read_results(out_dir).items() if k not in results}
    suites = [(s, r, None) for s, r in results.items()]
    suites += [(s, d["records"], (d.get("env") or {}).get("time_utc", "an earlier run")) for s, d in earlier.items()]
    text = render_report(suites, info, "Generated by `python -m benchmarks run`; numbers come from the JSON files "
                                       "beside this report.", _plots_in(out_dir, [s for s, _, _ in suites]))
    return write_text_atomic(os.path.join(out_dir, "report.md"), text)


def rebuild_report(out_dir: str) -> list[str]:
    """Rebuild ``report.md`` and the plots in ``out_dir`` from the suite JSON files already there, running
    nothing (``python -m benchmarks report DIR``). The header's environment is the most recent JSON's. A
    directory of deviceless-compile results (``kernels.json`` from ``python -m benchmarks compile``) gets that
    command's report and the kernel plot. Returns the paths written. Raises ValueError naming ``out_dir`` when
    it holds no benchmark JSON, or only compiled suites without ``kernels.json`` (``plan``, ``block_search``)."""
    if not os.path.isdir(out_dir):
        raise ValueError(f"report: {out_dir!r} is not a directory; give a results directory holding <suite>.json "
                         f"files (e.g. benchmarks/results/<device>)")
    found = read_results(out_dir)
    # a `run` directory's plan.json is one of its suites; beside kernels.json (a `compile` directory) it is not
    timed = {s: d for s, d in found.items() if s not in COMPILED_SUITES or (s == "plan" and "kernels" not in found)}
    if not timed and "kernels" not in found:
        what = (f"only deviceless-compile results ({', '.join(s + '.json' for s in found)}) without kernels.json, "
                f"whose reports their own commands write" if found else
                "no benchmark JSON (<suite>.json with records)")
        raise ValueError(f"report: {out_dir!r} holds {what}; nothing to rebuild")
    written = []
    for suite, d in (timed or {"kernels": found["kernels"]}).items():
        plot = plot_suite(out_dir, suite, d["records"], d.get("env") or {})
        if plot:
            written.append(plot.path)
    if not timed:  # `python -m benchmarks compile`'s report, redone from its JSON
        from .compile import report

        env = found["kernels"].get("env") or {}
        programs = (found.get("programs") or {}).get("records") or []
        text = report(found["kernels"]["records"], programs, env, _plots_in(out_dir, ["kernels"]).get("kernels"))
        return [write_text_atomic(os.path.join(out_dir, "report.md"), text)] + written
    envs = [d.get("env") or {} for d in timed.values()]
    info = max(envs, key=lambda e: str(e.get("time_utc", "")))
    suites = [(s, d["records"], (d.get("env") or {}).get("time_utc", "an unknown time")) for s, d in timed.items()]
    generated = ("Rebuilt by `python -m benchmarks report` from the JSON files beside this report (nothing was "
                 "re-run); the environment line is the most recent file's.")
    text = render_report(suites, info, generated, _plots_in(out_dir, timed))
    return [write_text_atomic(os.path.join(out_dir, "report.md"), text)] + written


# ------------------------------------------------------------------------------------------------------- plots
@dataclasses.dataclass
class Panel:
    """One axes of a figure. ``series``: ``{legend label: {x: y}}``; on a bar panel y None marks a skipped
    measurement (drawn as "skipped") and a string is drawn as that text (e.g. "n/a"); an x missing from a series
    gets no slot. ``kind``: "line"
    (numeric x, ``logx`` a base or None) or "bar" (grouped bars over ``categories``, in that order). ``logy``:
    None = log when the positive values span 20x or more. ``limits``: ``(y, text)`` dotted reference lines;
    ``note``: a text in the corner (e.g. "no spills")."""

    title: str
    xlabel: str
    ylabel: str
    series: dict
    kind: str = "line"
    categories: tuple = ()
    logx: Optional[int] = None
    logy: Optional[bool] = None
    limits: tuple = ()
    note: Optional[str] = None

    def values(self) -> list:
        return [y for pts in self.series.values() for y in pts.values() if isinstance(y, (int, float))]


@dataclasses.dataclass(frozen=True)
class Plot:
    """A written figure: its path, title, the legend's labels (every series of every panel, in legend order)
    and the panels' titles."""

    path: str
    title: str
    labels: tuple
    panels: tuple


MARKERS = "osD^vP*Xh<>p"


def _is_torch(label: str) -> bool:
    return label.startswith("torch")


def draw(out_dir: str, name: str, title: str, panels: list[Panel], ncols: Optional[int] = None) -> Optional[Plot]:
    """Write ``out_dir/name`` (PNG, Agg) with ``panels`` and return its :class:`Plot`; None when no panel has a
    value or matplotlib is missing (then nothing is written).

    Each series label keeps one colour and marker in every panel (JAX first, JAX solid, torch dashed / hatched),
    and one figure-level legend below the panels lists every series of every panel (proxy artists, so a series
    present in one panel only is listed too)."""
    panels = [p for p in panels if p.values()]
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return None
    labels = list(dict.fromkeys(lab for p in panels for lab, pts in p.series.items() if pts))
    labels.sort(key=lambda lab: not lab.startswith("jax"))  # JAX first, otherwise in order of appearance
    colours = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20").colors
    style = {lab: dict(color=colours[i % len(colours)], marker=MARKERS[i % len(MARKERS)],
                       linestyle="--" if _is_torch(lab) else "-") for i, lab in enumerate(labels)}
    ncols = ncols or min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    widths = [max(6.4, min(16.0, 1.6 + 0.2 * len(p.categories) * max(1, len(p.series)))) if p.kind == "bar"
              else 4.8 for p in panels]
    fig_w = max(widths) * ncols
    legend_cols = max(1, min(len(labels), int(fig_w // (0.058 * max(map(len, labels)) + 0.6))))
    legend_rows = -(-len(labels) // legend_cols)
    rotate = any(p.kind == "bar" and max(map(len, map(str, p.categories)), default=0) > 7 for p in panels)
    panel_h = 3.9 + (0.6 if rotate else 0.0)
    legend_h = 0.22 * legend_rows + 0.2
    title_lines = textwrap.wrap(title, width=max(40, int(fig_w / 0.1)), break_on_hyphens=False)  # ~0.1 in/char
    title_h = 0.2 * len(title_lines) + 0.2
    fig_h = panel_h * nrows + legend_h + title_h
    fig, axes = plt.subplots(nrows, ncols, figsize=(fig_w, fig_h), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, panel, [lab for lab in labels if panel.series.get(lab)], style)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    any_line = any(p.kind == "line" for p in panels)
    proxies = [Line2D([], [], **style[lab]) if any_line else
               Patch(facecolor=style[lab]["color"], hatch="//" if _is_torch(lab) else None, edgecolor="white")
               for lab in labels]
    fig.legend(proxies, labels, loc="outside lower center", ncol=legend_cols, fontsize=8, frameon=False)
    fig.suptitle("\n".join(title_lines), fontsize=11)
    path = os.path.join(out_dir, name)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return Plot(path, title, tuple(labels), tuple(p.title for p in panels))


def _draw_panel(ax, panel: Panel, labels: list, style: dict) -> None:
    vals = [v for v in panel.values() if v > 0]
    logy = panel.logy if panel.logy is not None else bool(vals) and max(vals) / min(vals) >= 20
    if panel.kind == "line":
        for lab in labels:
            pts = sorted((x, y) for x, y in panel.series[lab].items() if isinstance(y, (int, float)))
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=lab, **style[lab])
        if panel.logx:
            ax.set_xscale("log", base=panel.logx)
            xs = sorted({x for lab in labels for x in panel.series[lab]})
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
    else:
        groups = [[lab for lab in labels if cat in panel.series[lab]] for cat in panel.categories]
        width = 0.8 / max(1, max(map(len, groups), default=1))
        for i, (cat, group) in enumerate(zip(panel.categories, groups)):
            for j, lab in enumerate(group):  # each category's bars centred on its tick, in legend order
                x, y = i + width * (j + 0.5 - len(group) / 2), panel.series[lab][cat]
                if isinstance(y, (int, float)):
                    ax.bar(x, y, width, color=style[lab]["color"], hatch="//" if _is_torch(lab) else None,
                           edgecolor="white", linewidth=0.5, label=lab)
                else:  # measured nothing: say so where the bar would be
                    ax.text(x, 0.02, "skipped" if y is None else str(y), transform=ax.get_xaxis_transform(),
                            rotation=90, ha="center", va="bottom", fontsize=7, color=style[lab]["color"])
        ax.set_xticks(range(len(panel.categories)), [str(c) for c in panel.categories],
                      rotation=30 if max(map(len, map(str, panel.categories)), default=0) > 7 else 0,
                      ha="right" if max(map(len, map(str, panel.categories)), default=0) > 7 else "center")
        ax.set_xlim(-0.6, len(panel.categories) - 0.4)
    if logy:  # decades labelled as plain numbers, no labels on the minor ticks
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    if panel.kind == "bar" and not logy:  # bars from 0, room above the highest reference line for its text
        top = max([ax.get_ylim()[1]] + [1.1 * y for y, _ in panel.limits])
        ax.set_ylim(0, top if max(panel.values(), default=0) > 0 or panel.limits else 1)
    for y, text in panel.limits:
        ax.axhline(y, color="0.4", linestyle=":", linewidth=1)
        ax.annotate(text, (1, y), xycoords=("axes fraction", "data"), xytext=(-3, 3), textcoords="offset points",
                    ha="right", va="bottom", fontsize=7, color="0.3")
    if panel.note:
        ax.text(0.02, 0.96, panel.note, transform=ax.transAxes, va="top", fontsize=8, color="0.3")
    ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
    ax.grid(alpha=0.3, axis="y" if panel.kind == "bar" else "both")


def _ok(records: Iterable[dict], key: Optional[str] = None) -> list:
    return [r for r in records if r.get("status", "ok") == "ok" and (key is None or r.get(key) is not None)]


def _where(info: Optional[dict]) -> str:
    """The device part of a plot title: ``info``'s device, and "--quick shapes" for a quick run."""
    info = info or {}
    return f"{info.get('jax_device') or 'unknown device'}" + (", --quick shapes" if info.get("quick") else "")


def plot_attention(out_dir: str, records: list[dict], info: Optional[dict] = None) -> Optional[Plot]:
    """TFLOP/s against sequence length, one panel per (pass, causal, D), one line per implementation; None
    (nothing written) with fewer than two sequence lengths."""
    ok = _ok(records, "tflops")
    if len({r["Sk"] for r in ok}) < 2:
        return None
    panels = []
    keys = {(r["pass"], r["causal"], r["D"]) for r in ok}
    for p, c, d in sorted(keys, key=lambda k: (str(k[:2]), str(k[2]).zfill(6))):  # D numerically
        series: dict = {}
        for r in ok:
            if (r["pass"], r["causal"], r["D"]) == (p, c, d):
                series.setdefault(_impl(r), {})[r["Sk"]] = r["tflops"]
        panels.append(Panel(f"{p}, causal={c}, D={d}", "sequence length (tokens)", "TFLOP/s", series, logx=2))
    dtypes = ", ".join(sorted({str(r.get("dtype")) for r in ok}))
    return draw(out_dir, PLOT_FILES["attention"], f"Attention throughput ({dtypes}) — {_where(info)}", panels,
                ncols=min(len(panels), 4))


def plot_train(out_dir: str, records: list[dict], info: Optional[dict] = None) -> Optional[Plot]:
    """Tokens/s of one train step per toggle, JAX and torch bars side by side, one panel per model shape;
    a skipped toggle is marked "skipped", one that does not apply (torch.compile for JAX) "n/a"."""
    panels = []
    for shape in dict.fromkeys((r.get("preset"), r.get("B"), r.get("S")) for r in records):
        sel = [r for r in records if (r.get("preset"), r.get("B"), r.get("S")) == shape]
        series: dict = {}
        for r in sel:
            ok = r.get("status", "ok") == "ok" and r.get("tokens_per_s") is not None
            series.setdefault(_impl(r), {})[r["toggle"]] = r["tokens_per_s"] if ok else None
        cats = tuple(dict.fromkeys(r["toggle"] for r in sel))
        for pts in series.values():  # a toggle one framework has no row for (torch.compile: JAX always jits)
            pts.update({c: "n/a" for c in cats if c not in pts})
        panels.append(Panel(f"{shape[0]}, B={shape[1]}, S={shape[2]}", "training toggle (one change from the fp32 "
                            "baseline)", "tokens/s", series, kind="bar", categories=cats))
    return draw(out_dir, PLOT_FILES["train"], f"Train step throughput per toggle — {_where(info)}", panels, ncols=1)


REMAT_ORDER = ("none", "save_dots", "save_qkv_attn", "full", "offload")


def plot_remat(out_dir: str, records: list[dict], info: Optional[dict] = None) -> Optional[Plot]:
    """Memory per remat policy, one panel per model shape: JAX's compiled temp bytes (CPU, and the H100 ones
    "compiled, not run"), JAX's saved residuals, torch's bytes kept for the backward (and its peak on a GPU)."""
    panels = []
    ok = _ok(records, "measured")
    for shape in dict.fromkeys((r["preset"], r["n_layers"], r["B"], r["S"]) for r in ok):
        series: dict = {}
        for r in ok:
            if (r["preset"], r["n_layers"], r["B"], r["S"]) != shape:
                continue
            m, pol, tgt = r["measured"], r["impl"], r["target"]
            where = "H100, compiled, not run" if tgt == "h100" else tgt
            if r["framework"] == "jax":
                series.setdefault(f"jax: XLA temp ({where})", {})[pol] = m["temp_bytes"] / 2**30
                if m.get("residual_bytes") is not None:  # the same for every target: one series
                    series.setdefault("jax: saved residuals", {}).setdefault(pol, m["residual_bytes"] / 2**30)
            else:
                series.setdefault(f"torch: saved for backward ({tgt})", {})[pol] = m["saved_bytes"] / 2**30
                if m.get("peak_mem_bytes"):
                    series.setdefault(f"torch: peak allocated ({tgt})", {})[pol] = m["peak_mem_bytes"] / 2**30
        pols = {p for pts in series.values() for p in pts}
        cats = tuple(p for p in REMAT_ORDER if p in pols) + tuple(sorted(pols - set(REMAT_ORDER)))
        panels.append(Panel(f"{shape[0]} (n_layers={shape[1]}), B={shape[2]}, S={shape[3]}, bf16",
                            "remat policy", "memory (GiB)", series, kind="bar", categories=cats))
    return draw(out_dir, PLOT_FILES["remat"], f"Activation memory per remat policy — {_where(info)}; "
                "H100 bars compiled, not run", panels, ncols=1)


def plot_decode(out_dir: str, records: list[dict], info: Optional[dict] = None) -> Optional[Plot]:
    """Tokens/s against batch size, one panel per (model, pass), one line per framework x weights (the device
    in the label when the frameworks ran on different ones); log y when the values span decades."""
    ok = _ok(records, "tokens_per_s")
    devices = {r.get("device") for r in ok}
    panels = []
    for model, pss in sorted({(r["model"], r["pass"]) for r in ok}, key=lambda k: (k[0], k[1] != "decode")):
        series: dict = {}
        for r in ok:
            if (r["model"], r["pass"]) == (model, pss):
                lab = f"{_impl(r)} {r['weights']}" + (f" ({r.get('device')})" if len(devices) > 1 else "")
                series.setdefault(lab, {})[r["B"]] = r["tokens_per_s"]
        what = "one step, B new tokens" if pss == "decode" else f"prompt of {ok[0].get('prompt_len')} tokens"
        panels.append(Panel(f"{model}: {pss} ({what})", "batch size", "tokens/s", series, logx=2))
    return draw(out_dir, PLOT_FILES["decode"], f"Decode and prefill throughput with the KV cache — {_where(info)}",
                panels, ncols=2)


_STAGES = {"flash_fwd": "fwd", "mosaic_fwd": "fwd", "flash_bwd_dq": "bwd dq", "flash_bwd_dkv": "bwd dkv"}


def plot_kernels(out_dir: str, records: list[dict], info: Optional[dict] = None,
                 name: Optional[str] = None) -> Optional[Plot]:
    """Registers per thread, spill bytes and shared memory of each compiled attention kernel (``kernels.json``
    of ``python -m benchmarks compile``, or the kernel records of the ``compile`` suite), one bar per
    implementation x dtype, grouped by kernel and head dim. Compiled for the target, never run."""
    ok = [r for r in _ok(records, "registers") if r.get("part", "kernel") == "kernel"]
    if not ok:
        return None
    limits = {"max_regs_per_thread": 255, "smem_per_block": 232448}
    with contextlib.suppress(Exception):  # the H100 table, where it imports
        from .kernel_stats import H100_LIMITS as limits  # noqa: F811
    stage = lambda r: _STAGES.get(r["kernel"], r["kernel"])  # noqa: E731
    order = list(dict.fromkeys(_STAGES.values()))
    cats = sorted({(stage(r), r["head_dim"]) for r in ok},
                  key=lambda c: (order.index(c[0]) if c[0] in order else len(order), c[0], c[1]))
    cat_names = tuple(f"{s} D={d}" for s, d in cats)
    metrics = [("registers per thread", "registers", lambda r: r["registers"],
                ((limits["max_regs_per_thread"], f"max {limits['max_regs_per_thread']} / thread"),)),
               ("spilled bytes (stores + loads)", "bytes", lambda r: (r.get("spill_stores") or 0)
                + (r.get("spill_loads") or 0), ()),
               ("shared memory per block", "KiB", lambda r: r["smem_bytes"] / 1024,
                ((limits["smem_per_block"] / 1024, f"max {limits['smem_per_block'] / 1024:.0f} KiB / block"),))]
    panels = []
    for title, unit, get, lims in metrics:
        series: dict = {}
        for r in ok:
            series.setdefault(f"{r['impl']} {r['dtype']}", {})[f"{stage(r)} D={r['head_dim']}"] = get(r)
        note = "no spills" if title.startswith("spilled") and not any(
            v for pts in series.values() for v in pts.values()) else None
        panels.append(Panel(title, "kernel, head dim", unit, series, kind="bar", categories=cat_names, logy=False,
                            limits=lims, note=note))
    label = next((r.get("label") for r in ok if r.get("label")), "compiled for the target, not run")
    target = (info or {}).get("target_device") or label.replace("compiled for ", "").replace(", not run", "")
    r0 = ok[0]
    title = (f"Attention kernels for {target} — compiled, not run (deviceless, ptxas -v); "
             f"B={r0.get('B')}, S={r0.get('S')}, Hq={r0.get('Hq')}, causal={r0.get('causal')}")
    return draw(out_dir, name or PLOT_FILES["kernels"], title, panels, ncols=1)


PLOT_FILES = {"attention": "attention_tflops.png", "train": "train_tokens_per_s.png", "remat": "remat_memory.png",
              "decode": "decode_tokens_per_s.png", "compile": "compile_kernels.png", "kernels": "kernels.png"}
PLOTTERS: dict[str, Callable] = {"attention": plot_attention, "train": plot_train, "remat": plot_remat,
                                 "decode": plot_decode, "compile": plot_kernels, "kernels": plot_kernels}


def plot_suite(out_dir: str, suite: str, records: list[dict], info: Optional[dict] = None) -> Optional[Plot]:
    """The plot of ``suite`` (:data:`PLOTTERS`) from its records into ``out_dir/PLOT_FILES[suite]``; None (and
    nothing written) for a suite without a plot or records with nothing measured."""
    if suite not in PLOTTERS or not _ok(records):
        return None
    if suite in ("compile", "kernels"):
        return plot_kernels(out_dir, records, info, PLOT_FILES[suite])
    return PLOTTERS[suite](out_dir, records, info)
