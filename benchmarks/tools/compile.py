"""``python -m benchmarks compile [--target h100|h200] [--quick] [--search] [--out DIR]``: compile our GPU programs
for an H100/H200 on a machine without a GPU ("deviceless") and report what the compiler made of them
(``--target v5e|v5p|v6e``: one TPU chip, ``benchmarks/tools/tpu_compile.py``).

    python -m benchmarks compile --quick          # a few kernels + the tiny model, about 2 minutes on 2 cores

Kernels: the flash forward / dq / dkv and Mosaic forward kernels per head dim and dtype (registers, spills, shared
memory, occupancy, tensor-core instructions); programs: the model forward and the bf16 train step (compiled
memory, XLA's FLOPs beside the analytic count). Writes ``kernels.json``, ``programs.json``, ``report.md`` and
``kernels.png`` under ``--out`` (default ``benchmarks/results/local/<target>-compiled[-quick]/``, untracked; the
committed record is refreshed with ``--out benchmarks/results/h100-compiled``); ``--search`` runs
the block-size search instead. Every figure is "compiled for H100, not run" (details: benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin starts without a CUDA runtime

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxattn import gpu_target, tpu_target  # noqa: E402

from .. import measure  # noqa: E402
from ..report import compile_tables  # noqa: E402
from ..report.compile_tables import LABEL  # noqa: E402
from ..report.plots import plot_suite  # noqa: E402
from ..report.records import write_results, write_text_atomic  # noqa: E402
from . import block_search, kernel_stats  # noqa: E402
from .deviceless import BENCH_SHAPE, DTYPES, GATE_SHAPE, TARGETS, AttnShape, target_config  # noqa: E402
from .programs import (  # noqa: E402
    analytic_flops,
    build_program,
    cost_stats,
    memory_stats,
    out_dir,
    program_base,
    program_cases,
)

FLASH_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv")
PEER_MHA = "pallas.ops:mha"  # jax.experimental.pallas.ops.gpu.attention.mha, compiled beside our kernels
PEER_MHA_KERNELS = ("mha_forward", "mha_preprocess_backward", "mha_backward")
TPU_TARGETS = tuple(tpu_target.CHIPS)  # --target v5e|v5p|v6e: tools/tpu_compile.py


# ------------------------------------------------------------------------------------------------- cases
def kernel_cases(quick: bool):
    """``[(impl, D, dtype name)]``: ours, and outside ``--quick`` a peer beside them: jax's own Pallas GPU attention
    op (``pallas.ops:mha``, Triton) at bf16 D 64 / 128."""
    if quick:
        return [("flash", 64, "bf16"), ("flash", 128, "bf16"), ("mosaic", 128, "bf16")]
    flash = [("flash", d, dt) for dt in ("bf16", "fp16", "fp32") for d in (64, 128, 256)]
    mosaic = [("mosaic", d, dt) for dt in ("bf16", "fp16") for d in (64, 128, 256)]
    return flash + mosaic + [(PEER_MHA, d, "bf16") for d in (64, 128)]


# ------------------------------------------------------------------------------------------------- kernels
def _attn_args(devs, shape: AttnShape, d: int, dtype):
    q = jax.ShapeDtypeStruct((shape.b, shape.s, shape.hq, d), dtype)
    k = jax.ShapeDtypeStruct((shape.b, shape.s, shape.hkv, d), dtype)
    return gpu_target.place((q, k, k), devs)


def compile_flash(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
    """Compile flash fwd+bwd (``jax.grad`` through ``dot_product_attention(backend="flash")``) and return
    ``{kernel name: record}`` for :data:`FLASH_KERNELS`."""
    from jaxattn.attention import dot_product_attention

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, causal=shape.causal, backend="flash")
        return out.astype(jnp.float32).sum()

    with tempfile.TemporaryDirectory(dir=workdir) as dump:
        gpu_target.compile(
            jax.grad(loss, argnums=(0, 1, 2)),
            *_attn_args(devs, shape, d, dtype),
            compiler_options={"xla_dump_to": dump},
        )
        return kernel_stats.from_xla_dump(dump, names=FLASH_KERNELS)


def compile_pallas_mha(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
    """jax's own Pallas GPU attention (``jax.experimental.pallas.ops.gpu.attention.mha``, Triton) forward+backward,
    the peer of our flash kernel: ``{kernel name: record}`` for :data:`PEER_MHA_KERNELS`. Its causal mask is
    top-left, the same as ours at ``Sq == Sk``; it takes no GQA (``shape.hkv`` must equal ``shape.hq``)."""
    from jax.experimental.pallas.ops.gpu.attention import mha

    if shape.hkv != shape.hq:
        raise ValueError(f"{PEER_MHA} takes no GQA: Hq={shape.hq} != Hkv={shape.hkv}")

    def loss(q, k, v):
        return mha(q, k, v, None, sm_scale=d**-0.5, causal=shape.causal).astype(jnp.float32).sum()

    with tempfile.TemporaryDirectory(dir=workdir) as dump:
        gpu_target.compile(
            jax.grad(loss, argnums=(0, 1, 2)),
            *_attn_args(devs, shape, d, dtype),
            compiler_options={"xla_dump_to": dump},
        )
        return kernel_stats.from_xla_dump(dump, names=PEER_MHA_KERNELS)


def compile_mosaic(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
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
        base = dict(
            impl=impl,
            head_dim=d,
            dtype=dt,
            B=shape.b,
            S=shape.s,
            Hq=shape.hq,
            Hkv=shape.hkv,
            causal=shape.causal,
            label=LABEL.format(target=target.upper()),
        )
        try:
            fn = {"flash": compile_flash, "mosaic": compile_mosaic, PEER_MHA: compile_pallas_mha}[impl]
            recs = fn(devs, d, DTYPES[dt], shape)
        except Exception as e:  # one failed compile is a record, not the end of the run
            records.append(dict(base, status="error", error=f"{type(e).__name__}: {str(e)[:500]}"))
            log(f"  {impl} D={d} {dt}: ERROR {type(e).__name__}: {str(e)[:200]}")
            continue
        secs = time.perf_counter() - t0
        for rec in recs.values():
            records.append(dict(base, **rec, status="ok", compile_s=round(secs, 1)))
        log(f"  {impl} D={d} {dt}: {len(recs)} kernels in {secs:.1f}s")
    return records


# ------------------------------------------------------------------------------------------------- programs
def program_records(devs, cases, target: str, log=print) -> list:
    from jaxattn.attention import attention_backend

    records = []
    for preset, kind, batch, seq, overrides, loss in cases:
        t0 = time.perf_counter()
        base = program_base(preset, kind, batch, seq, overrides, loss, "flash", LABEL.format(target=target.upper()))
        try:
            with tempfile.TemporaryDirectory() as dump, attention_backend("flash"):
                jitted, args, cfg = build_program(devs, preset, kind, batch, seq, overrides, loss)
                lowered, compiled = gpu_target.compile(
                    None, *args, jitted=jitted, compiler_options={"xla_dump_to": dump}
                )
                launches = kernel_stats.xla_launches(dump)
            text = lowered.as_text()
            rec = dict(
                base,
                status="ok",
                compile_s=round(time.perf_counter() - t0, 1),
                **memory_stats(compiled),
                **cost_stats(compiled),
                **analytic_flops(cfg, kind, batch, seq),
                launches=len(launches),
                flash_kernels=sorted({l["name"] for l in launches if l["name"].startswith("flash_")}),
                triton_calls=text.count("__gpu$xla.gpu.triton"),
            )
            # HloCostAnalysis counts a while loop's body once: the layer scan's n_layers count as one layer.
            trips = sorted({int(n) for n in re.findall(r"known_trip_count[^0-9]*(\d+)", compiled.as_text())})
            counted = 1 if cfg.n_layers in trips else cfg.n_layers
            once = analytic_flops(dataclasses.replace(cfg, n_layers=counted), kind, batch, seq)
            rec.update(
                while_trip_counts=trips,
                layers_counted_by_xla=counted,
                model_flops_as_counted=once["model_flops"],
                dense_flops_as_counted=once["dense_flops"],
            )
            rec["flops_ratio"] = rec["xla_flops"] / once["model_flops"]
            rec["flops_ratio_dense"] = rec["xla_flops"] / once["dense_flops"]
        except Exception as e:
            rec = dict(base, status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
            log(f"  {preset} {kind} {loss}: ERROR {type(e).__name__}: {str(e)[:200]}")
            records.append(rec)
            continue
        records.append(rec)
        log(
            f"  {preset} {kind} B={batch} S={seq} {base['loss'] or ''}: peak {rec['peak'] / 2**20:.1f} MiB, "
            f"XLA/analytic FLOPs {rec['flops_ratio']:.2f}, {rec['compile_s']}s"
        )
    return records


def _tool_version(name: str) -> str | None:
    path = gpu_target.tool_path(name)
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else None


def _search_main(devs, args, info, out, t0) -> int:
    rows = block_search.search(devs, quick=args.quick, log=lambda *a: print(*a, flush=True))
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    if not any(r["passed"] for r in rows):
        print("no candidate passed; no result written", file=sys.stderr)
        return 1
    info["timed_on"] = measure.jax_device_name() if any("time" in r for r in rows) else None
    print(block_search.write(out, rows, info))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target",
        choices=TARGETS + TPU_TARGETS,
        default="h100",
        help="target description (default h100); v5e / v5p / v6e: one TPU chip (benchmarks/tools/tpu_compile.py)",
    )
    parser.add_argument("--quick", action="store_true", help="a few kernels and the tiny model (~2 minutes)")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default benchmarks/results/local/<target>-compiled[-quick], untracked)",
    )
    parser.add_argument("--skip-programs", action="store_true", help="kernels only")
    parser.add_argument(
        "--search",
        action="store_true",
        help="block-size search instead (benchmarks/tools/block_search.py): deviceless resource filter "
        "of every candidate, then timings when a GPU is present; writes block_search.json/md",
    )
    args = parser.parse_args(argv)
    if args.target in TPU_TARGETS:  # the TPU compile has its own flags and tables
        from .tpu_compile import main as tpu_main

        return tpu_main(argv)
    reason = gpu_target.unavailable_reason()
    if reason is not None:
        parser.error(f"cannot compile for a GPU here: {reason}")
    out = out_dir(parser, args)

    t0 = time.perf_counter()
    devs = gpu_target.devices(target_config(args.target))
    info = measure.env_info()
    info.update(
        target=args.target,
        target_device=devs[0].device_kind,
        quick=args.quick,
        plugin=gpu_target._version("jax-cuda12-plugin"),
        ptxas=_tool_version("ptxas"),
        cuobjdump=_tool_version("cuobjdump"),
        label=LABEL.format(target=args.target.upper()),
    )
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
    write_results(out, "kernels", kernels, info)
    if programs:
        write_results(out, "programs", programs, info)
    plot = plot_suite(out, "kernels", kernels, info)
    text = compile_tables.report(kernels, programs, info, os.path.basename(plot.path) if plot else None)
    write_text_atomic(os.path.join(out, "report.md"), text)
    print(text)
    print(f"wrote {out} in {info['wall_s']}s")
    failed = [r for r in kernels + programs if r.get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
