"""Tables of ``benchmarks.tools.kernel_profile`` records (device time against wall time per attention call), for its
``--table`` and the README's GPU section: the report room reads a profile's JSON, it never runs one.

    print(table(json.load(open("benchmarks/results/nvidia-h200/kernel_profile-call3.json"))))
"""

from __future__ import annotations

from twincore.flops import attention_flops

from .tables import format_ratio

SPAN = "kernel_profile call"  # the traced call's range; a torch trace also copies it onto the GPU as a CUDA event


def kernels(rec: dict) -> list[dict]:
    """One variant's traced kernels, longest first. A torch record written before 2026-11-28's fix also lists its
    ``record_function`` range (kineto's GPU copy, named :data:`SPAN`): it is not a kernel, and it is left out."""
    return [k for k in rec.get("kernels") or [] if k["kernel"] != SPAN]


def device_us(rec: dict) -> float | None:
    """Device time of one call: the traced kernels' microseconds summed (None when the row was not traced)."""
    ks = kernels(rec)
    return sum(k["us_per_call"] for k in ks) if ks else None


def _burst_cell(rec: dict, is_ref: bool) -> str:
    if "burst_per_call_s" not in rec:  # a file written before the burst timing
        return ""
    bp = rec.get("burst_speedup_vs_reference")
    return "(reference)" if is_ref or bp is None else format_ratio(bp["ratio"], bp)


def table(res: dict, name: str = "") -> str:
    """Markdown of one ``kernel_profile.json``: per row and variant the wall time per synchronized call (its TFLOP/s
    and paired speed-up over the reference), the device time summed over its traced kernels (TFLOP/s at that time,
    ratio reference / variant), wall minus device (what a call spends off the GPU: dispatch, launch, the wait for
    the result), the per-call time of a burst of calls per wait (files that have it) and the longest
    kernel."""
    ref = res["reference"]
    out = [
        f"{name or 'kernel_profile.json'}: {res['env'].get('jax_device', '?')}, {res['env'].get('time_utc', '?')}, "
        f"jax {res['env'].get('jax', '?')}, torch {res['env'].get('torch', '?')}, cuDNN {res['env'].get('cudnn_jax')} "
        f"(jax) / {res['env'].get('cudnn_torch')} (torch); reference `{ref}`"
        + ("" if res.get("complete", True) else " (incomplete: its budget stopped it)"),
        "",
        "| S | causal | pass | variant | wall ms | wall TF/s | wall speed-up, paired | burst ms per call | "
        "burst speed-up, paired | device us | off-GPU us | device TF/s | device ratio | longest kernel (launches "
        "per call) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["rows"]:
        flops = attention_flops(
            row["B"], row["H"], row["S"], row["S"], row["D"], row["causal"], row["pass"] == "fwd_bwd"
        )
        ref_dev = device_us(row["variants"][ref])
        for v, rec in row["variants"].items():
            sp = rec.get("speedup_vs_reference")
            dev = device_us(rec)
            top = (kernels(rec) or [None])[0]
            cells = [
                row["S"],
                "yes" if row["causal"] else "no",
                row["pass"],
                f"`{v}`",
                f"{rec['median_s'] * 1e3:.3f}",
                f"{rec['tflops']:.0f}",
                "(reference)" if sp is None else format_ratio(sp["ratio"], sp),
                "" if "burst_per_call_s" not in rec else f"{rec['burst_per_call_s'] * 1e3:.3f}",
                _burst_cell(rec, v == ref),
                "" if dev is None else f"{dev:.0f}",
                "" if dev is None else f"{rec['median_s'] * 1e6 - dev:.0f}",
                "" if dev is None else f"{flops / (dev * 1e-6) / 1e12:.0f}",
                "" if dev is None or ref_dev is None else f"{ref_dev / dev:.2f}",
                "" if top is None else f"`{top['kernel'][:110]}` ({top['launches_per_call']:g})",
            ]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out)


def _us(rec: dict, key: str) -> str:
    return "" if rec.get(key) is None else f"{rec[key] * 1e6:.0f}"


def timeline_table(res: dict) -> str:
    """Markdown of where a synchronized call's wall time goes (files written since the per-call timeline; ``""``
    for older ones): per traced variant with a timeline on one clock, wall µs per call, per call in a burst, the
    host time to enqueue the call (dispatch), and from the trace the launch (call start to first kernel), the
    device's busy time, its idle gaps inside the call and the tail (last kernel's end to the result in hand).
    The floor row (one ``x + 1`` call per framework) is the smallest call each framework can make; the ladder's rows
    (``tails``, pass ``tail n=N``: one ``[N, N]`` matmul, each variant waiting its own way) set the tail against
    the kernel's length."""
    rows = ([dict(res["floor"], S="", causal=None)] if res.get("floor") else []) + [
        dict(t, S="", causal=None, **{"pass": f"tail n={t['n']}"}) for t in res.get("tails") or []
    ]
    rows += list(res.get("rows", []))
    lines = []
    for row in rows:
        for v, rec in row["variants"].items():
            tl = rec.get("timeline")
            if "dispatch_s" not in rec and not row["pass"].startswith("tail"):  # a file from before the timeline
                continue
            aligned = tl is not None and tl.get("aligned")
            cells = [
                row["S"],
                "" if row["causal"] is None else ("yes" if row["causal"] else "no"),
                row["pass"],
                f"`{v}`",
                _us(rec, "median_s"),
                _us(rec, "burst_per_call_s"),
                _us(rec, "dispatch_s"),
                *(f"{tl[k]:.0f}" if aligned else "" for k in ("launch_us", "busy_us", "gaps_us", "tail_us")),
                "" if tl is None or aligned else f"clocks not aligned: {tl['reason']}",
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if not lines:
        return ""
    head = [
        "| S | causal | pass | variant | wall us | burst us per call | dispatch us | launch us | device busy us | "
        "gaps us | tail us | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines)
