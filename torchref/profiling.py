"""Profiling for PyTorch (twin of ``jaxattn.profiling``): trace, synchronize, time, and memory snapshots.

    with trace("runs/prof"):                       # torch.profiler: a Chrome trace JSON (Perfetto, TensorBoard)
        loss = synchronize(model(x).sum())
    mem = MemoryTracker(); mem.snapshot("after init"); print(mem.report())
    stats = timeit(fn, x, iters=20)                # {"median_s", "p10_s", "p90_s", "iters"}

Memory: on CUDA ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (``source="torch.cuda"``); torch on
CPU keeps no allocator statistics, so a snapshot there reports the process's peak resident set size
(``"host RSS (resource.ru_maxrss)"``), which includes Python and everything else in the process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from twincore.memreport import format_memory_report
from twincore.runlog import host_peak_rss_bytes
from twincore.timing import StepTimer as _StepTimer
from twincore.timing import percentile, summarize, time_calls

__all__ = [
    "trace",
    "trace_files",
    "profiler",
    "synchronize",
    "timeit",
    "StepTimer",
    "MemoryTracker",
    "reset_peak_memory",
    "peak_memory_bytes",
    "summarize",
    "percentile",
]


def synchronize(out: Any = None) -> Any:
    """Wait for all queued CUDA work (``torch.cuda.synchronize``; a no-op on CPU, where ops run eagerly) and
    return ``out`` unchanged (a tensor or any nest of them), so it can wrap a call like ``jax.block_until_ready``."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


def _activities(cuda: bool | None):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda if cuda is not None else torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def profiler(log_dir: str, *, wait: int = 0, warmup: int = 1, active: int = 3, cuda: bool | None = None):
    """A ``torch.profiler.profile`` over a step window: call ``prof.step()`` after each step; steps
    ``wait + warmup .. + active`` are recorded and written to ``log_dir`` as a Chrome trace
    (``tensorboard_trace_handler``: ``<host>_<pid>.<ts>.pt.trace.json``)."""
    if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
        raise ValueError(f"log_dir must be a directory path, got {log_dir!r}")
    for name, v, lo in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    os.makedirs(log_dir, exist_ok=True)
    return torch.profiler.profile(
        activities=_activities(cuda),
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(log_dir)),
    )


@contextlib.contextmanager
def trace(log_dir: str, *, cuda: bool | None = None, record_shapes: bool = True):
    """Trace the whole block with ``torch.profiler`` and write ``<log_dir>/trace.json`` (Chrome trace format:
    ui.perfetto.dev, chrome://tracing and TensorBoard open it). Queued CUDA work is waited for before it stops.
    Yields the ``profile`` object (``prof.key_averages().table()`` for a summary)."""
    if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
        raise ValueError(f"log_dir must be a directory path, got {log_dir!r}")
    os.makedirs(log_dir, exist_ok=True)
    prof = torch.profiler.profile(activities=_activities(cuda), record_shapes=record_shapes)
    with prof:
        try:
            yield prof
        finally:
            synchronize()
    prof.export_chrome_trace(os.path.join(str(log_dir), "trace.json"))


def trace_files(log_dir: str) -> list[str]:
    """Every file a trace wrote under ``log_dir``."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs)


def timeit(fn: Callable, *args, warmup: int = 3, iters: int = 20, **kwargs) -> dict:
    """Median wall time of ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``iters`` calls each closed by
    :func:`synchronize`. ``{"median_s", "p10_s", "p90_s", "iters"}``."""
    return time_calls(fn, *args, warmup=warmup, iters=iters, sync=synchronize, **kwargs)


def StepTimer(skip_first: int = 0) -> _StepTimer:
    """A :class:`twincore.timing.StepTimer` whose phases end with :func:`synchronize`."""
    return _StepTimer(sync=synchronize, skip_first=skip_first)


def reset_peak_memory(device=None) -> None:
    """``torch.cuda.reset_peak_memory_stats`` (nothing to reset on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device=None, *, host_fallback: bool = True) -> int | None:
    """``torch.cuda.max_memory_allocated`` on a CUDA device; else the process's peak RSS (``host_fallback``) or
    None."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    return host_peak_rss_bytes() if host_fallback else None


class MemoryTracker:
    """Labelled memory snapshots over a run, each saying where its numbers come from.

        mem = MemoryTracker()
        mem.snapshot("init")
        loss.backward(); mem.snapshot("after backward")
        print(mem.report())

    A snapshot holds ``label``, ``index`` (order taken), ``source`` and either ``bytes_in_use`` / ``peak_bytes``
    (``source="torch.cuda"``) or ``host_peak_rss_bytes`` (``"host RSS (resource.ru_maxrss)"`` on CPU)."""

    def __init__(self, device=None):
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.snapshots: list[dict] = []

    def snapshot(self, label: str) -> dict:
        if not isinstance(label, str) or not label:
            raise ValueError(f"snapshot label must be a non-empty str, got {label!r}")
        snap: dict[str, Any] = {"label": label, "index": len(self.snapshots)}
        if self.device.type == "cuda":
            synchronize()
            snap["bytes_in_use"] = int(torch.cuda.memory_allocated(self.device))
            snap["peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            snap["source"] = "torch.cuda"
        else:
            snap["host_peak_rss_bytes"] = host_peak_rss_bytes()
            snap["source"] = "host RSS (resource.ru_maxrss)"
        self.snapshots.append(snap)
        return snap

    def report(self) -> str:
        return format_memory_report(self.snapshots, f"memory on {self.device}")
