"""Which device kernels one attention call runs and how long each takes, JAX and torch side by side (issue 42's
GPU profile): is JAX's cuDNN path slower than torch's because of the call XLA builds, the memory layouts the two
sides were handed, or the time a call spends off the GPU?

The attention suite gives torch contiguous ``[B, H, S, D]`` tensors (SDPA's own layout) and JAX ``[B, S, H, D]``
(the jaxattn contract; what a model's projections give). cuDNN takes both, so one shape runs as variants:

* ``jax:cudnn:bshd`` — ``jax.nn.dot_product_attention(implementation="cudnn")``, what the ``cudnn`` backend calls;
  ``jax:cudnn:bshd:nocb`` the same executable compiled with XLA's command buffers (CUDA graphs) off: the wall times
  are the comparison (XLA has a flag, ``xla_enable_command_buffers_during_profiling``, so a traced call may run
  without them either way);
* ``jax:cudnn:bhsd`` — jax's cuDNN wrapper with ``qkv_layout="BNTH"`` on ``[B, H, S, D]`` arrays (``--all-variants``);
* ``torch:cudnn:bhsd`` — SDPA's cuDNN backend on contiguous ``[B, H, S, D]`` (the attention suite's torch rows);
* ``torch:cudnn:bshd`` — the same on ``[B, S, H, D]`` memory seen through ``.transpose(1, 2)`` (what
  ``q.view(B, S, H, D).transpose(1, 2)`` in a Llama block, ``torchref.model`` included, hands SDPA;
  ``--all-variants``: no layout made a difference on the H200);
* ``jax:mosaic`` — our Mosaic kernel on ``[B, S, H, D]``; ``jax:mosaic:overlap`` the same with FlashAttention-3's
  intra-warpgroup overlap (``MosaicBlockSizes(overlap=True)``).

All variants of a row are timed alternately (``twincore.timing.time_interleaved``; the speed-up over
``torch:cudnn:bhsd`` is a paired ratio with its interval), one call per wait and ten per wait, and the host time
to enqueue one call is taken alone. Then a few calls of each are traced: ``jax.profiler``'s XSpace read back with
``jax.profiler.ProfileData`` (the GPU plane's stream lines), torch.profiler's CUDA events. Kernel names say which
cuDNN engine ran (tile shape, knobs). Each traced call and its wait is one host span (:data:`SPAN`), so a call's
wall time splits into launch, device busy, gaps and tail (:func:`call_timeline`) where the trace puts host and
device on one clock. A ``floor`` row (``x + 1`` on 1024 values) gives each framework's smallest synchronized
call, and the wait ladder (``tails``: one matmul of 3 µs to 1.4 ms, each framework's wait and a spinning one) the
tail after a kernel against the kernel's length (on the H200, 2026-11-28, JAX's tail was 0.2-0.6 ms after attention
calls, torch's 16-33 µs). Settled variants (``:nocb``, ``:overlap``, the layouts) need ``--all-variants``.
Hand-written here: only the table of variants, the short readers of the traces and the split::

    python -m benchmarks.tools.kernel_profile --out DIR           # one Hopper GPU: DIR/kernel_profile.json
    python -m benchmarks.tools.kernel_profile --quick --out DIR   # the CPU rehearsal: jax xla vs torch math
    python -m benchmarks.tools.kernel_profile --table DIR/kernel_profile.json   # its markdown table
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

from twincore.flops import attention_flops
from twincore.timing import paired_ratio, time_interleaved

from .. import measure
from ..report.profile_tables import SPAN, table, timeline_table

REFERENCE = "torch:cudnn:bhsd"
# XLA's CUDA-graph runtime off for one executable (``compile(compiler_options=...)``): the ``:nocb`` variants say
# whether replaying a call's kernels as a command buffer (updated for each call's new output buffers) costs time
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
# SPAN: the host-side name of one traced call and its wait (jax and torch traces)


def shapes(quick: bool) -> list[tuple]:
    """(dtype, B, H, S, D, causal, profiled): B*S = 16k tokens, 16 heads of D=128 (issue 42's goal shape, S >= 2048),
    every row profiled as well as timed (the quick rehearsal traces its first shape only: a CPU trace has no kernel)."""
    if quick:
        return [("float32", 1, 2, 128, 64, c, not c) for c in (False, True)]
    return [("bfloat16", 16384 // s, 16, s, 128, c, True) for s in (2048, 4096) for c in (False, True)]


def _jax_xspace(log_dir: str):
    """The newest XSpace under ``log_dir`` (a ``jax.profiler.ProfileData``), None when there is none."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return ProfileData.from_file(files[-1]) if files else None


def _gpu_stream_events(space):
    """Every kernel / memset / copy event on the GPU planes' stream lines ("XLA Ops" / "XLA Modules" lines repeat
    the stream's events and are skipped)."""
    for plane in space.planes if space is not None else ():
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    yield from line.events


def device_kernels_jax(log_dir: str) -> dict:
    """``{kernel name: [count, total ns]}`` over the GPU planes' stream lines of the newest XSpace under
    ``log_dir`` (``{}`` when there is no device plane: a CPU run)."""
    out: dict = defaultdict(lambda: [0, 0.0])
    for ev in _gpu_stream_events(_jax_xspace(log_dir)):
        out[ev.name][0] += 1
        out[ev.name][1] += ev.duration_ns
    return dict(out)


def intervals_jax(log_dir: str) -> tuple[list, list]:
    """``(spans, kernels)`` of the newest XSpace under ``log_dir`` as sorted ``(start_ns, end_ns)`` pairs: the host
    planes' :data:`SPAN` annotations (one per traced call) and the GPU stream events (none on a CPU)."""
    space = _jax_xspace(log_dir)
    spans = [
        (ev.start_ns, ev.start_ns + ev.duration_ns)
        for plane in (space.planes if space is not None else ())
        if plane.name.startswith("/host:")
        for line in plane.lines
        for ev in line.events
        if ev.name == SPAN
    ]
    kernels = [(ev.start_ns, ev.start_ns + ev.duration_ns) for ev in _gpu_stream_events(space)]
    return sorted(spans), sorted(kernels)


def _torch_device_event(ev) -> bool:
    """A CUDA kernel or memory op of a torch trace. Not kineto's GPU copy of a ``record_function`` range (a
    ``gpu_user_annotation`` named :data:`SPAN`, CUDA-typed): counted as a kernel, it added its span's length to the
    device time of every torch call (the H200 profile of 2026-11-28)."""
    import torch

    return ev.device_type == torch.autograd.DeviceType.CUDA and not (
        getattr(ev, "is_user_annotation", False) or ev.name == SPAN
    )


def device_kernels_torch(prof) -> dict:
    """``{kernel name: [count, total ns]}`` of a finished ``torch.profiler.profile``'s CUDA kernels."""
    out: dict = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if _torch_device_event(ev):
            out[ev.name][0] += 1
            out[ev.name][1] += ev.time_range.elapsed_us() * 1e3
    return dict(out)


def intervals_torch(prof) -> tuple[list, list]:
    """``(spans, kernels)`` of a finished ``torch.profiler.profile`` in ns on kineto's one clock: the
    ``record_function(SPAN)`` ranges on the host and the CUDA kernels."""
    import torch

    spans, kernels = [], []
    for ev in prof.events():
        iv = (ev.time_range.start * 1e3, ev.time_range.end * 1e3)
        if _torch_device_event(ev):
            kernels.append(iv)
        elif ev.name == SPAN and ev.device_type != torch.autograd.DeviceType.CUDA:
            spans.append(iv)
    return sorted(spans), sorted(kernels)


def call_timeline(spans: list, kernels: list) -> dict | None:
    """Where a synchronized call's wall time goes, from host spans (one call and its wait each) and device
    intervals on one clock. Per call: ``launch_us`` (span start to its first kernel's start: dispatch and launch),
    ``busy_us`` (the union of its kernels), ``gaps_us`` (device idle between its first kernel's start and its last
    kernel's end) and ``tail_us`` (last kernel's end to span end: the wait's wake-up and return); medians over the
    calls, with ``calls``.

    None when there is nothing to place (no span or no kernel: a CPU run). When the clocks disagree (a kernel
    outside every span, a span without a kernel): ``{"aligned": False, "reason": ...}`` and no figures, since a
    split on misaligned clocks would be wrong, not approximate."""
    if not spans or not kernels:
        return None
    per_call: list[list] = [[] for _ in spans]
    for k0, k1 in sorted(kernels):
        i = next((i for i, (s0, s1) in enumerate(spans) if s0 <= k0 and k1 <= s1), None)
        if i is None:
            return {"aligned": False, "calls": len(spans), "reason": f"a kernel at {k0:.0f} ns lies outside every span"}
        per_call[i].append((k0, k1))
    if any(not ks for ks in per_call):
        return {"aligned": False, "calls": len(spans), "reason": "a traced call has no kernel inside its span"}
    figs: dict = {"launch_us": [], "busy_us": [], "gaps_us": [], "tail_us": []}
    for (s0, s1), ks in zip(spans, per_call):
        busy, end = 0.0, ks[0][0]  # the union of the call's intervals (sorted by start)
        for k0, k1 in ks:
            busy += max(0.0, k1 - max(k0, end))
            end = max(end, k1)
        figs["launch_us"].append((ks[0][0] - s0) / 1e3)
        figs["busy_us"].append(busy / 1e3)
        figs["gaps_us"].append((end - ks[0][0] - busy) / 1e3)
        figs["tail_us"].append((s1 - end) / 1e3)
    return {"aligned": True, "calls": len(spans), **{k: statistics.median(v) for k, v in figs.items()}}


def _per_call(kernels: dict, calls: int) -> list[dict]:
    rows = [
        {"kernel": name, "launches_per_call": n / calls, "us_per_call": ns / calls / 1e3}
        for name, (n, ns) in kernels.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def variants(shape, quick: bool, all_layouts: bool = False) -> dict:
    """name -> {"fwd": f, "fwd_bwd": g, "framework"}: zero-argument callables on fresh random inputs. The variants
    the H200 settled only with ``all_layouts`` (``--all-variants``): the layouts (``jax:cudnn:bhsd``,
    ``torch:cudnn:bshd``: the same kernels in the same time, 16 of 16 pairs, 2026-11-27b), ``jax:cudnn:bshd:nocb``
    (no difference in 8 of 8 rows) and ``jax:mosaic:overlap`` (3-4% less device time, no wall difference; both
    2026-11-28). The quick rehearsal keeps its xla ``:nocb`` and both torch layouts, so their code paths run."""
    import jax
    import jax.numpy as jnp
    import torch

    dtype, b, h, s, d, causal, _ = shape
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in ks)  # [B, S, H, D]
    scale = 1.0 / d**0.5
    out: dict = {}

    def jax_pair(fwd, args, compiler_options=None):
        f = jax.jit(fwd)
        g = jax.jit(lambda q, k, v, do: jax.vjp(fwd, q, k, v)[1](do))
        if compiler_options:  # compiled ahead with these XLA options (this executable only)
            f = f.lower(*args[:3]).compile(compiler_options=compiler_options)
            g = g.lower(*args).compile(compiler_options=compiler_options)
        return {"fwd": lambda: f(*args[:3]), "fwd_bwd": lambda: g(*args), "framework": "jax"}

    if quick:
        xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")  # noqa: E731
        out["jax:xla:bshd"] = jax_pair(xla, (q, k, v, do))
        out["jax:xla:bshd:nocb"] = jax_pair(xla, (q, k, v, do), NO_COMMAND_BUFFERS)
    else:
        from jax._src.cudnn import fused_attention_stablehlo as cud

        from jaxattn.attention import dot_product_attention
        from jaxattn.attention.mosaic import MosaicBlockSizes, mosaic_attention

        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")  # noqa: E731
        out["jax:cudnn:bshd"] = jax_pair(cudnn, (q, k, v, do))
        if all_layouts:
            out["jax:cudnn:bshd:nocb"] = jax_pair(cudnn, (q, k, v, do), NO_COMMAND_BUFFERS)
            bhsd = [jnp.transpose(x, (0, 2, 1, 3)).copy() for x in (q, k, v, do)]  # [B, H, S, D], made before timing
            mask = cud.MaskType.CAUSAL if causal else cud.MaskType.NO_MASK
            out["jax:cudnn:bhsd"] = jax_pair(
                lambda q, k, v: cud.dot_product_attention(q, k, v, scale=scale, mask_type=mask, qkv_layout="BNTH"),
                bhsd,
            )
        out["jax:mosaic"] = jax_pair(
            lambda q, k, v: dot_product_attention(q, k, v, causal=causal, backend="mosaic"), (q, k, v, do)
        )
        if all_layouts:
            overlap = MosaicBlockSizes(overlap=True)  # FA3's intra-warpgroup overlap, not the default
            out["jax:mosaic:overlap"] = jax_pair(
                lambda q, k, v: mosaic_attention(q, k, v, causal=causal, block_sizes=overlap), (q, k, v, do)
            )

    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend, name = (SDPBackend.MATH, "math") if quick else (SDPBackend.CUDNN_ATTENTION, "cudnn")
    g = torch.Generator(device="cpu").manual_seed(0)
    tdt = getattr(torch, dtype)
    base = [torch.randn(b, s, h, d, generator=g).to(device=dev, dtype=tdt) for _ in range(4)]  # [B, S, H, D]
    layouts = {"bhsd": [x.transpose(1, 2).contiguous() for x in base]}  # SDPA's own layout, contiguous
    if quick or all_layouts:
        layouts["bshd"] = [x.transpose(1, 2) for x in base]  # [B, H, S, D] views of [B, S, H, D] memory
    for lay, (tq, tk, tv, tdo) in layouts.items():

        def fwd(q, k, v, _b=backend):
            with sdpa_kernel([_b]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def t_fwd(fwd=fwd, a=(tq, tk, tv)):
            with torch.no_grad():
                return fwd(*a)

        def t_fwd_bwd(fwd=fwd, a=(tq, tk, tv), do=tdo):
            qq, kk, vv = (x.detach().requires_grad_(True) for x in a)
            return torch.autograd.grad(fwd(qq, kk, vv), (qq, kk, vv), do)

        out[f"torch:{name}:{lay}"] = {"fwd": t_fwd, "fwd_bwd": t_fwd_bwd, "framework": "torch"}
    return out


def profile(var: dict, pss: str, calls: int, sync=measure.sync) -> tuple[list[dict], list, list]:
    """``calls`` traced calls of one variant's pass (after one untimed call), each call and its wait (``sync``)
    named :data:`SPAN` on the host: ``(kernels per call, spans, kernel intervals)``, the last two for
    :func:`call_timeline`."""
    fn = var[pss]
    sync(fn())
    if var["framework"] == "jax":
        import jax

        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            for _ in range(calls):
                with jax.profiler.TraceAnnotation(SPAN):
                    sync(fn())
            jax.profiler.stop_trace()
            return (_per_call(device_kernels_jax(tmp), calls), *intervals_jax(tmp))
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            with torch.profiler.record_function(SPAN):
                sync(fn())
    return (_per_call(device_kernels_torch(prof), calls), *intervals_torch(prof))


def dispatch_s(fn, calls: int = 5) -> float:
    """Median host time until ``fn()`` returns, its wait not counted (each call is waited for before the next):
    what enqueueing one call costs the caller (jax dispatches asynchronously; torch launches as it goes)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        measure.sync(out)
    return statistics.median(times)


BURST = 10  # calls enqueued back to back before one wait, in the burst timing


def _burst(fn, n: int = BURST):
    """``n`` calls of ``fn`` enqueued back to back; returns the last result (waiting for it waits for all: each
    framework runs them in order on one stream)."""

    def call():
        out = None
        for _ in range(n):
            out = fn()
        return out

    return call


def floor_variants() -> dict:
    """Each framework's floor for one synchronized call: ``x + 1`` on 1024 float32 values (a kernel of a few
    microseconds), jitted in JAX, eager in torch; the same shape of dict as :func:`variants`' (one pass, ``floor``)."""
    import jax
    import jax.numpy as jnp
    import torch

    x = jnp.arange(1024, dtype=jnp.float32)
    add = jax.jit(lambda x: x + 1)
    t = torch.arange(1024, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")
    return {
        "jax:add": {"floor": lambda: add(x), "framework": "jax"},
        "torch:add": {"floor": lambda: t + 1, "framework": "torch"},
    }


def tail_sizes(quick: bool) -> tuple[int, ...]:
    """The ladder's square matmul sizes: on an H200 (bf16, ~790 TFLOP/s) kernels of about 3 µs, 22 µs, 0.17 ms and
    1.4 ms; the CPU rehearsal's are tiny float32 ones."""
    return (32, 64) if quick else (1024, 2048, 4096, 8192)


def _no_wait(out) -> None:
    """The ladder's variants wait inside their call (each its own way), so the timers and the trace add none."""


def tail_variants(n: int, quick: bool) -> dict:
    """One ``[n, n] @ [n, n]`` matmul per call, each variant waiting for its result its own way (the ``tail`` pass,
    same dict shape as :func:`variants`), so the tail after the kernel can be set against the kernel's length:

    * ``jax:dot`` — ``jax.block_until_ready`` alone;
    * ``jax:dot:spin`` — a Python loop on ``Array.is_ready()``, then the same (if the tail shrinks, the cost is in
      waking the blocked caller; if not, in learning of the kernel's end at all);
    * ``jax:dot:both`` — jax's wait, then ``torch.cuda.synchronize()``: the suites' wait for a JAX result until
      2026-11-28 (``benchmarks.measure.sync`` waited with every loaded framework; now with the result's own), so
      the ladder measures what that cost every JAX row;
    * ``torch:mm`` — ``torch.cuda.synchronize()``."""
    import jax
    import torch

    dtype = "float32" if quick else "bfloat16"
    a = jax.random.normal(jax.random.key(n), (n, n), dtype)
    mm = jax.jit(lambda a: a @ a)

    def block(out):
        jax.block_until_ready(out)

    def spin(out):
        while not out.is_ready():
            pass
        jax.block_until_ready(out)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.randn(n, n, generator=torch.Generator().manual_seed(n)).to(device=dev, dtype=getattr(torch, dtype))
    torch_wait = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    return {
        "jax:dot": {"tail": lambda: block(mm(a)), "framework": "jax"},
        "jax:dot:spin": {"tail": lambda: spin(mm(a)), "framework": "jax"},
        "jax:dot:both": {"tail": lambda: (block(mm(a)), torch_wait())[1], "framework": "jax"},
        "torch:mm": {"tail": lambda: (t @ t, torch_wait())[1], "framework": "torch"},
    }


def _time_variants(vs: dict, pss: str, ref: str, rounds: int) -> dict:
    """``{name: record}`` of one pass of every variant, timed interleaved: one call and its wait (``median_s``, as
    the attention suite times), then :data:`BURST` calls per wait (``burst_per_call_s``), each with its paired
    speed-up over ``ref``; then the host time to enqueue one call (``dispatch_s``)."""
    calls = {name: var[pss] for name, var in vs.items()}
    t = time_interleaved(calls, rounds=rounds, per_round=3, warmup=2, sync=measure.sync)
    tb = time_interleaved(
        {name: _burst(fn) for name, fn in calls.items()},
        rounds=max(2, rounds // 2),
        per_round=1,
        warmup=1,
        sync=measure.sync,
    )
    out = {}
    for name, st in t.items():
        rec = {k: st[k] for k in ("median_s", "p10_s", "p90_s", "cv")}
        rec["burst_per_call_s"] = tb[name]["median_s"] / BURST
        if name != ref:  # speed-ups over the reference: its time / this one's, round by round
            rec["speedup_vs_reference"] = paired_ratio(t[ref]["rounds"], st["rounds"], cv=(st["cv"], t[ref]["cv"]))
            rec["burst_speedup_vs_reference"] = paired_ratio(
                tb[ref]["rounds"], tb[name]["rounds"], cv=(tb[name]["cv"], tb[ref]["cv"])
            )
        rec["dispatch_s"] = dispatch_s(calls[name])
        out[name] = rec
    return out


def run(
    quick: bool,
    rounds: int = 10,
    profile_calls: int = 3,
    budget_s: float | None = None,
    all_layouts: bool = False,
    tails: bool = True,
) -> dict:
    """First each framework's floor (:func:`floor_variants`, ``floor``), then the wait ladder (``tails``: one
    matmul per size of :func:`tail_sizes`, the :func:`tail_variants`, timed interleaved), then every attention row;
    all variants of a row timed interleaved (:func:`_time_variants`). Then traces the floor, the ladder and the
    profiled rows: every JAX variant first, then every torch one (the two profilers share CUPTI: one hand-over,
    not one per variant); each traced record gets ``kernels`` and, where a device ran them, ``timeline``
    (:func:`call_timeline`).

    ``budget_s``: start no new shape after it. An interrupt (a session step's budget: SIGINT) ends the run early
    but still returns what finished, ``complete`` false and ``interrupted`` naming the phase it stopped."""
    t_start = time.perf_counter()
    rows, complete, interrupted, floor, ladder = [], True, None, None, []
    ref = "torch:math:bhsd" if quick else REFERENCE
    to_profile: list = []
    try:
        fvs = floor_variants()
        floor_recs = _time_variants(fvs, "floor", "torch:add", rounds)
        floor = {"pass": "floor", "op": "x + 1, 1024 float32", "variants": floor_recs}
        to_profile += [(fvs[name], "floor", rec) for name, rec in floor_recs.items()]
        for n in tail_sizes(quick) if tails else ():
            tvs = tail_variants(n, quick)
            timed = time_interleaved({k: v["tail"] for k, v in tvs.items()}, rounds=rounds, per_round=3, warmup=2)
            recs = {k: {f: st[f] for f in ("median_s", "p10_s", "p90_s", "cv")} for k, st in timed.items()}
            ladder.append({"pass": "tail", "n": n, "op": f"[{n}, {n}] @ [{n}, {n}], waited for", "variants": recs})
            to_profile += [(tvs[k], "tail", rec) for k, rec in recs.items()]
        for shape in shapes(quick):
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                complete = False
                break
            dtype, b, h, s, d, causal, profiled = shape
            vs = variants(shape, quick, all_layouts)
            for pss in ("fwd", "fwd_bwd"):
                flops = attention_flops(b, h, s, s, d, causal, backward=pss == "fwd_bwd")
                row = {"dtype": dtype, "B": b, "H": h, "S": s, "D": d, "causal": causal, "pass": pss}
                row["variants"] = _time_variants(vs, pss, ref, rounds)
                for name, rec in row["variants"].items():
                    rec["tflops"] = flops / rec["median_s"] / 1e12
                    if profiled:
                        to_profile.append((vs[name], pss, rec))
                rows.append(row)
                print(_line(row, ref), flush=True)
    except KeyboardInterrupt:
        complete, interrupted = False, "timing"
    try:
        for fw in ("jax", "torch") if interrupted is None else ():
            for var, pss, rec in to_profile:
                if var["framework"] != fw:
                    continue
                try:
                    wait = _no_wait if pss == "tail" else measure.sync
                    rec["kernels"], spans, intervals = profile(var, pss, profile_calls, sync=wait)
                except Exception as e:  # a profiler that cannot start: the timing stands
                    rec["kernels_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    continue
                timeline = call_timeline(spans, intervals)
                if timeline is not None:
                    rec["timeline"] = timeline
    except KeyboardInterrupt:
        complete, interrupted = False, "tracing"
    for row in rows:
        if any("kernels" in rec for rec in row["variants"].values()):
            print(_line(row, ref, kernels=True), flush=True)
    return {
        "tool": "kernel_profile",
        "reference": ref,
        "env": measure.env_info(),
        "complete": complete,
        "interrupted": interrupted,
        "floor": floor,
        "tails": ladder,
        "rows": rows,
    }


def _line(row: dict, ref: str, kernels: bool = False) -> str:
    parts = [f"S={row['S']} causal={row['causal']} {row['pass']}:"]
    for name, rec in row["variants"].items():
        sp = rec.get("speedup_vs_reference")
        rel = f" x{sp['ratio']:.2f}{'?' if sp['unstable'] else ''}" if sp else " (ref)"
        part = f"{name} {rec['tflops']:.1f} TF/s{rel}"
        if kernels:
            ks = rec.get("kernels") or []
            part = f"{name}: " + (
                ", ".join(f"{k['kernel'][:90]} {k['us_per_call']:.0f} us" for k in ks[:3])
                or rec.get("kernels_error", "no device kernels")
            )
        parts.append(part)
    return (" |\n  " if kernels else " | ").join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tools.kernel_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for kernel_profile.json")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the markdown table of these files; run nothing")
    ap.add_argument("--quick", action="store_true", help="CPU rehearsal: tiny fp32 shapes, jax xla vs torch math")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds per row (default 10)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new shape after this many seconds")
    ap.add_argument(
        "--all-variants",
        action="store_true",
        help="also the variants the H200 settled: BHSD / BSHD layouts, command buffers off, the overlap forward",
    )
    ap.add_argument("--no-tails", action="store_true", help="skip the wait ladder (a matmul per size, each wait)")
    a = ap.parse_args(argv)
    if a.table:
        for path in a.table:
            with open(path) as f:
                res = json.load(f)
            print(table(res, os.path.basename(path)) + "\n")
            tl = timeline_table(res)
            if tl:
                print("Where each call's wall time goes (us; medians of the traced calls):\n\n" + tl + "\n")
        return 0
    if not a.out:
        ap.error("--out DIR is needed to run (or --table FILE... to print a table)")
    if a.rounds < 2:
        ap.error(f"--rounds must be >= 2 (a paired interval needs rounds), got {a.rounds}")
    res = run(a.quick, rounds=a.rounds, budget_s=a.budget_s, all_layouts=a.all_variants, tails=not a.no_tails)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "kernel_profile.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path} ({len(res['rows'])} rows, complete={res['complete']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
