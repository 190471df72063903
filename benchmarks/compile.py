"""``python -m benchmarks compile [--target h100|h200] [--quick] [--out DIR]``: compile our GPU programs for an
H100/H200 on a machine without a GPU ("deviceless") and report what the compiler made of them.

    python -m benchmarks compile --quick          # a few kernels + the tiny model, about 2 minutes on 2 cores
    python -m benchmarks compile --search         # block-size search (benchmarks/block_search.py)

Kernels (one record each): the flash forward / dq / dkv Pallas-Triton kernels at D 64/128/256 in bf16, fp16
and fp32 (one fwd+bwd compile per (D, dtype)), the Mosaic GPU forward at D 64/128/256 in bf16/fp16: registers
and spills (``ptxas -v --gpu-name=sm_90a``), stack, shared memory and threads (XLA's launch list; Mosaic:
``.maxntid`` and its planned shared memory), occupancy on the H100 limits, and the tensor-core instructions in
the SASS (``cuobjdump -sass``: HGMMA = wgmma, HMMA = mma.sync). Programs: the jitted model forward and the
full train step (``jaxattn.train.make_train_step``, bf16 policy, flash attention) for ``tiny`` and ``1b``,
built from ShapeDtypeStructs (``nnx.eval_shape``: the 1b model is never materialised): compiled memory
(arguments, outputs, temporaries, peak) and XLA's cost analysis of the compiled module, beside the analytic
FLOPs. Writes ``kernels.json``, ``programs.json``, ``report.md`` and ``kernels.png`` (registers, spills and
shared memory per kernel) under ``--out`` (default ``benchmarks/results/<target>-compiled[-quick]/``). Every
figure is "compiled for H100, not run". The same measurements as a suite of ``python -m benchmarks run``:
``--suite compile`` (:func:`run`; ``compile.json`` and ``compile_kernels.png`` beside the other suites).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin starts without a CUDA runtime

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxattn import gpu_target  # noqa: E402

from . import common, kernel_stats  # noqa: E402

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
TARGETS = ("h100", "h200")
LABEL = "compiled for {target}, not run"
FLASH_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv")
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def target_config(name: str) -> str:
    """Text of ``benchmarks/targets/<name>.txtpb`` (name in :data:`TARGETS`)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {TARGETS}")
    return (TARGETS_DIR / f"{name}.txtpb").read_text()


# ------------------------------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class AttnShape:
    b: int = 1
    s: int = 4096
    hq: int = 16
    hkv: int = 16
    causal: bool = True


BENCH_SHAPE = AttnShape()                          # the shape of the notes' peer comparison
GATE_SHAPE = AttnShape(b=1, s=256, hq=4, hkv=2)   # small: the CI gate (block sizes are capped by S)


def kernel_cases(quick: bool):
    """``[(impl, D, dtype name)]``."""
    if quick:
        return [("flash", 64, "bf16"), ("flash", 128, "bf16"), ("mosaic", 128, "bf16")]
    flash = [("flash", d, dt) for dt in ("bf16", "fp16", "fp32") for d in (64, 128, 256)]
    mosaic = [("mosaic", d, dt) for dt in ("bf16", "fp16") for d in (64, 128, 256)]
    return flash + mosaic


def program_cases(quick: bool):
    """``[(preset, kind, batch, seq, overrides)]``."""
    tiny = [("tiny", "forward", 2, 128, {}), ("tiny", "train_step", 2, 128, {})]
    if quick:
        return tiny
    return tiny + [("1b", "forward", 4, 2048, {}), ("1b", "train_step", 4, 2048, {})]


# ------------------------------------------------------------------------------------------------- kernels
def _attn_args(devs, shape: AttnShape, d: int, dtype):
    q = jax.ShapeDtypeStruct((shape.b, shape.s, shape.hq, d), dtype)
    k = jax.ShapeDtypeStruct((shape.b, shape.s, shape.hkv, d), dtype)
    return gpu_target.place((q, k, k), devs)


