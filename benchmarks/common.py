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
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

from jaxattn.spec.timing import time_calls

MEASURED = {"median_ms", "p10_ms", "p90_ms", "tflops", "tokens_per_s", "peak_mem_bytes", "mfu", "max_abs_diff",
            "status", "reason", "impl", "framework", "iters", "measured", "summary"}


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


def report_table(records: Iterable[dict]) -> str:
    """Markdown table: one row per shape/pass, one column per implementation, and :data:`SPEEDUP_COLUMN`
    (fastest torch time / fastest JAX time; > 1 means JAX is faster)."""
    records = list(records)
    impls = list(dict.fromkeys(_impl(r) for r in records))
    keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in MEASURED and k != "suite"]
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault(tuple(r.get(k) for k in keys), {})[_impl(r)] = r
    head = "| " + " | ".join(keys + impls + [SPEEDUP_COLUMN]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(impls) + 1)]
    for key, cells in rows.items():
        best = {fw: min((c["median_ms"] for c in cells.values() if c.get("framework") == fw
                         and c.get("status", "ok") == "ok" and isinstance(c.get("median_ms"), (int, float))),
                        default=math.nan) for fw in ("jax", "torch")}
        ratio = best["torch"] / best["jax"] if best["jax"] == best["jax"] and best["torch"] == best["torch"] else math.nan
        vals = [str(v) for v in key] + [_fmt(cells[i]) if i in cells else "" for i in impls]
        lines.append("| " + " | ".join(vals + ["" if math.isnan(ratio) else f"{ratio:.2f}x"]) + " |")
    return "\n".join(lines)


def render_report(suites: list[tuple[str, list[dict], Optional[str]]], info: dict, generated_by: str) -> str:
    """The markdown of ``report.md``: a header naming the device, how it was made and the environment, then per
    ``(suite, records, measured_at)`` its table (``measured_at`` None: this run) and the skipped implementations."""
    parts = [f"# Benchmark report — {info.get('jax_device')}", "", generated_by, "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in info.items() if v is not None), "",
             SPEEDUP_NOTE, ""]
    for suite, recs, when in suites:
        parts += [f"## {suite}", ""] + ([f"From {suite}.json, measured at {when}.", ""] if when else [])
        parts += [report_table(recs), ""]
        skipped = [r for r in recs if r.get("status") == "skipped"]
        if skipped:
            parts += ["Skipped: " + "; ".join(f"{_impl(r)} ({r.get('reason')})" for r in
                                              {_impl(r): r for r in skipped}.values()), ""]
    return "\n".join(parts)


def write_report(out_dir: str, results: dict[str, list[dict]], info: dict) -> str:
    """``report.md`` for this run's ``results`` plus every other suite whose JSON is already in ``out_dir``
    (a run of one suite keeps the others' tables), written atomically."""
    earlier = {k: v for k, v in read_results(out_dir).items() if k not in results}
    suites = [(s, r, None) for s, r in results.items()]
    suites += [(s, d["records"], (d.get("env") or {}).get("time_utc", "an earlier run")) for s, d in earlier.items()]
    text = render_report(suites, info, "Generated by `python -m benchmarks run`; numbers come from the JSON files "
                                       "beside this report.")
    return write_text_atomic(os.path.join(out_dir, "report.md"), text)


def rebuild_report(out_dir: str) -> list[str]:
    """Rebuild ``report.md`` and the plots in ``out_dir`` from the suite JSON files already there, running
    nothing (``python -m benchmarks report DIR``). The header's environment is the most recent JSON's. Returns
    the paths written. Raises ValueError naming ``out_dir`` when it holds no benchmark JSON, or only
    deviceless-compile suites (:data:`COMPILED_SUITES`, whose report ``python -m benchmarks compile`` writes)."""
    if not os.path.isdir(out_dir):
        raise ValueError(f"report: {out_dir!r} is not a directory; give a results directory holding <suite>.json "
                         f"files (e.g. benchmarks/results/<device>)")
    found = read_results(out_dir)
    timed = {s: d for s, d in found.items() if s not in COMPILED_SUITES}
    if not timed:
        what = (f"only deviceless-compile results ({', '.join(s + '.json' for s in found)}), whose report "
                f"`python -m benchmarks compile` writes" if found else "no benchmark JSON (<suite>.json with records)")
        raise ValueError(f"report: {out_dir!r} holds {what}; nothing to rebuild")
    envs = [d.get("env") or {} for d in timed.values()]
    info = max(envs, key=lambda e: str(e.get("time_utc", "")))
    suites = [(s, d["records"], (d.get("env") or {}).get("time_utc", "an unknown time")) for s, d in timed.items()]
    generated = ("Rebuilt by `python -m benchmarks report` from the JSON files beside this report (nothing was "
                 "re-run); the environment line is the most recent file's.")
    written = [write_text_atomic(os.path.join(out_dir, "report.md"), render_report(suites, info, generated))]
    if "attention" in timed:
        png = plot_attention(out_dir, timed["attention"]["records"])
        if png:
            written.append(png)
    return written


def plot_attention(out_dir: str, records: list[dict]) -> Optional[str]:
    """TFLOP/s against sequence length, one panel per (pass, causal, D), one line per implementation.

    Each implementation keeps one colour and marker in every panel (JAX solid, torch dashed), and one
    figure-level legend below the panels lists every series that appears in any panel."""
    ok = [r for r in records if r.get("status", "ok") == "ok" and r.get("tflops")]
    if len({r["Sk"] for r in ok}) < 2:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = sorted({(r["pass"], r["causal"], r["D"]) for r in ok}, key=str)
    impls = sorted(dict.fromkeys(_impl(r) for r in ok), key=lambda i: not i.startswith("jax:"))  # JAX first
    colours = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20").colors
    markers = "osD^vP*Xh<>p"
    style = {impl: dict(color=colours[i % len(colours)], marker=markers[i % len(markers)],
                        linestyle="-" if impl.startswith("jax:") else "--") for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    handles = {}
    for ax, (p, c, d) in zip(axes[0], panels):
        sel = [r for r in ok if (r["pass"], r["causal"], r["D"]) == (p, c, d)]
        for impl in impls:
            pts = sorted((r["Sk"], r["tflops"]) for r in sel if f"{r['framework']}:{r['impl']}" == impl)
            if pts:
                (line,) = ax.plot([x for x, _ in pts], [y for _, y in pts], label=impl, **style[impl])
                handles.setdefault(impl, line)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{p}, causal={c}, D={d}", xlabel="sequence length", ylabel="TFLOP/s")
        ax.grid(alpha=0.3)
    fig.legend([handles[i] for i in impls if i in handles], [i for i in impls if i in handles],
               loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    rows = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 1))
    path = os.path.join(out_dir, "attention_tflops.png")
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path
