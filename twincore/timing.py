"""Framework-neutral timing: medians and percentiles, a warm-up-then-timed loop, and a per-phase step timer.

Both ``jaxattn.profiling`` and ``torchref.profiling`` build on this with their own ``synchronize`` (a wall time
is only meaningful once the device work behind it has finished), so the benchmarks and the trainers of both
frameworks time the same way.

    stats = time_calls(lambda: sum(range(1000)), warmup=2, iters=20)   # {"median_s", "p10_s", "p90_s", "iters"}
    rounds = time_interleaved({"jax": f, "torch": g}, rounds=8, per_round=3)   # A B, B A, A B, ... per round
    paired_ratio(rounds["torch"], rounds["jax"])       # {"ratio": 1.31, "ci": [1.22, 1.40], "unstable": False, ...}
    pooled_ratio([pair_1["ratios"], pair_2["ratios"], pair_3["ratios"]])   # the same pair from three processes

Paired, interleaved comparison (design §9): two callables alternate in rounds, the order flipped each round (A B,
B A, ...) so a slow spell of the machine hits both; each round gives one duration per callable (the median of its
``per_round`` calls) and one ratio, and the reported ratio is the median of the per-round ratios with a
distribution-free 95% interval from order statistics (:func:`median_ci`). A ratio whose interval is wider than
:data:`UNSTABLE_CI` or whose callables' per-round times vary more than :data:`UNSTABLE_CV` is ``unstable``: a report
labels it and leaves it out of headline medians. The same pair measured in several fresh processes (pyperf's
worker processes: thread placement and memory layout change between processes, which no in-process pairing sees)
pools with :func:`pooled_ratio`: the median of all rounds, with a hierarchical bootstrap interval (processes
resampled, then rounds within each), ``unstable`` also when the processes' own ratios spread more than
:data:`UNSTABLE_SPREAD`. Hand-written, not ``torch.utils.benchmark.Timer``: its
``blocked_autorange`` times one statement in isolation and synchronizes only CUDA, while a pair needs the two
frameworks alternated in one loop with each one's own synchronization (the caller's ``sync``), the same rule for both.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "is_count",
    "percentile",
    "summarize",
    "time_calls",
    "StepTimer",
    "median_ci",
    "time_interleaved",
    "paired_ratio",
    "pooled_ratio",
    "UNSTABLE_CI",
    "UNSTABLE_CV",
    "UNSTABLE_SPREAD",
]

# A paired ratio is unstable when its 95% interval spans more than this factor (high / low) ...
UNSTABLE_CI = 1.5
# ... or when either side's per-round times have a coefficient of variation (stdev / mean) above this.
UNSTABLE_CV = 0.25
# ... or, pooled over processes, when the processes' ratios spread more than this (max / min: ±7% around the middle).
UNSTABLE_SPREAD = 1.15


def _no_sync(_out: Any = None) -> None:
    return None


def is_count(value, least: int) -> bool:
    """Whether ``value`` is a whole count (an ``int``, not a ``bool``) of at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


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
    if not (is_count(iters, 1) and is_count(warmup, 0)):
        raise ValueError(f"need iters >= 1 and warmup >= 0 (ints), got iters={iters!r}, warmup={warmup!r}")
    for _ in range(warmup):
        sync(fn(*args, **kwargs))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sync(fn(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    return summarize(times)


def median_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(low, high, coverage)``: a distribution-free interval for the median of ``values`` from order statistics,
    ``[x_(k), x_(n+1-k)]`` with the largest ``k`` whose coverage ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least
    ``confidence``; with too few values for that (n < 6 at 95%), ``[min, max]`` and its smaller coverage."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        raise ValueError("median_ci: values is empty; need at least one measurement")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"median_ci: confidence must be in (0, 1), got {confidence!r}")
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]  # P(Binomial(n, 1/2) = i)

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(below[:k])

    k = max((k for k in range(1, (n + 1) // 2 + 1) if coverage(k) >= confidence), default=1)
    return xs[k - 1], xs[n - k], coverage(k)


def time_interleaved(
    calls: Mapping[str, Callable[[], Any]],
    *,
    rounds: int = 8,
    per_round: int = 3,
    warmup: int = 2,
    sync: Callable[[Any], None] = _no_sync,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict]:
    """Times the zero-argument ``calls`` alternately: ``warmup`` untimed calls each, then ``rounds`` rounds, the
    order reversed every other round, each callable called ``per_round`` times in a row per round (each result
    passed to ``sync`` before the clock stops). Returns ``{name: {"rounds": [per-round median s], "calls": [every
    call's s], **summarize(calls), "cv": stdev / mean of the per-round medians}}`` (round to round, so a single
    slow call does not decide it; a machine whose speed drifts during the pair does)."""
    for name, value in (("rounds", rounds), ("per_round", per_round)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"time_interleaved: {name} must be an int >= 1, got {value!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"time_interleaved: warmup must be an int >= 0, got {warmup!r}")
    names = list(calls)
    if len(names) < 2:
        raise ValueError(f"time_interleaved: give at least two callables to alternate, got {names}")
    for _ in range(warmup):
        for name in names:
            sync(calls[name]())
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            ts = []
            for _ in range(per_round):
                t0 = clock()
                sync(calls[name]())
                ts.append(clock() - t0)
            times[name].append(ts)
    out = {}
    for name, per in times.items():
        flat = [t for ts in per for t in ts]
        medians = [statistics.median(ts) for ts in per]
        mean = statistics.fmean(medians)
        cv = statistics.stdev(medians) / mean if len(medians) > 1 and mean > 0 else 0.0
        out[name] = {"rounds": medians, "calls": flat, **summarize(flat), "cv": cv}
    return out


def paired_ratio(
    numerator: Iterable[float],
    denominator: Iterable[float],
    *,
    cv: Iterable[float] = (),
    confidence: float = 0.95,
) -> dict:
    """The paired ratio of two callables' per-round durations (from one :func:`time_interleaved`): per round
    ``numerator[i] / denominator[i]``, their median, its :func:`median_ci` interval, and ``unstable`` when the
    interval spans more than :data:`UNSTABLE_CI` (high / low) or a ``cv`` (round to round) is above
    :data:`UNSTABLE_CV`;
    ``finding`` is False when the interval includes 1 (no difference shown)."""
    num, den = list(numerator), list(denominator)
    if len(num) != len(den) or not num:
        raise ValueError(f"paired_ratio: need equally many rounds (>= 1), got {len(num)} and {len(den)}")
    if min(num + den) <= 0:
        raise ValueError("paired_ratio: durations must be > 0")
    ratios = [a / b for a, b in zip(num, den)]
    return _verdict(ratios, *median_ci(ratios, confidence), cv)


def _verdict(ratios: list, lo: float, hi: float, coverage: float, cv: Iterable[float], why: Iterable[str] = ()) -> dict:
    """The record of a ratio: median of ``ratios``, interval ``[lo, hi]``, and ``unstable`` with its reasons
    (interval wider than :data:`UNSTABLE_CI`, a ``cv`` above :data:`UNSTABLE_CV`, and the caller's ``why``)."""
    cvs, why = list(cv), list(why)
    if hi / lo > UNSTABLE_CI:
        why.insert(0, f"interval spans {hi / lo:.2f}x > {UNSTABLE_CI}x")
    if cvs and max(cvs) > UNSTABLE_CV:
        why.append(f"rounds vary by CV {max(cvs):.2f} > {UNSTABLE_CV}")
    return {
        "ratio": statistics.median(ratios),
        "ci": [lo, hi],
        "coverage": coverage,
        "rounds": len(ratios),
        "unstable": bool(why),
        "why": "; ".join(why),
        "finding": not lo <= 1.0 <= hi,
        "ratios": ratios,
    }


def pooled_ratio(
    per_process: Iterable[Iterable[float]],
    *,
    cv: Iterable[float] = (),
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """One paired ratio from the per-round ratios of the same pair measured in several processes
    (``per_process[p]`` = process p's :func:`paired_ratio` ``"ratios"``): the median of all rounds, a 95% interval
    by a hierarchical bootstrap (``resamples`` times: draw the processes with replacement, then each one's rounds
    with replacement; the interval is the middle ``confidence`` of the resampled medians), ``process_ratios`` (each
    process's median) and their ``spread`` (max / min). ``unstable`` as :func:`paired_ratio`, and also when the
    spread exceeds :data:`UNSTABLE_SPREAD`: processes that disagree are noise, whatever each one's interval says."""
    procs = [list(p) for p in per_process]
    if not procs or not all(procs):
        raise ValueError("pooled_ratio: need at least one process, each with at least one round")
    if min(min(p) for p in procs) <= 0:
        raise ValueError("pooled_ratio: ratios must be > 0")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"pooled_ratio: confidence must be in (0, 1), got {confidence!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"pooled_ratio: resamples must be an int >= 100, got {resamples!r}")
    rng = random.Random(seed)
    medians = sorted(
        statistics.median([x for p in rng.choices(procs, k=len(procs)) for x in rng.choices(p, k=len(p))])
        for _ in range(resamples)
    )
    tail = (1.0 - confidence) / 2
    lo, hi = percentile(medians, tail), percentile(medians, 1.0 - tail)
    per = [statistics.median(p) for p in procs]
    spread = max(per) / min(per)
    moved = [f"processes moved {spread:.2f}x > {UNSTABLE_SPREAD}x"] if spread > UNSTABLE_SPREAD else []
    out = _verdict([x for p in procs for x in p], lo, hi, confidence, cv, moved)
    return out | {"processes": len(procs), "process_ratios": per, "spread": spread}


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
