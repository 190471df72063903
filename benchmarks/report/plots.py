"""Plots of result records: one figure per suite, drawn by one routine so every series keeps its style.

    plot_suite("benchmarks/results/cpu", "decode", records, env)   # -> decode_tokens_per_s.png (or None)

Each series label has one colour and marker in every panel (JAX first and solid, torch dashed / hatched) and one
figure legend lists every series; records with nothing measured draw nothing (matplotlib is imported lazily).
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Callable, Iterable

from .records import atomic_path, impl_label

# The SM limits drawn as reference lines on the kernel plot: the H100's (sm_90), the same numbers as
# benchmarks.tools.kernel_stats.H100_LIMITS (parity_tests/test_report.py checks that they agree).
KERNEL_LIMITS = {"max_regs_per_thread": 255, "smem_per_block": 232448}


@dataclasses.dataclass
class Panel:
    """One axes of a figure. ``series``: ``{legend label: {x: y}}``; on a bar panel y None marks a skipped
    measurement (drawn as "skipped") and a string is drawn as that text (e.g. "n/a"); an x missing from a series
    gets no slot. ``kind``: "line"
    (numeric x, ``logx`` a base or None) or "bar" (grouped bars over ``categories``, in that order). ``logy``:
    None = log when the positive values span 20x or more. ``limits``: ``(y, text)`` dotted reference lines;
    ``note``: a text in the corner (e.g. "no spills"); ``errors``: ``{label: {x: (low, high)}}`` error bars (a
    timing's p10-p90 band); ``hollow``: ``{label: {x, ...}}`` points drawn hollow (a row whose JAX-vs-torch pair
    is ``unstable``: noise, not a finding)."""

    title: str
    xlabel: str
    ylabel: str
    series: dict
    kind: str = "line"
    categories: tuple = ()
    logx: int | None = None
    logy: bool | None = None
    limits: tuple = ()
    note: str | None = None
    errors: dict = dataclasses.field(default_factory=dict)  # {label: {x: (low, high)}}: drawn as error bars
    hollow: dict = dataclasses.field(default_factory=dict)  # {label: {x, ...}}: drawn hollow (unstable pair)

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

# Legend names a reader understands, for the record labels ``framework:impl`` (``records.impl_label``).
READABLE = {
    "jax:flash": "JAX Pallas flash",
    "jax:flash_decode": "JAX Pallas flash decode",
    "jax:chunked": "JAX chunked (O(S) memory)",
    "jax:xla": "JAX XLA (plain jnp)",
    "jax:cudnn": "JAX cuDNN",
    "jax:mosaic": "JAX Pallas Mosaic GPU",
    "jax:splash": "JAX Pallas TPU splash (jax's)",
    "jax:jax.nn:xla": "JAX jax.nn.dot_product_attention (xla)",
    "jax:jax.nn:cudnn": "JAX jax.nn.dot_product_attention (cudnn)",
    "jax:pallas.ops:flash": "JAX pallas.ops flash (jax's own)",
    "jax:tokamax:flash": "JAX tokamax flash",
    "jax:jaxattn": "JAX (jaxattn)",
    "jax:jaxattn+flash_decode": "JAX (jaxattn, flash_decode)",
    "torch:sdpa:flash": "torch SDPA flash",
    "torch:sdpa:math": "torch SDPA math",
    "torch:sdpa:efficient": "torch SDPA efficient",
    "torch:sdpa:cudnn": "torch SDPA cuDNN",
    "torch:flex_attention": "torch FlexAttention (compiled)",
    "torch:torchref": "torch (torchref)",
    "torch:torchref+compile": "torch (torchref, torch.compile)",
    "torch:torchref+cudagraphs": "torch (torchref, torch.compile reduce-overhead: CUDA graphs)",
}


def readable(record: dict) -> str:
    """A record's legend name: :data:`READABLE`'s for its ``framework:impl``, else that label itself."""
    label = impl_label(record)
    return READABLE.get(label, label)


def _is_torch(label: str) -> bool:
    return label.lower().startswith("torch")


def unstable(r: dict) -> bool:
    """Whether a record belongs to a JAX-vs-torch pair labelled ``unstable`` (``twincore.timing``)."""
    return isinstance(r.get("paired"), dict) and bool(r["paired"].get("unstable"))


def _add_point(panel: Panel, lab: str, x, value: float, r: dict) -> None:
    """``value`` at ``x`` in series ``lab`` of ``panel``, with the record's p10-p90 band and hollow if unstable."""
    panel.series.setdefault(lab, {})[x] = value
    band = time_band(r, value)
    if band:
        panel.errors.setdefault(lab, {})[x] = band
    if unstable(r):
        panel.hollow.setdefault(lab, set()).add(x)