def compile_flash(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: Optional[str] = None) -> dict:
    """Compile flash fwd+bwd (``jax.grad`` through ``dot_product_attention(backend="flash")``) and return
    ``{kernel name: record}`` for :data:`FLASH_KERNELS`."""
    from jaxattn.attention import dot_product_attention

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, causal=shape.causal, backend="flash")
        return out.astype(jnp.float32).sum()

    with tempfile.TemporaryDirectory(dir=workdir) as dump:
        gpu_target.compile(jax.grad(loss, argnums=(0, 1, 2)), *_attn_args(devs, shape, d, dtype),
                           compiler_options={"xla_dump_to": dump})
        return kernel_stats.from_xla_dump(dump, names=FLASH_KERNELS)


def compile_mosaic(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: Optional[str] = None) -> dict:
    """Compile the Mosaic GPU forward and return ``{"mosaic_fwd": record}``; its PTX comes from Mosaic's own
    dump (``MOSAIC_GPU_DUMP_PTX=1`` prints it on stdout while XLA compiles the custom call)."""
    from jaxattn.attention import dot_product_attention
    from jaxattn.attention.mosaic import MosaicBlockSizes

    def fwd(q, k, v):
        return dot_product_attention(q, k, v, causal=shape.causal, backend="mosaic")

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        log = os.path.join(tmp, "mosaic.log")
        flags = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS")
        old = {k: os.environ.get(k) for k in flags}
        os.environ.update({k: "1" for k in flags})
        try:
            with kernel_stats.capture_fd_output(log):
                gpu_target.compile(fwd, *_attn_args(devs, shape, d, dtype))
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        with open(log, errors="replace") as f:
            text = f.read()
        modules = kernel_stats.split_ptx_modules(text)
        if not modules:
            raise RuntimeError("Mosaic GPU printed no PTX (MOSAIC_GPU_DUMP_PTX=1 had no effect in this jax)")
        itemsize = jnp.dtype(dtype).itemsize
        smem = MosaicBlockSizes.default(d).smem_bytes(d, itemsize)
        report = "\n".join(line for line in text.splitlines() if line.startswith(("ptxas", "    ")))
        recs = kernel_stats.from_ptx(modules[-1], tmp, smem_dynamic=smem, ptxas_report=report or None)
    (rec,) = recs.values()
    rec["kernel"] = "mosaic_fwd"
    rec["smem_source"] = "MosaicBlockSizes.smem_bytes (planned dynamic allocation)"
    return {"mosaic_fwd": rec}


def kernel_records(devs, cases, shape: AttnShape, target: str, log=print) -> list:
    records = []
    for impl, d, dt in cases:
        t0 = time.perf_counter()
        base = dict(impl=impl, head_dim=d, dtype=dt, B=shape.b, S=shape.s, Hq=shape.hq, Hkv=shape.hkv,
                    causal=shape.causal, label=LABEL.format(target=target.upper()))
        try:
            fn = compile_flash if impl == "flash" else compile_mosaic
            recs = fn(devs, d, DTYPES[dt], shape)
        except Exception as e:  # one failed compile is a record, not the end of the run
            records.append(dict(base, status="error", error=f"{type(e).__name__}: {str(e)[:500]}"))
            log(f"  {impl} D={d} {dt}: ERROR {type(e).__name__}: {str(e)[:200]}")
            continue
        secs = time.perf_counter() - t0
        for name, rec in recs.items():
            records.append(dict(base, **rec, status="ok", compile_s=round(secs, 1)))
        log(f"  {impl} D={d} {dt}: {len(recs)} kernels in {secs:.1f}s")
    return records


