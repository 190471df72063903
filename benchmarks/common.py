"""Timing, environment and report helpers shared by every benchmark suite (CONVENTIONS §9).

Timing: warm-up calls first (compilation, autotuning and allocator growth stay out), then ``iters`` timed calls,
each closed by ``jax.block_until_ready`` / ``torch.cuda.synchronize``; we report the median and the 10th/90th
percentiles. A record is a flat dict; a suite returns a list of them and ``write_results`` stores
``<out>/<suite>.json`` (environment + records) and a ``report.md`` with JAX and torch side by side.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Optional

MEASURED = {"median_ms", "p10_ms", "p90_ms", "tflops", "tokens_per_s", "peak_mem_bytes", "mfu", "max_abs_diff",
            "status", "reason", "impl", "framework", "iters"}


def _sync(out: Any) -> None:
    """Wait for device work behind ``out`` (jax arrays, torch tensors, or pytrees of them)."""
    if "jax" in sys.modules:
        import jax

        jax.block_until_ready(out)
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def timeit(fn: Callable, *args, warmup: int = 3, iters: int = 20, **kwargs) -> dict:
    """Median wall time of ``fn(*args, **kwargs)`` over ``iters`` synchronized calls after ``warmup`` calls."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    for _ in range(warmup):
        _sync(fn(*args, **kwargs))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _sync(fn(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median_s": statistics.median(times), "p10_s": q(0.1), "p90_s": q(0.9), "iters": iters}


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
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def torch_reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def torch_peak_memory() -> Optional[int]:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


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


def write_results(out_dir: str, suite: str, records: list[dict], info: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{suite}.json")
    with open(path, "w") as f:
        json.dump({"env": info, "suite": suite, "records": records}, f, indent=1, default=str)
    return path


def _fmt(r: dict) -> str:
    if r.get("status", "ok") != "ok":
        return "—"
    s = f"{r['median_ms']:.3g} ms"
    if r.get("tflops"):
        s += f" ({r['tflops']:.3g} TF/s)"
    elif r.get("tokens_per_s"):
        s += f" ({r['tokens_per_s']:.3g} tok/s)"
    return s


def report_table(records: Iterable[dict]) -> str:
    """Markdown table: one row per shape/pass, one column per implementation, and the speed ratio
    (fastest torch time / fastest JAX time; > 1 means JAX is faster)."""
    records = list(records)
    impls = list(dict.fromkeys(f"{r['framework']}:{r['impl']}" for r in records))
    keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in MEASURED and k != "suite"]
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault(tuple(r.get(k) for k in keys), {})[f"{r['framework']}:{r['impl']}"] = r
    head = "| " + " | ".join(keys + impls + ["torch/jax"]) + " |"
    lines = [head, "|" + "---|" * (len(keys) + len(impls) + 1)]
    for key, cells in rows.items():
        best = {fw: min((c["median_ms"] for c in cells.values() if c["framework"] == fw and c.get("status", "ok") == "ok"),
                        default=math.nan) for fw in ("jax", "torch")}
        ratio = best["torch"] / best["jax"] if best["jax"] == best["jax"] and best["torch"] == best["torch"] else math.nan
        vals = [str(v) for v in key] + [_fmt(cells[i]) if i in cells else "" for i in impls]
        lines.append("| " + " | ".join(vals + ["" if math.isnan(ratio) else f"{ratio:.2f}x"]) + " |")
    return "\n".join(lines)


def write_report(out_dir: str, results: dict[str, list[dict]], info: dict) -> str:
    parts = [f"# Benchmark report — {info.get('jax_device')}", "",
             "Generated by `python -m benchmarks run`; numbers come from the JSON files beside this report.", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in info.items() if v is not None), ""]
    for suite, recs in results.items():
        parts += [f"## {suite}", "", report_table(recs), ""]
        skipped = [r for r in recs if r.get("status") == "skipped"]
        if skipped:
            parts += ["Skipped: " + "; ".join(f"{r['framework']}:{r['impl']} ({r.get('reason')})" for r in
                                              {(r['framework'], r['impl']): r for r in skipped}.values()), ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def plot_attention(out_dir: str, records: list[dict]) -> Optional[str]:
    """TFLOP/s against sequence length, one line per implementation, one panel per (pass, causal, D)."""
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
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (p, c, d) in zip(axes[0], panels):
        sel = [r for r in ok if (r["pass"], r["causal"], r["D"]) == (p, c, d)]
        for impl in dict.fromkeys(f"{r['framework']}:{r['impl']}" for r in sel):
            pts = sorted((r["Sk"], r["tflops"]) for r in sel if f"{r['framework']}:{r['impl']}" == impl)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{p}, causal={c}, D={d}", xlabel="sequence length", ylabel="TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    path = os.path.join(out_dir, "attention_tflops.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
