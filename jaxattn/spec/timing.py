"""Framework-neutral timing: medians and percentiles, a warm-up-then-timed loop, and a per-phase step timer.

Both ``jaxattn.profiling`` and ``torchref.profiling`` build on this with their own ``synchronize`` (a wall time
is only meaningful once the device work behind it has finished), so the benchmarks and the trainers of both
frameworks time the same way.

    stats = time_calls(lambda: sum(range(1000)), warmup=2, iters=20)   # {"median_s", "p10_s", "p90_s", "iters"}
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["percentile", "summarize", "time_calls", "StepTimer"]


def _no_sync(_out: Any = None) -> None:
    return None


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of ``values`` by the nearest-rank rule on the sorted list
    (``sorted[min(n - 1, int(q * n))]``): always one of the measured values, never an interpolation."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile: values is empty; need at least one measurement")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q must be in [0, 1], got {q!r}")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(times: Iterable[float]) -> dict:
    """``{"median_s", "p10_s", "p90_s", "iters"}`` of a list of durations in seconds."""
    xs = sorted(times)
    if not xs:
        raise ValueError("summarize: times is empty; need at least one measurement")
    return {
        "median_s": statistics.median(xs),
        "p10_s": percentile(xs, 0.1),
        "p90_s": percentile(xs, 0.9),
        "iters": len(xs),
    }


def time_calls(
    fn: Callable, *args, warmup: int = 3, iters: int = 20, sync: Callable[[Any], None] = _no_sync, **kwargs
) -> dict:
    """Median wall time of ``fn(*args, **kwargs)`` over ``iters`` calls after ``warmup`` untimed calls
    (compilation, autotuning and allocator growth stay out). Each call's result is passed to ``sync`` before
    the clock stops (``jax.block_until_ready``, ``torch.cuda.synchronize``)."""
    if (
        isinstance(iters, bool)
        or not isinstance(iters, int)
        or iters < 1
        or isinstance(warmup, bool)
        or not isinstance(warmup, int)
        or warmup < 0
    ):
        raise ValueError(f"need iters >= 1 and warmup >= 0 (ints), got iters={iters!r}, warmup={warmup!r}")
    for _ in range(warmup):
        sync(fn(*args, **kwargs))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sync(fn(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    return summarize(times)


class _Phase:
    """Handle yielded by :meth:`StepTimer.phase`: ``wait_on(x)`` names what the phase's clock waits for."""

    def __init__(self):
        self.out: Any = None
        self.waited = False

    def wait_on(self, out: Any) -> Any:
        self.out, self.waited = out, True
        return out


class StepTimer:
    """Wall time per named phase of a step (data, forward, backward, optimizer, ...), summarised by medians.

        timer = StepTimer(sync=jaxattn.profiling.synchronize)
        for batch in batches:
            with timer.phase("data"):
                batch = next(it)
            with timer.phase("step") as ph:
                state, metrics = ph.wait_on(step(state, batch))
        print(timer.report())

    ``sync`` is called with what the phase waited on (``ph.wait_on(x)``), or with no argument when it waited on
    nothing (the framework's "wait for all device work"). ``skip_first`` drops each phase's first ``n``
    durations (compilation) from the summary."""

    def __init__(self, sync: Callable[..., None] | None = None, skip_first: int = 0):
        if isinstance(skip_first, bool) or not isinstance(skip_first, int) or skip_first < 0:
            raise ValueError(f"skip_first must be an int >= 0, got {skip_first!r}")
        self.sync = sync or _no_sync
        self.skip_first = skip_first
        self.times: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty str, got {name!r}")
        ph = _Phase()
        t0 = time.perf_counter()
        yield ph
        if ph.waited:
            self.sync(ph.out)
        else:
            self.sync()
        self.times.setdefault(name, []).append(time.perf_counter() - t0)

    def summary(self) -> dict[str, dict]:
        """``{phase: {"median_s", "p10_s", "p90_s", "iters", "total_s"}}`` in first-seen order (phases with no
        duration left after ``skip_first`` are left out)."""
        out = {}
        for name, ts in self.times.items():
            kept = ts[self.skip_first :]
            if kept:
                out[name] = dict(summarize(kept), total_s=sum(kept))
        return out

    def report(self) -> str:
        """A small text table: phase, count, median and p90 in ms, share of the summed medians."""
        s = self.summary()
        total = sum(v["median_s"] for v in s.values()) or 1.0
        lines = [f"{'phase':<16}{'n':>6}{'median ms':>12}{'p90 ms':>10}{'share':>8}"]
        for name, v in s.items():
            lines.append(
                f"{name:<16}{v['iters']:>6}{1e3 * v['median_s']:>12.3f}{1e3 * v['p90_s']:>10.3f}"
                f"{100 * v['median_s'] / total:>7.1f}%"
            )
        return "\n".join(lines)
