"""The profiling twins (``jaxattn.profiling``, ``torchref.profiling``) and the neutral ``twincore.timing``:
traces are written and non-empty, memory snapshots are ordered and say where their numbers come from, timer
medians are sane, synchronize passes nested pytrees / tensors through."""

import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import profiling as jprof
from twincore import timing

torch = pytest.importorskip("torch")
from torchref import profiling as tprof  # noqa: E402


# ---------------------------------------------------------------------------------------------- twincore.timing
def test_summarize_and_percentile_on_known_values():
    xs = [0.5, 0.1, 0.4, 0.2, 0.3]
    s = timing.summarize(xs)
    assert s == {"median_s": 0.3, "p10_s": 0.1, "p90_s": 0.5, "iters": 5}
    assert timing.percentile(range(1, 101), 0.9) == 91 and timing.percentile([7.0], 0.5) == 7.0
    with pytest.raises(ValueError, match="values is empty"):
        timing.percentile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\], got 1.5"):
        timing.percentile([1.0], 1.5)
    with pytest.raises(ValueError, match="iters >= 1 .* got iters=0"):
        timing.time_calls(lambda: None, iters=0)


def test_time_calls_median_is_sane_and_syncs_every_call():
    seen = []
    stats = timing.time_calls(lambda d: time.sleep(d) or d, 0.002, warmup=2, iters=9, sync=seen.append)
    assert len(seen) == 11 and all(x == 0.002 for x in seen)  # warm-up and timed calls are all synchronized
    assert stats["iters"] == 9 and 0.002 <= stats["p10_s"] <= stats["median_s"] <= stats["p90_s"] < 0.2


def test_step_timer_phases_in_order_with_medians():
    synced = []
    timer = timing.StepTimer(sync=lambda *a: synced.append(a), skip_first=1)
    for _ in range(4):
        with timer.phase("data"):
            time.sleep(0.001)
        with timer.phase("step") as ph:
            ph.wait_on(time.sleep(0.004) or "out")
    s = timer.summary()
    assert list(s) == ["data", "step"] and s["data"]["iters"] == 3 == s["step"]["iters"]
    assert 0.001 <= s["data"]["median_s"] < s["step"]["median_s"] < 0.2
    assert synced.count(()) == 4 and synced.count(("out",)) == 4  # no wait_on: global sync; else the value
    assert "data" in timer.report() and "share" in timer.report()
    with pytest.raises(ValueError, match="skip_first must be an int >= 0, got -1"):
        timing.StepTimer(skip_first=-1)


def test_median_ci_is_the_order_statistic_interval_with_its_binomial_coverage():
    # n = 10: [x_(2), x_(9)], coverage 1 - 2 * (1 + 10) / 1024; n = 20: [x_(6), x_(15)]; n < 6: [min, max]
    assert timing.median_ci(range(10)) == (1, 8, 1 - 2 * 11 / 1024)
    lo, hi, cov = timing.median_ci(range(20))
    assert (
        (lo, hi) == (5, 14)
        and cov >= 0.95
        and 1 - 2 * sum(__import__("math").comb(20, i) for i in range(7)) / 2**20 < 0.95
    )
    assert timing.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
    with pytest.raises(ValueError, match="values is empty"):
        timing.median_ci([])


def test_time_interleaved_alternates_the_order_each_round_and_syncs_every_call():
    """A fake clock that advances by the callable's cost: the per-round durations are exact, and the call order
    is A B | B A | A B (each ``per_round`` times in a row)."""
    now, order, synced = [0.0], [], []
    cost = {"a": 2.0, "b": 3.0}

    def make(name):
        def call():
            order.append(name)
            now[0] += cost[name]
            return name

        return call

    t = timing.time_interleaved(
        {"a": make("a"), "b": make("b")}, rounds=3, per_round=2, warmup=1, sync=synced.append, clock=lambda: now[0]
    )
    assert order == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert len(synced) == len(order)
    assert t["a"]["rounds"] == [2.0] * 3 and t["b"]["rounds"] == [3.0] * 3 and t["a"]["cv"] == 0.0
    p = timing.paired_ratio(t["b"]["rounds"], t["a"]["rounds"], cv=(t["a"]["cv"], t["b"]["cv"]))
    assert p["ratio"] == 1.5 and p["ci"] == [1.5, 1.5] and not p["unstable"] and p["finding"]
    with pytest.raises(ValueError, match="at least two callables"):
        timing.time_interleaved({"a": make("a")})


