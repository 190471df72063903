"""Profiling for JAX (twin of ``torchref.profiling``): trace, synchronize, time, and memory snapshots.

    with trace("runs/prof"):                       # jax.profiler: TensorBoard xplane + Perfetto trace.json.gz
        state, m = synchronize(step(state, batch))
    mem = MemoryTracker(); mem.snapshot("after init"); print(mem.report())
    stats = timeit(jitted, x, iters=20)            # {"median_s", "p10_s", "p90_s", "iters"}

Memory: a device that keeps allocator statistics (GPU, TPU: ``jax.Device.memory_stats()``) gives bytes in use
and the peak; the CPU backend keeps none, so a snapshot then reports XLA's buffer assignment for a given jitted
function (``compiled.memory_analysis()``: arguments + outputs + temporaries - aliased) and the process's peak
resident set size. Every number carries its ``source``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import jax

from twincore.memreport import format_memory_report
from twincore.runlog import host_peak_rss_bytes
from twincore.timing import StepTimer as _StepTimer
from twincore.timing import percentile, summarize, time_calls

__all__ = [
    "trace",
    "trace_files",
    "start_trace",
    "stop_trace",
    "synchronize",
    "timeit",
    "StepTimer",
    "MemoryTracker",
    "device_memory_stats",
    "peak_memory_bytes",
    "compiled_memory",
    "summarize",
    "percentile",
]


def synchronize(tree: Any = None) -> Any:
    """Wait until every array in ``tree`` (any pytree; non-array leaves are ignored) is computed and return it.
    With no argument, wait for every live array (all dispatched device work that produced one)."""
    if tree is None:
        jax.block_until_ready(jax.live_arrays())
        return None
    return jax.block_until_ready(tree)


def start_trace(log_dir: str) -> None:
    """Start ``jax.profiler`` into ``log_dir`` (created), with a Perfetto trace beside the TensorBoard one."""
    if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
        raise ValueError(f"log_dir must be a directory path, got {log_dir!r}")
    os.makedirs(log_dir, exist_ok=True)
    jax.profiler.start_trace(str(log_dir), create_perfetto_trace=True)


def stop_trace(tree: Any = None) -> None:
    """Wait for ``tree`` (or all live arrays) so the traced work is complete, then stop the trace."""
    synchronize(tree)
    jax.profiler.stop_trace()


@contextlib.contextmanager
def trace(log_dir: str):
    """Trace the block with ``jax.profiler``: ``<log_dir>/plugins/profile/<run>/`` gets ``*.xplane.pb``
    (TensorBoard's profile plugin, XProf) and ``perfetto_trace.json.gz`` (ui.perfetto.dev). Device work still
    running at the end of the block is waited for before the trace stops."""
    start_trace(log_dir)
    try:
        yield log_dir
    finally:
        stop_trace()


def trace_files(log_dir: str) -> list[str]:
    """Every file a trace wrote under ``log_dir`` (for tests and for printing where to look)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs)


def timeit(fn: Callable, *args, warmup: int = 3, iters: int = 20, **kwargs) -> dict:
    """Median wall time of ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``iters`` calls each closed by
    ``jax.block_until_ready`` on the result. ``{"median_s", "p10_s", "p90_s", "iters"}``."""
    return time_calls(fn, *args, warmup=warmup, iters=iters, sync=jax.block_until_ready, **kwargs)


def StepTimer(skip_first: int = 0) -> _StepTimer:
    """A :class:`twincore.timing.StepTimer` whose phases end with :func:`synchronize`."""
    return _StepTimer(sync=synchronize, skip_first=skip_first)


def _device(device=None):
    return jax.devices()[0] if device is None else device


def device_memory_stats(device=None) -> dict | None:
    """``device.memory_stats()`` (allocator statistics), or None where the backend keeps none (CPU)."""
    d = _device(device)
    return d.memory_stats() if hasattr(d, "memory_stats") else None


def peak_memory_bytes(device=None, *, host_fallback: bool = True) -> int | None:
    """Peak bytes in use on ``device`` since the process started (``peak_bytes_in_use``); where the backend keeps
    no statistics, the process's peak RSS (``host_fallback=True``) or None."""
    stats = device_memory_stats(device) or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return host_peak_rss_bytes() if host_fallback else None


def compiled_memory(fn: Callable, *args, **kwargs) -> dict | None:
    """XLA's buffer assignment for ``jax.jit``-ed ``fn`` at these arguments (compiles it; nothing runs):
    ``{"argument", "output", "temp", "alias", "total"}`` bytes, ``total = argument + output + temp - alias``.
    None when the backend gives no analysis. Workspace allocated inside a custom call may be missing."""
    lower = getattr(fn, "lower", None)
    if lower is None:
        raise TypeError(f"compiled_memory needs a jax.jit-ed function (with .lower), got {fn!r}")
    ma = lower(*args, **kwargs).compile().memory_analysis()
    if ma is None:
        return None
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "alias": int(getattr(ma, "alias_size_in_bytes", 0)),
    }
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


class MemoryTracker:
    """Labelled memory snapshots over a run, each saying where its numbers come from.

        mem = MemoryTracker()
        mem.snapshot("init")
        mem.snapshot("train step", fn=step, args=(state, batch))   # adds the compiled step's buffer sizes
        print(mem.report())

    A snapshot holds ``label``, ``index`` (order taken), ``source`` and, as available, ``bytes_in_use`` and
    ``peak_bytes`` (``source="device memory_stats"``), ``compiled`` (``source`` includes ``"compiled
    memory_analysis"``) and ``host_peak_rss_bytes`` (``"host RSS (resource.ru_maxrss)"``, when the device keeps
    no statistics)."""

    def __init__(self, device=None):
        self.device = _device(device)
        self.snapshots: list[dict] = []

    def snapshot(self, label: str, fn: Callable | None = None, args: tuple = (), kwargs: dict | None = None) -> dict:
        if not isinstance(label, str) or not label:
            raise ValueError(f"snapshot label must be a non-empty str, got {label!r}")
        snap: dict[str, Any] = {"label": label, "index": len(self.snapshots)}
        sources = []
        stats = device_memory_stats(self.device)
        if stats:
            synchronize()
            snap["bytes_in_use"] = int(stats.get("bytes_in_use", 0))
            snap["peak_bytes"] = int(stats.get("peak_bytes_in_use", 0))
            sources.append("device memory_stats")
        if fn is not None:
            snap["compiled"] = compiled_memory(fn, *args, **(kwargs or {}))
            sources.append("compiled memory_analysis")
        if not stats:
            snap["host_peak_rss_bytes"] = host_peak_rss_bytes()
            sources.append("host RSS (resource.ru_maxrss)")
        snap["source"] = " + ".join(sources)
        self.snapshots.append(snap)
        return snap

    def report(self) -> str:
        return format_memory_report(self.snapshots, f"memory on {self.device}")