# ------------------------------------------------------------------------------------------------- programs
def matmul_params(cfg) -> int:
    """Parameters that take part in a matmul per token: every layer's projections and MLP, plus the LM head
    (the embedding lookup does no FLOPs). The N of the 6·N·tokens rule."""
    d = cfg.resolved_head_dim if hasattr(cfg, "resolved_head_dim") else (cfg.head_dim or cfg.dim // cfg.n_heads)
    attn = cfg.dim * d * (cfg.n_heads + 2 * cfg.n_kv_heads) + cfg.n_heads * d * cfg.dim
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return cfg.n_layers * (attn + mlp) + cfg.dim * cfg.vocab_size


def analytic_flops(cfg, kind: str, batch: int, seq: int) -> dict:
    """Model FLOPs: 6·N·tokens + attention (fwd+bwd) for a train step, 2·N·tokens + attention (fwd) for a
    forward; attention by the FlashAttention convention (causal halves it)."""
    d = cfg.resolved_head_dim if hasattr(cfg, "resolved_head_dim") else (cfg.head_dim or cfg.dim // cfg.n_heads)
    n = matmul_params(cfg)
    train = kind == "train_step"
    dense = (6 if train else 2) * n * batch * seq
    attn = cfg.n_layers * common.attention_flops(batch, cfg.n_heads, seq, seq, d, True, backward=train)
    return {"matmul_params": n, "dense_flops": float(dense), "attention_flops": float(attn),
            "model_flops": float(dense + attn)}


def _abstract_model(cfg):
    from flax import nnx

    from jaxattn.model import Llama
    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))


def build_program(devs, preset: str, kind: str, batch: int, seq: int, overrides: dict):
    """``(jitted, args, cfg)`` for the model forward or the train step, all inputs ShapeDtypeStructs placed on
    the target's devices."""
    import optax
    from flax import nnx

    from jaxattn.config import ModelConfig
    cfg = ModelConfig.preset(preset, **overrides)
    tokens = jax.ShapeDtypeStruct((batch, seq + (1 if kind == "train_step" else 0)), jnp.int32)
    if kind == "forward":
        graphdef, params, rest = nnx.split(_abstract_model(cfg), nnx.Param, ...)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
                              if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

        def forward(params, rest, tokens):
            return nnx.merge(graphdef, params, rest)(tokens)

        return jax.jit(forward), gpu_target.place((params, rest, tokens), devs), cfg
    if kind != "train_step":
        raise ValueError(f"kind must be 'forward' or 'train_step', got {kind!r}")
    from jaxattn.model import Llama
    from jaxattn.train import TrainState, make_train_step
    tx = optax.adamw(1e-4)
    graphdef = nnx.split(_abstract_model(cfg), nnx.Param, ...)[0]
    state = jax.eval_shape(lambda: TrainState.create(Llama(cfg, rngs=nnx.Rngs(0)), tx, policy="bf16")[1])
    step = make_train_step(graphdef, tx, policy="bf16")
    return step.jitted, gpu_target.place((state, {"tokens": tokens}), devs), cfg


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    peak = getattr(m, "peak_memory_in_bytes", None)
    out["peak"] = int(peak) if peak else out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["peak_source"] = "memory_analysis" if peak else "argument + output - alias + temp"
    return out


