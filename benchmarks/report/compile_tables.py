"""Markdown of the deviceless compile: ``report.md`` of ``python -m benchmarks compile`` and the kernel and
program tables, also the ``compile`` suite's section of a run's ``report.md``.

    text = report(kernels, programs, env, "kernels.png")   # what benchmarks/results/h100-compiled/report.md holds
"""

from __future__ import annotations

LABEL = "compiled for {target}, not run"  # every figure of a deviceless compile carries it


def _mib(x) -> str:
    return f"{x / 2**20:,.1f}"


def report(
    kernels: list,
    programs: list,
    info: dict,
    plot: str | None = None,
    fwd_bwd: list | None = None,
    grouped: list | None = None,
) -> str:
    """``report.md`` of ``python -m benchmarks compile``: what was compiled and how it was read, the kernel table,
    the attention fwd+bwd table (:func:`fwd_bwd_table`, when ``fwd_bwd`` has records), the program table
    (:func:`tables`) and, when ``plot`` names one beside it, a link to the kernel plot."""
    target = info["target"].upper()
    lines = [
        f"# Compiled for {target}, not run",
        "",
        f"Deviceless compile (`python -m benchmarks compile{' --quick' if info['quick'] else ''}`), jax "
        f"{info.get('jax')}, jax-cuda12-plugin {info.get('plugin')}, ptxas {info.get('ptxas')}; target "
        f"`benchmarks/targets/{info['target']}.txtpb`. Nothing here ran on a GPU: no times. Registers and "
        "spills from `ptxas -v --gpu-name=sm_90a` on the PTX XLA/Mosaic emitted; threads and shared "
        "memory from XLA's launch list (Mosaic: `.maxntid` and its planned allocation); occupancy = "
        "resident warps / 64 on the H100 limits (65536 regs, 228 KB smem, 2048 threads, 32 blocks per SM); "
        "HGMMA = wgmma, HMMA = mma.sync, TMA = UTMALDG, cp.async = LDGSTS, counted in the SASS.",
        "",
    ]
    body = tables(kernels, programs, target)
    at = body.index(f"## Programs (compiled for {target}, not run)")  # after the kernel table, before the programs
    body[at:at] = (
        pipeline_table(kernels, target)
        + (fwd_bwd_table(fwd_bwd, target) if fwd_bwd else [])
        + (grouped_table(grouped, target) if grouped else [])
    )
    lines += body
    if plot:
        lines += [f"![kernels plot]({plot})", ""]
    return "\n".join(lines)