def time_band(r: dict, value: float) -> tuple[float, float] | None:
    """The p10-p90 band of a throughput ``value`` derived from a timing record (throughput ~ 1 / time: the p90
    time gives the low end), or None where the record keeps no percentiles."""
    med, p10, p90 = r.get("median_ms"), r.get("p10_ms"), r.get("p90_ms")
    if not (med and p10 and p90) or value is None:
        return None
    return value * med / p90, value * med / p10


def draw(out_dir: str, name: str, title: str, panels: list[Panel], ncols: int | None = None) -> Plot | None:
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
    labels.sort(key=lambda lab: not lab.lower().startswith("jax"))  # JAX first, otherwise in order of appearance
    for kind in ("line", "bar"):  # one y scale for all panels of a kind: log if any of them asks for it
        same = [p for p in panels if p.kind == kind and p.logy is None]
        if any(_wants_log(p) for p in same):
            for p in same:
                p.logy = True
    colours = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20").colors
    style = {
        lab: dict(
            color=colours[i % len(colours)], marker=MARKERS[i % len(MARKERS)], linestyle="--" if _is_torch(lab) else "-"
        )
        for i, lab in enumerate(labels)
    }
    ncols = ncols or min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    widths = [
        max(6.4, min(16.0, 1.6 + 0.2 * len(p.categories) * max(1, len(p.series)))) if p.kind == "bar" else 4.8
        for p in panels
    ]
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
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    any_line = any(p.kind == "line" for p in panels)
    proxies = [
        Line2D([], [], **style[lab])
        if any_line
        else Patch(facecolor=style[lab]["color"], hatch="//" if _is_torch(lab) else None, edgecolor="white")
        for lab in labels
    ]
    fig.legend(proxies, labels, loc="outside lower center", ncol=legend_cols, fontsize=8, frameon=False)
    if any(p.hollow for p in panels):
        title_lines[-1] += "; hollow: an unstable JAX-vs-torch pair"
    fig.suptitle("\n".join(title_lines), fontsize=11)
    path = os.path.join(out_dir, name)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return Plot(path, title, tuple(labels), tuple(p.title for p in panels))


def _wants_log(panel: Panel) -> bool:
    vals = [v for v in panel.values() if v > 0]
    return bool(vals) and max(vals) / min(vals) >= 20


def _yerr(panel: Panel, lab: str, xs: list, ys: list):
    """``[[below...], [above...]]`` for ``ax.errorbar`` / ``ax.bar(yerr=)`` from ``panel.errors[lab]``, or None."""
    band = panel.errors.get(lab) or {}
    if not any(x in band for x in xs):
        return None
    lo = [y - band[x][0] if x in band else 0.0 for x, y in zip(xs, ys)]
    hi = [band[x][1] - y if x in band else 0.0 for x, y in zip(xs, ys)]
    return [[max(0.0, v) for v in lo], [max(0.0, v) for v in hi]]