def _cost(compiled) -> dict:
    """XLA's HLO cost analysis of the compiled GPU module. The deviceless executable does not implement
    ``cost_analysis()``, so the optimized module is analysed by the CPU client's HloCostAnalysis; custom
    calls (our Pallas kernels) count 0 FLOPs there."""
    try:
        cost = compiled.cost_analysis()
        source = "compiled.cost_analysis()"
    except Exception:
        cost = None
    if not cost:
        from jax._src.lib import _jax  # private: the only route to HloCostAnalysis for a deviceless compile
        mods = compiled.runtime_executable().hlo_modules()
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, mods[0])
        source = "HloCostAnalysis of the compiled module (custom calls count 0)"
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return {"xla_flops": float(cost.get("flops", 0.0)), "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "cost_source": source}


def program_records(devs, cases, target: str, log=print) -> list:
    from jaxattn.attention import attention_backend
    records = []
    for preset, kind, batch, seq, overrides in cases:
        t0 = time.perf_counter()
        base = dict(preset=preset, kind=kind, batch=batch, seq=seq, overrides=overrides, precision="bf16",
                    attention="flash", label=LABEL.format(target=target.upper()))
        try:
            with tempfile.TemporaryDirectory() as dump, attention_backend("flash"):
                jitted, args, cfg = build_program(devs, preset, kind, batch, seq, overrides)
                lowered, compiled = gpu_target.compile(None, *args, jitted=jitted,
                                                       compiler_options={"xla_dump_to": dump})
                launches = kernel_stats.xla_launches(dump)
            text = lowered.as_text()
            rec = dict(base, status="ok", compile_s=round(time.perf_counter() - t0, 1), **_memory(compiled),
                       **_cost(compiled), **analytic_flops(cfg, kind, batch, seq),
                       launches=len(launches), flash_kernels=sorted({l["name"] for l in launches
                                                                    if l["name"].startswith("flash_")}),
                       triton_calls=text.count("__gpu$xla.gpu.triton"))
            # HloCostAnalysis counts a while loop's body once: the layer scan's n_layers count as one layer.
            trips = sorted({int(n) for n in re.findall(r'known_trip_count[^0-9]*(\d+)', compiled.as_text())})
            counted = 1 if cfg.n_layers in trips else cfg.n_layers
            once = analytic_flops(dataclasses.replace(cfg, n_layers=counted), kind, batch, seq)
            rec.update(while_trip_counts=trips, layers_counted_by_xla=counted,
                       model_flops_as_counted=once["model_flops"], dense_flops_as_counted=once["dense_flops"])
            rec["flops_ratio"] = rec["xla_flops"] / once["model_flops"]
            rec["flops_ratio_dense"] = rec["xla_flops"] / once["dense_flops"]
        except Exception as e:
            rec = dict(base, status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
            log(f"  {preset} {kind}: ERROR {type(e).__name__}: {str(e)[:200]}")
            records.append(rec)
            continue
        records.append(rec)
        log(f"  {preset} {kind}: peak {rec['peak'] / 2**20:.1f} MiB, XLA/analytic FLOPs "
            f"{rec['flops_ratio']:.2f}, {rec['compile_s']}s")
    return records


# ------------------------------------------------------------------------------------------------- report
def _mib(x) -> str:
    return f"{x / 2**20:,.1f}"


def report(kernels: list, programs: list, info: dict, plot: Optional[str] = None) -> str:
    """``report.md`` of ``python -m benchmarks compile``: what was compiled and how it was read, the kernel and
    program tables (:func:`tables`) and, when ``plot`` names one beside it, a link to the kernel plot."""
    target = info["target"].upper()
    lines = [f"# Compiled for {target}, not run", "",
             f"Deviceless compile (`python -m benchmarks compile{' --quick' if info['quick'] else ''}`), jax "
             f"{info.get('jax')}, jax-cuda12-plugin {info.get('plugin')}, ptxas {info.get('ptxas')}; target "
             f"`benchmarks/targets/{info['target']}.txtpb`. Nothing here ran on a GPU: no times. Registers and "
             "spills from `ptxas -v --gpu-name=sm_90a` on the PTX XLA/Mosaic emitted; threads and shared "
             "memory from XLA's launch list (Mosaic: `.maxntid` and its planned allocation); occupancy = "
             "resident warps / 64 on the H100 limits (65536 regs, 228 KB smem, 2048 threads, 32 blocks per SM); "
             "HGMMA = wgmma, HMMA = mma.sync, TMA = UTMALDG, cp.async = LDGSTS, counted in the SASS.", ""]
    lines += tables(kernels, programs, target)
    if plot:
        lines += [f"![kernels plot]({plot})", ""]
    return "\n".join(lines)


def tables(kernels: list, programs: list, target: str, level: str = "##") -> list:
    """The markdown lines of the kernel and program tables, under ``level`` headings."""
    lines = [f"{level} Kernels (compiled for {target}, not run)", "",
             "| impl | kernel | D | dtype | threads | regs | spill st/ld B | stack B | smem B | blocks/SM | "
             "occupancy | HGMMA | HMMA | TMA | cp.async |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in kernels:
        if r.get("status") != "ok":
            why = r.get("error") or r.get("reason") or ""
            lines.append(f"| {r['impl']} | {r.get('status', 'error').upper()} | {r['head_dim']} | {r['dtype']} | "
                         f"{why[:80]} | | | | | | | | | | |")
            continue
        sass = r.get("sass") or {}
        ops = [sass.get(k, "n/a") for k in ("HGMMA", "HMMA", "UTMALDG", "LDGSTS")]
        spill = f"{r['spill_stores']}/{r['spill_loads']}"
        if r["spill_stores"] or r["spill_loads"]:
            spill = f"**{spill}**"
        lines.append(f"| {r['impl']} | `{r['kernel']}` | {r['head_dim']} | {r['dtype']} | {r['threads']} | "
                     f"{r['registers']} | {spill} | {r['stack']} | {r['smem_bytes']:,} | {r.get('blocks_per_sm')} | "
                     f"{r.get('occupancy', 0):.3f} | {ops[0]} | {ops[1]} | {ops[2]} | {ops[3]} |")
    shape = kernels[0] if kernels else {}
    lines += ["", f"Kernel shape: B={shape.get('B')}, S={shape.get('S')}, Hq={shape.get('Hq')}, "
              f"Hkv={shape.get('Hkv')}, causal={shape.get('causal')}; flash = one fwd+bwd compile per (D, dtype).",
              "", f"{level} Programs (compiled for {target}, not run)", "",
              "| preset | program | B×S | compile s | launches | args MiB | out MiB | temp MiB | peak MiB | "
              "XLA GFLOP | model GFLOP (all layers) | XLA / model (1 layer) | XLA / dense (1 layer) | XLA GB accessed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in programs:
        if r.get("status") != "ok":
            why = r.get("error") or r.get("reason") or ""
            lines.append(f"| {r['preset']} | {r['kind']} | {r.get('status', 'error').upper()}: {why[:80]} "
                         "| | | | | | | | | | | |")
            continue
        lines.append(f"| {r['preset']} | {r['kind']} | {r['batch']}×{r['seq']} | {r['compile_s']} | "
                     f"{r['launches']} | {_mib(r['argument'])} | {_mib(r['output'])} | {_mib(r['temp'])} | "
                     f"{_mib(r['peak'])} | {r['xla_flops'] / 1e9:,.1f} | {r['model_flops'] / 1e9:,.1f} | "
                     f"{r['flops_ratio']:.3f} | {r['flops_ratio_dense']:.3f} | {r['xla_bytes_accessed'] / 1e9:,.2f} |")
    lines += ["", "Model FLOPs = 6·N·tokens + attention fwd+bwd (train step) or 2·N·tokens + attention fwd "
              "(forward), N = matmul parameters (layers + LM head, no embedding lookup); attention by the "
              "FlashAttention convention, causal. XLA FLOPs: HloCostAnalysis of the compiled module (the "
              "deviceless executable has no cost_analysis), which counts a while loop's body once, so the "
              "layer scan counts as ONE layer, and our Pallas attention kernels (custom calls) as 0: the ratios "
              "divide by the analytic FLOPs of the same one-layer program (`layers_counted_by_xla` in the "
              "JSON), and `XLA / dense` (no attention) is the one to compare with 1.0; above 1.0 is the "
              "elementwise work (norms, RoPE, softmax of the loss, optimizer update). bf16 policy, flash "
              "attention, AdamW.", ""]
    return lines


# ------------------------------------------------------------------------------------------------- the suite
def run(quick: bool = False, target: str = "h100", log=print) -> list:
    """The ``compile`` suite of ``python -m benchmarks run``: what ``python -m benchmarks compile`` measures
    (``--quick``: its quick kernels at the small gate shape and the tiny programs), as one record list: kernel
    records (``part`` "kernel": registers, spills, shared memory, ...) then program records (``part``
    "program": compiled memory and FLOPs of the forward and the train step), each labelled "compiled for
    H100, not run". Without the gpu-compile extra every record is ``skipped`` with the reason (``all`` then
    skips the suite with a note)."""
    kcases, pcases = kernel_cases(quick), program_cases(quick)
    label = LABEL.format(target=target.upper())
    reason = gpu_target.unavailable_reason()
    if reason is not None:
        return ([dict(part="kernel", framework="jax", impl=impl, head_dim=d, dtype=dt, label=label,
                      status="skipped", reason=reason) for impl, d, dt in kcases]
                + [dict(part="program", framework="jax", impl=kind, preset=preset, kind=kind, label=label,
                        status="skipped", reason=reason) for preset, kind, _, _, _ in pcases])
    devs = gpu_target.devices(target_config(target))
    kernels = kernel_records(devs, kcases, GATE_SHAPE if quick else BENCH_SHAPE, target, log=log)
    programs = program_records(devs, pcases, target, log=log)
    return ([dict(r, part="kernel", framework="jax") for r in kernels]
            + [dict(r, part="program", framework="jax", impl=r["kind"]) for r in programs])


def suite_tables(records: list) -> str:
    """The compile suite's section of ``report.md``: :func:`tables` of its kernel and program records."""
    label = next((r["label"] for r in records if r.get("label")), LABEL.format(target="H100"))
    target = label.replace("compiled for ", "").replace(", not run", "")
    kernels = [r for r in records if r.get("part") == "kernel"]
    programs = [r for r in records if r.get("part") == "program"]
    return "\n".join(tables(kernels, programs, target, level="###")).rstrip()


def _tool_version(name: str) -> Optional[str]:
    import subprocess
    path = gpu_target.tool_path(name)
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else None


def _search_main(devs, args, info, out, t0) -> int:
    from . import block_search
    rows = block_search.search(devs, quick=args.quick, log=lambda *a: print(*a, flush=True))
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    if not any(r["passed"] for r in rows):
        print("no candidate passed; no result written", file=sys.stderr)
        return 1
    info["timed_on"] = common.jax_device_name() if any("time" in r for r in rows) else None
    print(block_search.write(out, rows, info))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=TARGETS, default="h100", help="target description (default h100)")
    parser.add_argument("--quick", action="store_true", help="a few kernels and the tiny model (~2 minutes)")
    parser.add_argument("--out", default=None,
                        help="output directory (default benchmarks/results/<target>-compiled[-quick])")
    parser.add_argument("--skip-programs", action="store_true", help="kernels only")
    parser.add_argument("--search", action="store_true",
                        help="block-size search instead (benchmarks/block_search.py): deviceless resource filter "
                             "of every candidate, then timings when a GPU is present; writes block_search.json/md")
    args = parser.parse_args(argv)
    reason = gpu_target.unavailable_reason()
    if reason is not None:
        parser.error(f"cannot compile for a GPU here: {reason}")
    out = args.out or str(Path(__file__).resolve().parent / "results" /
                          f"{args.target}-compiled{'-quick' if args.quick else ''}")
    try:
        out = common.check_out_dir(out)
    except ValueError as e:
        parser.error(str(e))

    t0 = time.perf_counter()
    devs = gpu_target.devices(target_config(args.target))
    info = common.env_info()
    info.update(target=args.target, target_device=devs[0].device_kind, quick=args.quick,
                plugin=gpu_target._version("jax-cuda12-plugin"), ptxas=_tool_version("ptxas"),
                cuobjdump=_tool_version("cuobjdump"), label=LABEL.format(target=args.target.upper()))
    print(f"compiling for {devs[0].device_kind} (deviceless) -> {out}", flush=True)
    if args.search:
        return _search_main(devs, args, info, out, t0)
    shape = GATE_SHAPE if args.quick else BENCH_SHAPE
    kernels = kernel_records(devs, kernel_cases(args.quick), shape, args.target)
    programs = [] if args.skip_programs else program_records(devs, program_cases(args.quick), args.target)
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    if not any(r.get("status") == "ok" for r in kernels + programs):
        print("nothing compiled; no result written", file=sys.stderr)
        return 1
    common.write_results(out, "kernels", kernels, info)
    if programs:
        common.write_results(out, "programs", programs, info)
    plot = common.plot_suite(out, "kernels", kernels, info)
    text = report(kernels, programs, info, os.path.basename(plot.path) if plot else None)
    common.write_text_atomic(os.path.join(out, "report.md"), text)
    print(text)
    print(f"wrote {out} in {info['wall_s']}s")
    failed = [r for r in kernels + programs if r.get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