def tables(kernels: list, programs: list, target: str, level: str = "##") -> list:
    """The markdown lines of the kernel and program tables, under ``level`` headings."""
    lines = [f"{level} Kernels (compiled for {target}, not run)", ""] + _head(
        ["impl", "kernel", "D", "dtype", *RESOURCE_COLUMNS]
    )
    for r in kernels:
        if r.get("status") != "ok":
            status, why = _failure(r, 80)
            lines.append(_row([r["impl"], status, r["head_dim"], r["dtype"], why], 15))
            continue
        lines.append(f"| {r['impl']} | `{r['kernel']}` | {r['head_dim']} | {r['dtype']} | {_resources(r)} |")
    shape = kernels[0] if kernels else {}
    lines += [
        "",
        f"Kernel shape: B={shape.get('B')}, S={shape.get('S')}, Hq={shape.get('Hq')}, "
        f"Hkv={shape.get('Hkv')}, causal={shape.get('causal')}; flash = one fwd+bwd compile per (D, dtype).",
        "",
        f"{level} Programs (compiled for {target}, not run)",
        "",
        "| preset | program | loss | B×S | compile s | launches | args MiB | out MiB | temp MiB | peak MiB | "
        "XLA GFLOP | model GFLOP (all layers) | XLA / model (1 layer) | XLA / dense (1 layer) | "
        "XLA GB accessed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in programs:
        if r.get("status") != "ok":
            status, why = _failure(r, 80)
            lines.append(_row([_preset(r), _program(r), r.get("loss") or "—", f"{status}: {why}"], 15))
            continue
        lines.append(
            f"| {_preset(r)} | {_program(r)} | {r.get('loss') or '—'} | {r['batch']}×{r['seq']} | {r['compile_s']} | "
            f"{r['launches']} | {_mib(r['argument'])} | {_mib(r['output'])} | {_mib(r['temp'])} | "
            f"{_mib(r['peak'])} | {r['xla_flops'] / 1e9:,.1f} | {r['model_flops'] / 1e9:,.1f} | "
            f"{r['flops_ratio']:.3f} | {r['flops_ratio_dense']:.3f} | {r['xla_bytes_accessed'] / 1e9:,.2f} |"
        )
    lines += [
        "",
        "Model FLOPs = 6·N·tokens + attention fwd+bwd (train step) or 2·N·tokens + attention fwd "
        "(forward), N = matmul parameters a token uses (layers + LM head, no embedding lookup; an MoE counts "
        "its top-k experts and the router); attention by the "
        "FlashAttention convention, causal. XLA FLOPs: HloCostAnalysis of the compiled module (the "
        "deviceless executable has no cost_analysis), which counts a while loop's body once, so the "
        "layer scan counts as ONE layer, and our Pallas kernels (custom calls: attention, the MoE grouped GEMM "
        "`experts: pallas`) as 0: the ratios "
        "divide by the analytic FLOPs of the same one-layer program (`layers_counted_by_xla` in the "
        "JSON), and `XLA / dense` (no attention) is the one to compare with 1.0; above 1.0 is the "
        "elementwise work (norms, RoPE, softmax of the loss, optimizer update) — or, for `experts: xla`, "
        "`jax.lax.ragged_dot` lowered to dense masked dots over every expert. bf16 policy, flash "
        "attention, AdamW.",
        "",
    ]
    return lines


# the columns of :func:`_resources`
RESOURCE_COLUMNS = (
    "threads",
    "regs",
    "spill st/ld B",
    "stack B",
    "smem B",
    "blocks/SM",
    "occupancy",
    "HGMMA",
    "HMMA",
    "TMA",
    "cp.async",
)


def _head(columns: list) -> list[str]:
    """A markdown table's header and separator lines."""
    return [_row(list(columns), len(columns)), "|" + "---|" * len(columns)]


def _failure(r: dict, width: int) -> tuple[str, str]:
    """``(STATUS, why)`` of a record that did not compile (``why`` cut to ``width`` characters)."""
    return r.get("status", "error").upper(), (r.get("error") or r.get("reason") or "")[:width]


def _row(cells: list, n_cols: int) -> str:
    """A markdown table row of ``cells`` padded with empty cells to ``n_cols``."""
    return "| " + " | ".join(str(c) for c in cells + [""] * (n_cols - len(cells))) + " |"


def _resources(r: dict) -> str:
    """The resource cells of a compiled kernel's row, threads to cp.async (spills in bold)."""
    sass = r.get("sass") or {}
    ops = [sass.get(k, "n/a") for k in ("HGMMA", "HMMA", "UTMALDG", "LDGSTS")]
    spill = f"{r['spill_stores']}/{r['spill_loads']}"
    if r["spill_stores"] or r["spill_loads"]:
        spill = f"**{spill}**"
    return (
        f"{r['threads']} | {r['registers']} | {spill} | {r['stack']} | {r['smem_bytes']:,} | "
        f"{r.get('blocks_per_sm')} | {r.get('occupancy', 0):.3f} | {ops[0]} | {ops[1]} | {ops[2]} | {ops[3]}"
    )


# (column, ptx_counts key): the instructions that tell a warp-specialised, pipelined Hopper kernel from a plain one
PIPELINE_COLUMNS = (
    ("setmaxnreg", "setmaxnreg"),
    ("wgmma", "wgmma"),
    ("commit / wait", ("wgmma.commit_group", "wgmma.wait_group")),
    ("TMA loads", "cp.async.bulk.tensor"),
    ("cp.async", "cp.async"),
    ("mbarrier wait / arrive", ("mbarrier.try_wait", "mbarrier.arrive")),
    ("bar.sync", "bar.sync"),
)


def pipeline_table(kernels: list, target: str, level: str = "##") -> list:
    """The markdown lines of the pipelining table: per 16-bit kernel (bf16 rows; fp16 compiles the same
    instructions), the static PTX counts of :data:`PIPELINE_COLUMNS` (a loop's instruction counts once), ours beside
    the peers' at the same shape.  Empty when no record has PTX counts."""
    rows = [
        r for r in kernels if r.get("status") == "ok" and r.get("ptx_counts") and r["dtype"] in ("bf16", "bfloat16")
    ]
    if not rows:
        return []
    lines = [f"{level} Hopper pipelining per kernel, bf16 (PTX, compiled for {target}, not run)", ""]
    lines += _head(["impl", "kernel", "D", "regs", *(c for c, _ in PIPELINE_COLUMNS)])
    for r in rows:
        c = r["ptx_counts"]
        cells = [
            " / ".join(str(c.get(k, 0)) for k in key) if isinstance(key, tuple) else c.get(key, 0)
            for _, key in PIPELINE_COLUMNS
        ]
        lines.append(_row([r["impl"], f"`{r['kernel']}`", r["head_dim"], r["registers"], *cells], 4 + len(cells)))
    lines += [
        "",
        "Static counts in the PTX (an instruction inside a loop counts once): `setmaxnreg` = the warp-specialised "
        "register split (a producer gives registers to the consumers), commit / wait = asynchronous wgmma groups "
        "and their waits, TMA loads = `cp.async.bulk.tensor`, mbarrier = the producer / consumer hand-over, "
        "`bar.sync` = named barriers (ping-pong, warpgroup sync). Registers at launch; `setmaxnreg` moves them.",
        "",
    ]
    return lines


def grouped_table(records: list, target: str, level: str = "##") -> list:
    """The markdown lines of the MoE grouped-GEMM section (``benchmarks/tools/grouped_compile.py``): per
    implementation and pass what it lowered to, then our Pallas kernels' resources."""
    programs = [r for r in records if r.get("what") == "lowering"]
    kernels = [r for r in records if r.get("what") == "kernel"]
    r0 = records[0] if records else {}
    cols = ["impl", "pass", "launches", "Triton calls", "XLA dots", "largest dot operand", "temp MiB", "peak MiB"]
    lines = [f"{level} MoE grouped GEMM (compiled for {target}, not run)", ""]
    lines += _head(cols + ["XLA GFLOP", "grouped GFLOP"])
    for r in programs:
        if r.get("status") != "ok":
            status, why = _failure(r, 90)
            lines.append(_row([r["impl"], r["pass"], f"{status}: {why}"], 10))
            continue
        op = r["largest_dot_operand"]
        lines.append(
            f"| {r['impl']} | {r['pass']} | {r['launches']} | {r['triton_calls']} | {r['xla_dots']} | "
            f"{'[' + ', '.join(map(str, op)) + ']' if op else '—'} | {r['temp'] / 2**20:,.2f} | {_mib(r['peak'])} | "
            f"{r['xla_flops'] / 1e9:,.1f} | {r['grouped_flops'] / 1e9:,.1f} |"
        )
    if kernels:
        lines += [""] + _head(["impl", "kernel", "dtype", *RESOURCE_COLUMNS])
        lines += [f"| {r['impl']} | `{r['kernel']}` | {r['dtype']} | {_resources(r)} |" for r in kernels]
    lines += [
        "",
        f"bf16 `out[r] = lhs[r] @ rhs[group(r)]`, G={r0.get('G')} experts, M={r0.get('M')} routed rows, "
        f"K={r0.get('K')}, N={r0.get('N')}, group sizes a runtime vector; `fwd_bwd` = `jax.vjp` with the "
        "cotangent as an input. pallas = `jaxattn.grouped_matmul` (Triton: `grouped_matmul` out, "
        "`grouped_matmul_t` d_lhs, `grouped_matmul_tgmm` d_rhs), ragged_dot = `jax.lax.ragged_dot`. Largest dot "
        "operand: the biggest parameter of XLA's GEMM fusions (all of them: `dot_operands` in the JSON; at the "
        "Mixtral shape ragged_dot's forward multiplies the rows expanded to `[M, G·K]` by the weights as one "
        "`[G·K, N]` matrix, G× the grouped FLOPs). "
        "grouped GFLOP = 2·M·K·N (×3 with the backward); XLA GFLOP = HloCostAnalysis (custom calls count 0).",
        "",
    ]
    return lines


def _preset(r: dict) -> str:
    """A program's preset with its config overrides: ``mixtral-8x7b (n_layers=2)``."""
    extra = ", ".join(f"{k}={v}" for k, v in (r.get("overrides") or {}).items())
    return f"{r['preset']} ({extra})" if extra else r["preset"]


def _program(r: dict) -> str:
    """A program's kind with an MoE's grouped GEMM: ``train_step, experts: pallas``."""
    gemm = r.get("expert_gemm")
    return f"{r['kind']}, experts: {gemm}" if gemm else r["kind"]


def kernel_counts(names: list) -> str:
    """``"`a`, `custom_call` ×3"``: the kernels of a launch list in first-launch order, repeats counted."""
    counts: dict = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"`{n}`" + (f" ×{c}" if c > 1 else "") for n, c in counts.items())