def _draw_panel(ax, panel: Panel, labels: list, style: dict) -> None:
    logy = panel.logy if panel.logy is not None else _wants_log(panel)
    if panel.kind == "line":
        for lab in labels:
            pts = sorted((x, y) for x, y in panel.series[lab].items() if isinstance(y, (int, float)))
            if pts:
                xs, ys = [x for x, _ in pts], [y for _, y in pts]
                st = dict(style[lab], linestyle="none") if len(pts) < 3 else style[lab]  # two points: no line
                ax.plot(xs, ys, label=lab, **st)
                weak = [(x, y) for x, y in pts if x in panel.hollow.get(lab, ())]
                if weak:  # the unstable points again, hollow
                    ax.plot(*zip(*weak), linestyle="none", marker=st["marker"], color=st["color"], mfc="white")
                yerr = _yerr(panel, lab, xs, ys)
                if yerr is not None:
                    ax.errorbar(xs, ys, yerr=yerr, fmt="none", ecolor=style[lab]["color"], elinewidth=1, capsize=3)
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
                    weak = cat in panel.hollow.get(lab, ())
                    ax.bar(
                        x,
                        y,
                        width,
                        color="white" if weak else style[lab]["color"],
                        hatch="//" if _is_torch(lab) else None,
                        edgecolor=style[lab]["color"] if weak else "white",
                        linewidth=1.0 if weak else 0.5,
                        label=lab,
                    )
                    yerr = _yerr(panel, lab, [cat], [y])
                    if yerr is not None:
                        ax.errorbar([x], [y], yerr=yerr, fmt="none", ecolor="0.2", elinewidth=1, capsize=3)
                else:  # measured nothing: say so where the bar would be
                    ax.text(
                        x,
                        0.02,
                        "skipped" if y is None else str(y),
                        transform=ax.get_xaxis_transform(),
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color=style[lab]["color"],
                    )
        ax.set_xticks(
            range(len(panel.categories)),
            [str(c) for c in panel.categories],
            rotation=30 if max(map(len, map(str, panel.categories)), default=0) > 7 else 0,
            ha="right" if max(map(len, map(str, panel.categories)), default=0) > 7 else "center",
        )
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
        ax.annotate(
            text,
            (1, y),
            xycoords=("axes fraction", "data"),
            xytext=(-3, 3),
            textcoords="offset points",
            ha="right",
            va="bottom",
            fontsize=7,
            color="0.3",
        )
    if panel.note:
        ax.text(0.02, 0.96, panel.note, transform=ax.transAxes, va="top", fontsize=8, color="0.3")
    ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
    ax.grid(alpha=0.3, axis="y" if panel.kind == "bar" else "both")


def _ok(records: Iterable[dict], key: str | None = None) -> list:
    return [r for r in records if r.get("status", "ok") == "ok" and (key is None or r.get(key) is not None)]


def _where(info: dict | None) -> str:
    """The device part of a plot title: ``info``'s device, and "--quick shapes" for a quick run."""
    info = info or {}
    return f"{info.get('jax_device') or 'unknown device'}" + (", --quick shapes" if info.get("quick") else "")


def plot_attention(out_dir: str, records: list[dict], info: dict | None = None) -> Plot | None:
    """TFLOP/s against sequence length, one panel per (pass, causal, D), one line per implementation; None
    (nothing written) with fewer than two sequence lengths."""
    ok = _ok(records, "tflops")
    if len({r["Sk"] for r in ok}) < 2:
        return None
    panels = []
    keys = {(r["pass"], r["causal"], r["D"]) for r in ok}
    for p, c, d in sorted(keys, key=lambda k: (str(k[:2]), str(k[2]).zfill(6))):  # D numerically
        panel = Panel(f"{p}, causal={c}, D={d}", "sequence length (tokens)", "TFLOP/s", {}, logx=2)
        for r in ok:
            if (r["pass"], r["causal"], r["D"]) == (p, c, d):
                _add_point(panel, readable(r), r["Sk"], r["tflops"], r)
        panels.append(panel)
    dtypes = ", ".join(sorted({str(r.get("dtype")) for r in ok}))
    return draw(
        out_dir,
        PLOT_FILES["attention"],
        f"Attention throughput ({dtypes}; bars: p10-p90 of the timed calls) — {_where(info)}",
        panels,
        ncols=min(len(panels), 4),
    )