def test_paired_ratio_labels_a_wide_interval_or_a_drifting_side_unstable():
    steady = timing.paired_ratio([2.0] * 10, [1.0] * 10)
    assert steady["ratio"] == 2.0 and not steady["unstable"] and steady["rounds"] == 10
    wide = timing.paired_ratio([1.0, 3.0] * 5, [1.0] * 10)  # per-round ratios 1 and 3: interval [1, 3]
    assert wide["unstable"] and "interval spans 3.00x > 1.5x" in wide["why"] and not wide["finding"]
    # the width is a factor (high / low), whatever the ratio's size: 0.1..0.3 is unstable, 10..14 is not
    assert timing.paired_ratio([0.1, 0.3] * 5, [1.0] * 10)["unstable"]
    assert not timing.paired_ratio([10.0, 14.0] * 5, [1.0] * 10)["unstable"]
    drift = timing.paired_ratio([2.0] * 10, [1.0] * 10, cv=(0.05, 0.4))
    assert drift["unstable"] and "rounds vary by CV 0.40 > 0.25" in drift["why"]
    with pytest.raises(ValueError, match="equally many rounds"):
        timing.paired_ratio([1.0], [1.0, 2.0])
    assert steady["ratios"] == [2.0] * 10  # per-round ratios kept: processes pool them (pooled_ratio)


def test_pooled_ratio_widens_to_the_processes_and_labels_processes_that_disagree():
    """The same pair from several processes: median of every round; the hierarchical bootstrap interval covers the
    spread between processes (which each process's own interval cannot); processes that moved more than
    UNSTABLE_SPREAD make the row unstable even when each one alone was steady."""
    rng = np.random.default_rng(0)
    agree = [list(1.3 + 0.02 * rng.standard_normal(15)) for _ in range(3)]
    p = timing.pooled_ratio(agree)
    assert p["processes"] == 3 and p["rounds"] == 45 and p["spread"] < 1.05 and not p["unstable"]
    assert p["ci"][0] < p["ratio"] < p["ci"][1] and p["ci"][1] / p["ci"][0] < 1.1 and p["finding"]
    apart = [list(r + 0.01 * rng.standard_normal(15)) for r in (1.0, 1.2, 1.45)]
    q = timing.pooled_ratio(apart)
    assert q["unstable"] and "processes moved" in q["why"] and q["spread"] > 1.4
    assert all(
        timing.paired_ratio(r, [1.0] * 15)["ci"][1] / timing.paired_ratio(r, [1.0] * 15)["ci"][0] < 1.1 for r in apart
    )  # each process alone: a tight interval
    assert q["ci"][0] < 1.1 and q["ci"][1] > 1.35  # the pooled one spans the processes
    assert timing.pooled_ratio(apart) == q  # seeded: the same record from the same rounds
    with pytest.raises(ValueError, match="at least one process"):
        timing.pooled_ratio([[1.0], []])
    with pytest.raises(ValueError, match="resamples"):
        timing.pooled_ratio(agree, resamples=10)


def test_pooled_interval_is_the_bootstraps_not_the_rounds_spread():
    """3 agreeing processes x 200 rounds of ratios spread ±10%: the interval is the median's (the hierarchical
    bootstrap's, ±1% here), not where the rounds lie (their 2.5-97.5% range, ±9%), and it is a bootstrap written
    here (10,000 resamples) within 4% of its width: the sampling noise of 2,000 resamples is ~1%, a 90% interval
    for a 95% one moves each end ~8%. (An order-statistics interval of all rounds is as narrow here;
    ``test_pooled_ratio_widens_to_the_processes_...`` tells it apart: it ignores processes that disagree.)"""
    rng = np.random.default_rng(1)
    procs = np.asarray([1.3 + 0.13 * rng.uniform(-1, 1, 200) for _ in range(3)])
    p = timing.pooled_ratio(procs.tolist())
    raw = np.quantile(procs, [0.025, 0.975])
    assert p["ci"][0] > raw[0] + 0.05 and p["ci"][1] < raw[1] - 0.05, (p["ci"], raw)
    assert p["ci"][0] < p["ratio"] < p["ci"][1] and p["ci"][1] / p["ci"][0] < 1.05 and not p["unstable"]
    draws = procs[rng.integers(0, 3, (10_000, 3, 1)), rng.integers(0, 200, (10_000, 3, 200))]  # processes, rounds
    want = np.quantile(np.median(draws.reshape(10_000, -1), axis=1), [0.025, 0.975])
    assert np.abs(np.subtract(p["ci"], want)).max() <= 0.04 * (want[1] - want[0]), (p["ci"], want)


# ------------------------------------------------------------------------------------------------ jax
def test_jax_synchronize_nested_pytree():
    x = jnp.arange(6.0).reshape(2, 3)
    tree = {"a": [x * 2, (x + 1, None)], "b": 3, "c": np.ones(2)}
    out = jprof.synchronize(tree)
    assert out is tree or jax.tree.structure(out) == jax.tree.structure(tree)
    np.testing.assert_array_equal(out["a"][0], np.arange(6.0).reshape(2, 3) * 2)
    assert jprof.synchronize() is None  # all live arrays