def fwd_bwd_table(records: list, target: str, level: str = "##") -> list:
    """The markdown lines of the attention forward+backward table: per implementation (ours, the peers, cuDNN,
    XLA) the kernel launches and the compiled memory of ``jax.grad`` of its attention, one program each."""
    lines = [
        f"{level} Attention forward+backward, one program per implementation (compiled for {target}, not run)",
        "",
        "| impl | D | dtype | launches | kernels | temp MiB | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("status") != "ok":
            why = r.get("error") or r.get("reason") or ""
            lines.append(f"| {r['impl']} | {r['head_dim']} | {r['dtype']} | {r['status'].upper()}: {why[:90]} | | | |")
            continue
        names = kernel_counts(r["kernels"])
        lines.append(
            f"| {r['impl']} | {r['head_dim']} | {r['dtype']} | {r['launches']} | {names} | {r['temp'] / 2**20:,.2f} "
            f"| {_mib(r['peak'])} |"
        )
    shape = records[0] if records else {}
    lines += [
        "",
        f"`jax.grad` of the float32 sum of the attention output, B={shape.get('B')}, S={shape.get('S')}, "
        f"Hq={shape.get('Hq')}, Hkv={shape.get('Hkv')}, causal={shape.get('causal')}. Launches: XLA's thunk "
        "sequence (fusions included; `custom_call` = a Mosaic GPU kernel or a cuDNN call). temp: the scratch "
        "XLA allocates beside the inputs and outputs (residuals, softmax statistics, workspaces). Ours, cuDNN "
        "and XLA through `dot_product_attention(backend=...)`; the peers as their packages document.",
        "",
    ]
    return lines


def suite_tables(records: list) -> str:
    """The compile suite's section of ``report.md``: :func:`tables` of its kernel and program records, and
    :func:`grouped_table` of its MoE grouped-GEMM records."""
    label = next((r["label"] for r in records if r.get("label")), LABEL.format(target="H100"))
    target = label.replace("compiled for ", "").replace(", not run", "")
    kernels = [r for r in records if r.get("part") == "kernel"]
    programs = [r for r in records if r.get("part") == "program"]
    grouped = [r for r in records if r.get("part") == "grouped_gemm"]
    lines = tables(kernels, programs, target, level="###")
    if grouped:
        at = lines.index(f"### Programs (compiled for {target}, not run)")
        lines[at:at] = grouped_table(grouped, target, level="###")
    return "\n".join(lines).rstrip()


def dir_report(found: dict, plot: str | None = None) -> str:
    """:func:`report` of a ``python -m benchmarks compile`` directory from its JSON (``found``: ``{suite:
    {"env", "records"}}`` with ``kernels`` and maybe ``programs``); ``python -m benchmarks report DIR`` uses it."""
    env = found["kernels"].get("env") or {}
    programs = (found.get("programs") or {}).get("records") or []
    fwd_bwd = (found.get("fwd_bwd") or {}).get("records") or []
    grouped = (found.get("grouped_gemm") or {}).get("records") or []
    return report(found["kernels"]["records"], programs, env, plot, fwd_bwd, grouped)


def _gib(x) -> str:
    return f"{x / 2**30:,.2f}"


def _est(r: dict) -> str:
    s = r.get("compiler_estimate_s")
    return "—" if s is None else f"{1e3 * s:,.3g}"


def tpu_tables(kernels: list, programs: list, info: dict, level: str = "##") -> list:
    """The markdown lines of a TPU compile's splash and program tables (``benchmarks/tools/tpu_compile.py``)."""
    target, hbm = info["target"], info.get("hbm_bytes") or 0
    lines = [
        f"{level} Attention fwd+bwd: splash and its peers (compiled for {target}, not run)",
        "",
        "| impl | D | dtype | B × S × Hq/Hkv | Mosaic TPU calls | temp MiB | peak MiB | XLA GFLOPs (a kernel: its "
        "cost estimate or 0) | attention GFLOPs | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in kernels:
        shape = f"{r['B']} × {r['S']} × {r['Hq']}/{r['Hkv']}"
        head = f"| {r.get('impl', 'splash')} | {r['head_dim']} | {r['dtype']} | {shape} |"
        if r.get("status") != "ok":
            why = str(r.get("error") or r.get("reason"))[:80]
            lines.append(f"{head} {r.get('status', 'error').upper()}: {why} | | | | | |")
            continue
        lines.append(
            f"{head} {r['tpu_custom_calls']} | {_mib(r['temp'])} | "
            f"{_mib(r['peak'])} | {r['xla_flops'] / 1e9:,.3g} | {r['attention_flops'] / 1e9:,.3g} | {r['compile_s']} |"
        )
    if programs:
        lines += [
            "",
            f"{level} Programs on one {target} chip ({_gib(hbm)} GiB HBM; compiled, not run)",
            "",
            "| preset | program | loss | batch × seq | temp GiB | peak GiB | fits | XLA TFLOPs | "
            "compiler estimate ms (one layer, no attention) | Mosaic TPU calls |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in programs:
            head = f"| {r['preset']} | {r['kind']} | {r.get('loss') or '—'} | {r['batch']} × {r['seq']} |"
            if r.get("status") == "does_not_fit":
                lines.append(f"{head} — | needs {r['required_temp_gib']:,.2f} (refused) | **no** | — | — | — |")
                continue
            if r.get("status") != "ok":
                lines.append(f"{head} ERROR: {str(r.get('error'))[:80]} | | | | | |")
                continue
            lines.append(
                f"{head} {_gib(r['temp'])} | {_gib(r['peak'])} | {'yes' if r['fits'] else '**no**'} | "
                f"{r['xla_flops'] / 1e12:,.3g} | {_est(r)} | {r['tpu_custom_calls']} |"
            )
    return lines + [""]


def splash_blocks_table(records: list, target: str, level: str = "##") -> list:
    """The markdown lines of the splash block-size search (``compile --target T --search``): per head dim and dtype,
    which square block compiles within the chip's scoped VMEM, and the largest that does."""
    blocks = sorted({r["block"] for r in records}, reverse=True)
    cases = list(dict.fromkeys((r["head_dim"], r["dtype"]) for r in records))
    lines = [
        f"{level} Splash block sizes that fit the scoped VMEM (compiled for {target}, not run)",
        "",
        "| D | dtype | " + " | ".join(f"block {b}" for b in blocks) + " | largest that fits |",
        "|---|---|" + "---|" * (len(blocks) + 1),
    ]
    for d, dt in cases:
        row = {r["block"]: r for r in records if (r["head_dim"], r["dtype"]) == (d, dt)}
        cells = []
        for b in blocks:
            r = row.get(b)
            cell = "—" if r is None else {"ok": f"fits ({_mib(r.get('temp', 0))} MiB temp)", "vmem_oom": "VMEM OOM"}
            cells.append(cell if isinstance(cell, str) else cell.get(r["status"], r["status"].upper()))
        fits = [b for b in blocks if row.get(b, {}).get("status") == "ok"]
        lines.append(f"| {d} | {dt} | " + " | ".join(cells) + f" | {max(fits) if fits else 'none'} |")
    s, h = (records[0]["S"], records[0]["H"]) if records else (None, None)
    lines += [
        "",
        f"Causal forward+backward of our `splash` backend with one square block size, B=1, S={s}, {h} heads. "
        "`VMEM OOM` is the TPU compiler's `CompileTimeScopedVmemOom`. The compiler tells fit, not speed; "
        "`jaxattn.attention.splash.VMEM_CAPS` holds the last column (a test checks it against this file).",
        "",
    ]
    return lines


def tpu_report(kernels: list, programs: list, info: dict, blocks: list | None = None) -> str:
    """``report.md`` of ``python -m benchmarks compile --target v5e|v5p|v6e`` (``blocks``: its ``--search``'s
    records, when the directory has them)."""
    lines = [
        f"# Compiled for {info['target']}, not run",
        "",
        f"Deviceless TPU compile (`python -m benchmarks compile --target {info['target']}"
        f"{' --quick' if info.get('quick') else ''}`), jax {info.get('jax')}, libtpu {info.get('libtpu')}; "
        f"{info.get('target_device')}, {info.get('topology')}. Nothing here ran on a TPU: memory is XLA's "
        "buffer assignment (`memory_analysis()`), FLOPs and the time estimate are XLA's cost analysis of the "
        "compiled module, which counts our Pallas (Mosaic TPU) kernels as 0 and a while loop's body once (the "
        "scanned layers count as one layer, a fused loss's chunk loop as one chunk): the estimate is the "
        "compiler's for one layer plus the rest, without attention, never a measured time. Attention GFLOPs: "
        "FlashAttention's count (forward + backward = 3.5× forward, causal halved).",
        "",
    ]
    lines += tpu_tables(kernels, programs, info)
    if blocks:
        lines += [""] + splash_blocks_table(blocks, info["target"])
    return "\n".join(lines)


def tpu_dir_report(found: dict, plot: str | None = None) -> str:
    """``report.md`` of a TPU compile directory, redone from its JSON (``python -m benchmarks report DIR``)."""
    k = found["tpu_kernels"]
    blocks = (found.get("splash_blocks") or {}).get("records")
    return tpu_report(k["records"], (found.get("tpu_programs") or {}).get("records", []), k.get("env") or {}, blocks)


def suite_memory_table(rows: list[dict]) -> str:
    """``suite_memory.json`` (``benchmarks/tools/suite_memory.py``): per model / train suite row, JAX's compiled
    memory for the target, whether it fits, and with torch's estimate beside it."""
    lines = [
        "| suite | row | B | S | JAX compiled GiB | fits (JAX) | + torch estimate GiB | fits (both) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "**no**"}
    for r in rows:
        name = f"{r.get('preset', '')} {r.get('pass', r.get('toggle', ''))}"
        gib = f"{r['memory']['peak'] / 2**30:.2f}" if r.get("status") == "ok" else r.get("reason", "")
        est = f"{r['torch_estimate_bytes'] / 2**30:.2f}" if "torch_estimate_bytes" in r else "—"
        lines.append(
            f"| {r['suite']} | {name} | {r['B']} | {r['S']} | {gib} | {yes.get(r.get('fits'), '—')} | {est} | "
            f"{yes.get(r.get('fits_both'), '—')} |"
        )
    return "\n".join(lines)