def plot_train(out_dir: str, records: list[dict], info: dict | None = None) -> Plot | None:
    """Tokens/s of one train step per toggle, JAX and torch bars side by side, one panel per model shape;
    a skipped toggle is marked "skipped", one that does not apply (torch.compile for JAX) "n/a"."""
    panels = []
    for shape in dict.fromkeys((r.get("preset"), r.get("B"), r.get("S")) for r in records):
        sel = [r for r in records if (r.get("preset"), r.get("B"), r.get("S")) == shape]
        cats = tuple(dict.fromkeys(r["toggle"] for r in sel))
        panel = Panel(
            f"{shape[0]}, B={shape[1]}, S={shape[2]}",
            "training toggle (one change from the fp32 baseline)",
            "tokens/s",
            {},
            kind="bar",
            categories=cats,
        )
        for r in sel:
            if r.get("status", "ok") == "ok" and r.get("tokens_per_s") is not None:
                _add_point(panel, readable(r), r["toggle"], r["tokens_per_s"], r)
            else:
                panel.series.setdefault(readable(r), {})[r["toggle"]] = None
        for pts in panel.series.values():  # a toggle one framework has no row for (torch.compile: JAX always jits)
            pts.update({c: "n/a" for c in cats if c not in pts})
        panels.append(panel)
    title = f"Train step throughput per toggle (bars: p10-p90 of the timed steps) — {_where(info)}"
    return draw(out_dir, PLOT_FILES["train"], title, panels, ncols=1)


REMAT_ORDER = ("none", "save_dots", "save_qkv_attn", "full", "offload")


def plot_remat(out_dir: str, records: list[dict], info: dict | None = None) -> Plot | None:
    """Memory per remat policy, one panel per model shape: JAX's compiled temp bytes (CPU, and the H100 ones
    "compiled, not run"), JAX's saved residuals, torch's bytes kept for the backward (and its peak on a GPU)."""
    panels = []
    ok = _ok(records, "measured")
    biggest = max(
        (v or 0 for r in ok for k, v in r["measured"].items() if k.endswith("_bytes") and isinstance(v, (int, float))),
        default=0,
    )
    unit, scale = ("GiB", 2**30) if biggest >= 2**30 else ("MiB", 2**20)  # units that fit the values
    for shape in dict.fromkeys((r["preset"], r["n_layers"], r["B"], r["S"]) for r in ok):
        series: dict = {}
        for r in ok:
            if (r["preset"], r["n_layers"], r["B"], r["S"]) != shape:
                continue
            m, pol, tgt = r["measured"], r["impl"], r["target"]
            where = "H100, compiled, not run" if tgt == "h100" else tgt
            if r["framework"] == "jax":
                series.setdefault(f"jax: XLA temp ({where})", {})[pol] = m["temp_bytes"] / scale
                if m.get("residual_bytes") is not None:  # the same for every target: one series
                    series.setdefault("jax: saved residuals", {}).setdefault(pol, m["residual_bytes"] / scale)
            else:
                series.setdefault(f"torch: saved for backward ({tgt})", {})[pol] = m["saved_bytes"] / scale
                if m.get("peak_mem_bytes"):
                    series.setdefault(f"torch: peak allocated ({tgt})", {})[pol] = m["peak_mem_bytes"] / scale
        pols = {p for pts in series.values() for p in pts}
        cats = tuple(p for p in REMAT_ORDER if p in pols) + tuple(sorted(pols - set(REMAT_ORDER)))
        panels.append(
            Panel(
                f"{shape[0]} (n_layers={shape[1]}), B={shape[2]}, S={shape[3]}, bf16",
                "remat policy",
                f"memory ({unit})",
                series,
                kind="bar",
                categories=cats,
            )
        )
    return draw(
        out_dir,
        PLOT_FILES["remat"],
        f"Activation memory per remat policy — {_where(info)}"
        + ("; H100 bars compiled, not run" if any(r.get("target") == "h100" for r in ok) else ""),
        panels,
        ncols=1,
    )