def test_jax_trace_writes_tensorboard_and_perfetto_files(tmp_path):
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    x = jax.random.normal(jax.random.key(0), (64, 64))
    with jprof.trace(str(tmp_path / "prof")) as d:
        jprof.synchronize(f(x))
    files = jprof.trace_files(d)
    xplane = [p for p in files if p.endswith(".xplane.pb")]
    perfetto = [p for p in files if p.endswith("perfetto_trace.json.gz")]
    assert xplane and perfetto, files
    assert all(os.path.getsize(p) > 0 for p in xplane + perfetto)
    events = json.loads(gzip.open(perfetto[0]).read())
    assert events  # a real Chrome/Perfetto trace document
    with pytest.raises(ValueError, match="log_dir must be a directory path"):
        jprof.start_trace("")


def test_jax_timeit_and_step_timer():
    f = jax.jit(lambda a: a @ a)
    x = jnp.ones((32, 32))
    s = jprof.timeit(f, x, warmup=1, iters=5)
    assert s["iters"] == 5 and 0 < s["p10_s"] <= s["median_s"] <= s["p90_s"]
    timer = jprof.StepTimer()
    with timer.phase("matmul") as ph:
        ph.wait_on(f(x))
    assert timer.summary()["matmul"]["iters"] == 1


def test_jax_memory_tracker_labels_order_and_sources():
    f = jax.jit(lambda a: (a @ a.T).sum(0))
    x = jnp.ones((128, 64), jnp.float32)
    mem = jprof.MemoryTracker()
    mem.snapshot("start")
    snap = mem.snapshot("matmul", fn=f, args=(x,))
    assert [s["label"] for s in mem.snapshots] == ["start", "matmul"]
    assert [s["index"] for s in mem.snapshots] == [0, 1]
    assert "compiled memory_analysis" in snap["source"] and "compiled" not in mem.snapshots[0]
    comp = snap["compiled"]
    assert comp["argument"] == 128 * 64 * 4 and comp["output"] == 128 * 4
    assert comp["total"] == comp["argument"] + comp["output"] + comp["temp"] - comp["alias"]
    if jprof.device_memory_stats() is None:  # CPU: no allocator stats; host RSS, labelled as such
        assert "host RSS" in snap["source"] and snap["host_peak_rss_bytes"] > 0
        assert jprof.peak_memory_bytes(host_fallback=False) is None
    else:
        assert snap["peak_bytes"] >= snap["bytes_in_use"] > 0
    rep = mem.report().splitlines()
    assert "start" in rep[2] and "matmul" in rep[3] and "compiled memory_analysis" in rep[3]
    with pytest.raises(ValueError, match="label must be a non-empty str"):
        mem.snapshot("")
    with pytest.raises(TypeError, match="needs a jax.jit-ed function"):
        jprof.compiled_memory(lambda a: a, x)


# ------------------------------------------------------------------------------------------------ torch
def test_torch_synchronize_returns_tensors_and_nests():
    t = torch.randn(3, 4)
    nest = {"a": [t, (t * 2, None)]}
    assert tprof.synchronize(t) is t and tprof.synchronize(nest) is nest and tprof.synchronize() is None


def test_torch_trace_writes_chrome_trace(tmp_path):
    a = torch.randn(64, 64)
    with tprof.trace(str(tmp_path / "prof")) as prof:
        tprof.synchronize(torch.tanh(a @ a).sum())
    path = tmp_path / "prof" / "trace.json"
    assert path.stat().st_size > 0
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert any("mm" in str(n) for n in names), sorted(map(str, names))[:20]
    assert "aten::mm" in prof.key_averages().table()


def test_torch_step_window_profiler_writes_trace(tmp_path):
    a = torch.randn(32, 32)
    with tprof.profiler(str(tmp_path / "win"), wait=0, warmup=1, active=2) as prof:
        for _ in range(4):
            (a @ a).sum()
            prof.step()
    files = tprof.trace_files(str(tmp_path / "win"))
    assert [f for f in files if f.endswith(".pt.trace.json") and os.path.getsize(f) > 0], files
    with pytest.raises(ValueError, match="active must be an int >= 1, got 0"):
        tprof.profiler(str(tmp_path / "bad"), active=0)


def test_torch_timeit_step_timer_and_memory_tracker():
    a = torch.randn(32, 32)
    s = tprof.timeit(torch.mm, a, a, warmup=1, iters=5)
    assert s["iters"] == 5 and 0 < s["p10_s"] <= s["median_s"] <= s["p90_s"]
    timer = tprof.StepTimer()
    with timer.phase("fwd") as ph:
        ph.wait_on(a @ a)
    assert timer.summary()["fwd"]["iters"] == 1
    mem = tprof.MemoryTracker()
    mem.snapshot("init")
    snap = mem.snapshot("after mm")
    assert [s["label"] for s in mem.snapshots] == ["init", "after mm"] and snap["index"] == 1
    if mem.device.type == "cpu":
        assert snap["source"] == "host RSS (resource.ru_maxrss)" and snap["host_peak_rss_bytes"] > 0
        assert tprof.peak_memory_bytes(host_fallback=False) is None
    else:
        assert snap["source"] == "torch.cuda" and snap["peak_bytes"] >= snap["bytes_in_use"]
    assert "after mm" in mem.report()