def plot_decode(out_dir: str, records: list[dict], info: dict | None = None) -> Plot | None:
    """Tokens/s against batch size, one panel per (model, pass), one line per framework x weights (the device
    in the label when the frameworks ran on different ones); log y when the values span decades."""
    ok = _ok(records, "tokens_per_s")
    devices = {r.get("device") for r in ok}
    panels = []
    for model, pss in sorted({(r["model"], r["pass"]) for r in ok}, key=lambda k: (k[0], k[1] != "decode")):
        what = {
            "decode": "one step, B new tokens",
            "generate": f"{next(r.get('new_tokens') for r in ok if r['pass'] == pss)} new tokens per row, one wait",
        }.get(pss, f"prompt of {ok[0].get('prompt_len')} tokens")
        panel = Panel(f"{model}: {pss} ({what})", "batch size", "tokens/s", {}, logx=2)
        for r in ok:
            if (r["model"], r["pass"]) == (model, pss):
                lab = f"{readable(r)} {r['weights']}" + (f" ({r.get('device')})" if len(devices) > 1 else "")
                _add_point(panel, lab, r["B"], r["tokens_per_s"], r)
        panels.append(panel)
    return draw(
        out_dir,
        PLOT_FILES["decode"],
        f"Decode and prefill throughput with the KV cache (bars: p10-p90) — {_where(info)}",
        panels,
        ncols=2,
    )


_STAGES = {
    "flash_fwd": "fwd",
    "mosaic_fwd": "fwd",
    "flash_bwd_dq": "bwd dq",
    "flash_bwd_dkv": "bwd dkv",
    # jax's Pallas op (pallas.ops:mha), the peer: one forward, a delta pre-pass and one fused dq+dkv backward
    "mha_forward": "fwd",
    "mha_preprocess_backward": "bwd delta",
    "mha_backward": "bwd dq+dkv",
    # tokamax: Triton forward + one fused backward; Mosaic GPU forward + dq and dkv kernels
    "pallas_flash_attention_fwd_res": "fwd",
    "pallas_flash_attention_vjp": "bwd dq+dkv",
    "mosaic_bwd_dq": "bwd dq",
    "mosaic_bwd_dkv": "bwd dkv",
}


def plot_kernels(out_dir: str, records: list[dict], info: dict | None = None, name: str | None = None) -> Plot | None:
    """Registers per thread, spill bytes and shared memory of each compiled attention kernel (``kernels.json``
    of ``python -m benchmarks compile``, or the kernel records of the ``compile`` suite), one bar per
    implementation x dtype, grouped by kernel and head dim. Compiled for the target, never run."""
    ok = [r for r in _ok(records, "registers") if r.get("part", "kernel") == "kernel"]
    if not ok:
        return None
    limits = KERNEL_LIMITS
    stage = lambda r: _STAGES.get(r["kernel"], r["kernel"])  # noqa: E731
    order = list(dict.fromkeys(_STAGES.values()))
    cats = sorted(
        {(stage(r), r["head_dim"]) for r in ok},
        key=lambda c: (order.index(c[0]) if c[0] in order else len(order), c[0], c[1]),
    )
    cat_names = tuple(f"{s} D={d}" for s, d in cats)
    metrics = [
        (
            "registers per thread",
            "registers",
            lambda r: r["registers"],
            ((limits["max_regs_per_thread"], f"max {limits['max_regs_per_thread']} / thread"),),
        ),
        (
            "spilled bytes (stores + loads)",
            "bytes",
            lambda r: (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0),
            (),
        ),
        (
            "shared memory per block",
            "KiB",
            lambda r: r["smem_bytes"] / 1024,
            ((limits["smem_per_block"] / 1024, f"max {limits['smem_per_block'] / 1024:.0f} KiB / block"),),
        ),
    ]
    panels = []
    for title, unit, get, lims in metrics:
        series: dict = {}
        for r in ok:
            series.setdefault(f"{r['impl']} {r['dtype']}", {})[f"{stage(r)} D={r['head_dim']}"] = get(r)
        note = (
            "no spills"
            if title.startswith("spilled") and not any(v for pts in series.values() for v in pts.values())
            else None
        )
        panels.append(
            Panel(
                title,
                "kernel, head dim",
                unit,
                series,
                kind="bar",
                categories=cat_names,
                logy=False,
                limits=lims,
                note=note,
            )
        )
    label = next((r.get("label") for r in ok if r.get("label")), "compiled for the target, not run")
    target = (info or {}).get("target_device") or label.replace("compiled for ", "").replace(", not run", "")
    r0 = ok[0]
    title = (
        f"Attention kernels for {target} — compiled, not run (deviceless, ptxas -v); "
        f"B={r0.get('B')}, S={r0.get('S')}, Hq={r0.get('Hq')}, causal={r0.get('causal')}"
    )
    return draw(out_dir, name or PLOT_FILES["kernels"], title, panels, ncols=1)


def plot_plan(out_dir: str, records: list[dict], info: dict | None = None) -> Plot | None:
    """The plan suite's micro-batch sweeps (pipeline rows of one devices x preset x mesh x schedule x loss at two or
    more micro-batch counts; the single rows are the README table's): peak memory per device and the idle fraction
    read off the compiled stage loop, beside the analytic curve, against the micro-batches; None (nothing written)
    without a sweep."""
    from twincore.pipeline import bubble_fraction

    def key(r):
        return r["devices"], r["preset"], r["mesh"], r["schedule"], r.get("loss", "dense")

    # AdamW's sweeps (an 8-bit AdamW row is the 8-bit README table's)
    ok = [r for r in _ok(records, "measured") if "pipeline" in r["measured"] and r.get("optimizer", "adamw") == "adamw"]
    counts: dict = {}
    for r in ok:
        counts[key(r)] = counts.get(key(r), 0) + 1
    ok = [r for r in ok if counts[key(r)] > 1]
    if not ok:
        return None
    mem = Panel("peak memory per device", "micro-batches per step", "GiB", {}, logx=2, logy=False)
    idle = Panel("idle fraction (points: compiled loop)", "micro-batches per step", "", {})
    idle.logx, idle.logy = 2, False
    limits = set()
    for r in ok:
        pipe, lab = r["measured"]["pipeline"], f"{r['devices']} GPUs {r['preset']} {r['mesh']} {r['schedule']}"
        lab += "" if r.get("loss", "dense") == "dense" else f" loss={r['loss']}"
        mem.series.setdefault(lab, {})[r["microbatches"]] = r["measured"]["per_device_memory"]["peak"] / 2**30
        if pipe["bubble_compiled"] is not None:
            idle.series.setdefault(lab, {})[r["microbatches"]] = pipe["bubble_compiled"]
        limits.add(r.get("device_memory_bytes") or 80e9)
    for p, v in sorted({(r["measured"]["pipeline"]["stages"], r["measured"]["pipeline"]["virtual"]) for r in ok}):
        name = f"analytic p={p}" + ("" if v == 1 else f" v={v}")
        idle.series[name] = {m: bubble_fraction(p, m, v) for m in (1, 2, 4, 8, 16) if v == 1 or m >= p}
    mem.limits = tuple((b / 2**30, f"{b / 1e9:.0f} GB") for b in sorted(limits))
    return draw(
        out_dir,
        PLOT_FILES["plan"],
        "Pipeline stages: memory and bubble vs micro-batches — H100s, compiled, not run",
        [mem, idle],
        ncols=2,
    )


PLOT_FILES = {
    "attention": "attention_tflops.png",
    "train": "train_tokens_per_s.png",
    "remat": "remat_memory.png",
    "decode": "decode_tokens_per_s.png",
    "compile": "compile_kernels.png",
    "kernels": "kernels.png",
    "plan": "pipeline_plans.png",
}
PLOTTERS: dict[str, Callable] = {
    "attention": plot_attention,
    "train": plot_train,
    "remat": plot_remat,
    "decode": plot_decode,
    "compile": plot_kernels,
    "kernels": plot_kernels,
    "plan": plot_plan,
}


def plot_suite(out_dir: str, suite: str, records: list[dict], info: dict | None = None) -> Plot | None:
    """The plot of ``suite`` (:data:`PLOTTERS`) from its records into ``out_dir/PLOT_FILES[suite]``; None (and
    nothing written) for a suite without a plot or records with nothing measured."""
    if suite not in PLOTTERS or not _ok(records):
        return None
    if suite in ("compile", "kernels"):
        return plot_kernels(out_dir, records, info, PLOT_FILES[suite])
    return PLOTTERS[suite](out_dir, records, info)
