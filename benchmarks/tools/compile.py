"""``python -m benchmarks compile [--target h100|h200] [--quick] [--search] [--out DIR]``: compile our GPU programs
for an H100/H200 on a machine without a GPU ("deviceless") and report what the compiler made of them
(``--target v5e|v5p|v6e``: one TPU chip, ``benchmarks/tools/tpu_compile.py``).

    python -m benchmarks compile --quick          # a few kernels + the tiny model, about 2 minutes on 2 cores

Kernels: the flash forward / dq / dkv and Mosaic forward kernels per head dim and dtype (registers, spills, shared
memory, occupancy, tensor-core instructions); the MoE grouped GEMM, ours beside ``ragged_dot``
(``grouped_compile.py``); programs: the model forward and the bf16 train step, dense and MoE (compiled memory, XLA's
FLOPs beside the analytic count). Writes ``kernels.json``, ``fwd_bwd.json``, ``grouped_gemm.json``,
``programs.json``, ``report.md`` and
``kernels.png`` under ``--out`` (default ``benchmarks/results/local/<target>-compiled[-quick]/``, untracked; the
committed record is refreshed with ``--out benchmarks/results/h100-compiled``); ``--search`` runs
the block-size search instead. Every figure is "compiled for H100, not run" (details: benchmarks/NOTES.md).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin starts without a CUDA runtime

import jax  # noqa: E402

from jaxattn import gpu_target, tpu_target  # noqa: E402

from .. import measure, mgpu_peer  # noqa: E402
from ..report import compile_tables  # noqa: E402
from ..report.compile_tables import LABEL  # noqa: E402
from ..report.plots import plot_suite  # noqa: E402
from . import block_search, compile_run, kernel_stats  # noqa: E402
from .deviceless import BENCH_SHAPE, GATE_SHAPE, TARGETS, AttnShape, target_config  # noqa: E402
from .grouped_compile import grouped_records  # noqa: E402
from .programs import (  # noqa: E402
    PEER_MHA,
    TOKAMAX_MOSAIC,
    TOKAMAX_TRITON,
    analytic_flops,
    attention_base,
    attention_loss,
    build_program,
    cost_stats,
    gemm_context,
    memory_stats,
    peer_context,
    program_cases,
)

FLASH_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv")
PEER_MHA_KERNELS = ("mha_forward", "mha_preprocess_backward", "mha_backward")
# tokamax's Triton kernels (one forward, one fused dq+dk+dv backward) and its Mosaic GPU kernels (FA3-style forward,
# dq and dkv backward), the peers of our flash and mosaic backends.
TOKAMAX_TRITON_KERNELS = ("pallas_flash_attention_fwd_res", "pallas_flash_attention_vjp")
MOSAIC_KERNELS = block_search.MOSAIC_KERNELS  # ours, each compiled alone
TOKAMAX_MOSAIC_KERNELS = ("mosaic_fwd", "mosaic_bwd_dkv", "mosaic_bwd_dq")  # in the order XLA compiles them
# jax's own FA3-style Mosaic GPU op (jax.experimental.pallas.ops.gpu.attention_mgpu; contract and TuningConfig:
# benchmarks/mgpu_peer.py): its forward (with the softmax residual where the backward is compiled), dq and dkv.
PEER_MGPU = mgpu_peer.COMPILE_NAME
# In the order Mosaic compiles them: the forward, then dkv before dq (read in the PTX on jax 0.10.2 and 0.12: the dkv
# kernel stores two tiles, dk and dv, and issues 4 wgmma per step to dq's 3; compile_pallas_mgpu checks the latter).
PEER_MGPU_KERNELS = ("mgpu_fwd", "mgpu_bwd_dkv", "mgpu_bwd_dq")
GPU_PEERS = (PEER_MHA, PEER_MGPU, TOKAMAX_TRITON, TOKAMAX_MOSAIC)
# One fwd+bwd program per implementation for the launches / compiled-temp table: ours, the peers, cuDNN (through
# our dispatcher: its kernels are a library's, with no PTX to read) and XLA's own attention.
ATTENTION_IMPLS = ("flash", "mosaic", "cudnn", "xla") + GPU_PEERS
TPU_TARGETS = tuple(tpu_target.CHIPS)  # --target v5e|v5p|v6e: tools/tpu_compile.py


# ------------------------------------------------------------------------------------------------- cases
def kernel_cases(quick: bool):
    """``[(impl, D, dtype name)]``: ours, and outside ``--quick`` the peers beside them (:data:`GPU_PEERS`: jax's own
    Pallas GPU attention ops, Triton ``mha`` and the FA3-style Mosaic GPU ``attention_mgpu``, tokamax's Triton and
    Mosaic GPU kernels) at bf16 D 64 / 128."""
    if quick:
        return [("flash", 64, "bf16"), ("flash", 128, "bf16"), ("mosaic", 128, "bf16")]
    flash = [("flash", d, dt) for dt in ("bf16", "fp16", "fp32") for d in (64, 128, 256)]
    mosaic = [("mosaic", d, dt) for dt in ("bf16", "fp16") for d in (64, 128, 256)]
    return flash + mosaic + [(p, d, "bf16") for p in GPU_PEERS for d in (64, 128)]


def attention_cases(quick: bool):
    """``[(impl, D, dtype name)]`` of the fwd+bwd table: every implementation at bf16 D 128 (``--quick``: ours,
    cuDNN and XLA)."""
    impls = ATTENTION_IMPLS[:4] if quick else ATTENTION_IMPLS
    return [(impl, 128, "bf16") for impl in impls]


# ------------------------------------------------------------------------------------------------- kernels
def _attn_args(devs, shape: AttnShape, d: int, dtype):
    return gpu_target.place(shape.structs(d, dtype), devs)


def compile_fwd_bwd(devs, impl: str, d: int, dtype, shape: AttnShape = BENCH_SHAPE, compiler_options=None):
    """``(lowered, compiled)``: ``jax.grad`` of :func:`_attention_loss` for ``impl`` compiled for ``devs``."""
    if impl == PEER_MGPU:
        return _compile_mgpu(devs, d, dtype, shape, backward=True, compiler_options=compiler_options)
    with peer_context(impl, devs):
        return gpu_target.compile(
            jax.grad(attention_loss(impl, shape, d), argnums=(0, 1, 2)),
            *_attn_args(devs, shape, d, dtype),
            compiler_options=compiler_options,
        )


def mgpu_declines(shape: AttnShape, d: int, dt: str, backward: bool) -> str | None:
    """Why jax's attention_mgpu cannot take ``shape`` at ``(d, dt)`` (the forward, or with ``backward`` the
    fwd+bwd program) in this compile, else None: :func:`.mgpu_peer.unsupported`, its causal check seeing the CUDA
    version of :func:`.mgpu_peer.deviceless_cuda_version`."""
    return mgpu_peer.unsupported(dt, shape.hq, shape.hkv, shape.s, d, shape.causal, backward=backward)


def _compile_mgpu(devs, d: int, dtype, shape: AttnShape, backward: bool, compiler_options=None):
    """``(lowered, compiled)`` of jax's attention_mgpu at ``shape`` (its forward, or ``jax.grad`` of its summed
    output), a bfloat16 call compiled at float16 as the suite runs it (:func:`.mgpu_peer.run_dtype`)."""
    import jax.numpy as jnp

    dtype = jnp.dtype(mgpu_peer.run_dtype(jnp.dtype(dtype).name))
    fwd = mgpu_peer.attention_fn(shape.causal)
    fn = jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if backward else fwd
    with mgpu_peer.deviceless_cuda_version():
        return gpu_target.compile(fn, *_attn_args(devs, shape, d, dtype), compiler_options=compiler_options)


def _triton_kernels(names, impl):
    """A kernel compiler for a Triton implementation: compile its fwd+bwd, read ``names`` from XLA's dump."""

    def compile_kernels(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
        with tempfile.TemporaryDirectory(dir=workdir) as dump:
            compile_fwd_bwd(devs, impl, d, dtype, shape, compiler_options={"xla_dump_to": dump})
            return kernel_stats.from_xla_dump(dump, names=names)

    compile_kernels.__doc__ = f"{impl} fwd+bwd compiled for ``devs``: ``{{kernel name: record}}`` for {names}."
    return compile_kernels


# Ours: flash fwd+bwd (jax.grad through dot_product_attention(backend="flash")). jax's Pallas op: its causal mask is
# top-left, the same as ours at Sq == Sk; it takes no GQA. tokamax's Triton pair.
compile_flash = _triton_kernels(FLASH_KERNELS, "flash")
compile_pallas_mha = _triton_kernels(PEER_MHA_KERNELS, PEER_MHA)
compile_tokamax_triton = _triton_kernels(TOKAMAX_TRITON_KERNELS, TOKAMAX_TRITON)


def compile_mosaic(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
    """Compile our Mosaic GPU forward and, where head_dim has one (``mosaic.BACKWARD_HEAD_DIMS``), its dq and dkv
    backward kernels, each alone with the default block sizes (one module per compile names its kernel: XLA
    compiles a program's custom calls in an order of its own): ``{kernel name: record}`` for
    :data:`MOSAIC_KERNELS` (head_dim 256: the forward alone; its backward is the flash kernels)."""
    from jaxattn.attention import mosaic

    bs = mosaic.MosaicBlockSizes.default(d)
    names = MOSAIC_KERNELS if d in mosaic.BACKWARD_HEAD_DIMS else MOSAIC_KERNELS[:1]
    return {n: block_search.compile_kernel(devs, n, d, dtype, bs, shape, workdir) for n in names}


def compile_tokamax_mosaic(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
    """tokamax's Mosaic GPU fwd+bwd (FA3-style forward, a dq and a dkv kernel): ``{kernel name: record}`` for
    :data:`TOKAMAX_MOSAIC_KERNELS`."""
    thunk = lambda: compile_fwd_bwd(devs, TOKAMAX_MOSAIC, d, dtype, shape)  # noqa: E731
    out = kernel_stats.mosaic_records(
        thunk, TOKAMAX_MOSAIC_KERNELS, workdir, lowering=_dq_first(TOKAMAX_MOSAIC_KERNELS)
    )
    return _dkv_before_dq(out, "tokamax")


def _dq_first(names):  # the lowering order of a (fwd, dkv, dq) compile: both peers call dq first
    return (names[0], names[2], names[1])


def _dkv_before_dq(out: dict, who: str) -> dict:
    """``out`` (fwd, dkv, dq records in compile order) after checking the backward pair's order: XLA compiled
    the dkv custom call before the dq one (jax 0.10-0.12), and a Mosaic module carries no kernel name, so the
    wgmma count tells them apart (a dkv step issues 4 GEMMs, a dq step 3, at equal blocks)."""
    names = list(out)[1:]
    wgmma = [out[n]["ptx_counts"].get("wgmma", 0) for n in names]
    if not wgmma[0] > wgmma[1] > 0:
        raise RuntimeError(f"{who}'s backward kernels compiled in another order than {names} (wgmma counts {wgmma})")
    return out


def compile_pallas_mgpu(devs, d: int, dtype, shape: AttnShape = BENCH_SHAPE, workdir: str | None = None) -> dict:
    """jax's attention_mgpu: ``{kernel name: record}`` for :data:`PEER_MGPU_KERNELS` (fwd+bwd) where its contract
    takes the backward at ``shape``, else its forward alone, ``{"mgpu_fwd": record}`` (no causal backward)."""
    import jax.numpy as jnp

    backward = mgpu_declines(shape, d, jnp.dtype(dtype).name, backward=True) is None
    names = PEER_MGPU_KERNELS if backward else PEER_MGPU_KERNELS[:1]
    thunk = lambda: _compile_mgpu(devs, d, dtype, shape, backward)  # noqa: E731
    out = kernel_stats.mosaic_records(thunk, names, workdir, lowering=_dq_first(names) if backward else None)
    if backward:
        _dkv_before_dq(out, "attention_mgpu")
    for rec in out.values():
        rec["run_dtype"] = mgpu_peer.run_dtype(jnp.dtype(dtype).name)
        rec["tuning_config"] = repr(mgpu_peer.tuning_config(d, shape.causal))
        rec["cuda_runtime"] = "{} ({})".format(*mgpu_peer.cuda_runtime_version())
    return out


KERNEL_COMPILERS = {
    "flash": compile_flash,
    "mosaic": compile_mosaic,
    PEER_MHA: compile_pallas_mha,
    PEER_MGPU: compile_pallas_mgpu,
    TOKAMAX_TRITON: compile_tokamax_triton,
    TOKAMAX_MOSAIC: compile_tokamax_mosaic,
}


def kernel_records(devs, cases, shape: AttnShape, target: str, log=print) -> list:
    """One record per kernel :data:`KERNEL_COMPILERS` compiles for each ``(impl, D, dtype)``."""

    def to_records(ok, recs):
        log(f"  {ok['impl']} D={ok['head_dim']} {ok['dtype']}: {len(recs)} kernels in {ok['compile_s']:.1f}s")
        return [dict(ok, **rec) for rec in recs.values()]

    def compile_case(impl, d, dtype):
        return KERNEL_COMPILERS[impl](devs, d, dtype, shape)

    label = LABEL.format(target=target.upper())

    def table(some):
        return compile_run.attention_table(some, shape, label, compile_case, to_records, log=log)

    return _declining(cases, shape, label, table, backward=False, log=log)


def _declining(cases, shape: AttnShape, label: str, table, backward: bool, log=print) -> list:
    """``table(cases)``'s records, but a skipped record, with the reason, for each attention_mgpu case its contract
    declines at ``shape`` (:func:`mgpu_declines`: a finding, not a failed compile)."""
    records = []
    for impl, d, dt in cases:
        reason = mgpu_declines(shape, d, dt, backward) if impl == PEER_MGPU else None
        if reason is None:
            records.extend(table([(impl, d, dt)]))
            continue
        log(f"  {impl} D={d} {dt}: skipped ({reason})")
        records.append(dict(attention_base(impl, d, dt, shape, label), status="skipped", reason=reason))
    return records


# ------------------------------------------------------------------------------------------------- fwd+bwd
def attention_records(devs, cases, shape: AttnShape, target: str, log=print) -> list:
    """One record per ``(impl, D, dtype)``: its attention forward+backward compiled as one program, the kernel
    launches in XLA's thunk sequence (fusions included: what a profiler would list), the distinct kernels, and the
    compiled memory (temp = the scratch XLA allocates for residuals, softmax statistics and workspaces)."""

    def compile_case(impl, d, dtype):
        with tempfile.TemporaryDirectory() as dump:
            _, compiled = compile_fwd_bwd(devs, impl, d, dtype, shape, compiler_options={"xla_dump_to": dump})
            return compiled, kernel_stats.xla_launches(dump)

    def to_records(ok, result):
        compiled, launches = result
        rec = dict(
            ok,
            **memory_stats(compiled),
            launches=len(launches),
            kernels=[launch["name"] for launch in launches],
            # what the launches are: Triton kernels, Mosaic GPU kernels, cuDNN fMHA calls, cuBLAS GEMMs, ...
            custom_calls=dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))),
        )
        log(
            f"  fwd+bwd {ok['impl']} D={ok['head_dim']} {ok['dtype']}: {rec['launches']} launches, "
            f"temp {rec['temp'] / 2**20:.2f} MiB"
        )
        return [rec]

    label = LABEL.format(target=target.upper())

    def table(some):
        return compile_run.attention_table(some, shape, label, compile_case, to_records, what="fwd+bwd {impl}", log=log)

    return _declining(cases, shape, label, table, backward=True, log=log)


# ------------------------------------------------------------------------------------------------- programs
def program_records(devs, cases, target: str, log=print) -> list:
    """One record per :func:`.programs.program_cases` case: the program compiled with flash attention, its memory,
    XLA's FLOPs beside the analytic count and the kernels it launches."""

    def compile_program(case):
        preset, kind, batch, seq, overrides, loss, gemm = case
        with tempfile.TemporaryDirectory() as dump, gemm_context(gemm):
            jitted, args, cfg = build_program(devs, preset, kind, batch, seq, overrides, loss)
            lowered, compiled = gpu_target.compile(None, *args, jitted=jitted, compiler_options={"xla_dump_to": dump})
            return cfg, lowered, compiled, kernel_stats.xla_launches(dump)

    def to_record(ok, result):
        cfg, lowered, compiled, launches = result
        kind, batch, seq = ok["kind"], ok["batch"], ok["seq"]
        rec = dict(
            ok,
            **memory_stats(compiled),
            **cost_stats(compiled),
            **analytic_flops(cfg, kind, batch, seq),
            launches=len(launches),
            flash_kernels=sorted({l["name"] for l in launches if l["name"].startswith("flash_")}),
            grouped_kernels=sorted({l["name"] for l in launches if l["name"].startswith("grouped_matmul")}),
            triton_calls=lowered.as_text().count("__gpu$xla.gpu.triton"),
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
        return rec

    def describe(rec):
        return f"peak {rec['peak'] / 2**20:.1f} MiB, XLA/analytic FLOPs {rec['flops_ratio']:.2f}, {rec['compile_s']}s"

    label = LABEL.format(target=target.upper())
    return compile_run.program_table(cases, label, "flash", compile_program, to_record, describe, log=log)


def _tool_version(name: str) -> str | None:
    path = gpu_target.tool_path(name)
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else None


def _search_main(devs, args, info, out, t0) -> int:
    rows = block_search.search(devs, quick=args.quick, log=lambda *a: print(*a, flush=True))
    if not compile_run.stop(info, t0, rows, lambda r: r["passed"], "no candidate passed; no result written"):
        return 1
    info["timed_on"] = measure.jax_device_name() if any("time" in r for r in rows) else None
    print(block_search.write(out, rows, info))
    return 0


def main(argv=None) -> int:
    parser = compile_run.compile_parser(
        "python -m benchmarks compile",
        __doc__,
        target=dict(
            choices=TARGETS + TPU_TARGETS,
            default="h100",
            help="target description (default h100); v5e / v5p / v6e: one TPU chip (benchmarks/tools/tpu_compile.py)",
        ),
        quick="a few kernels and the tiny model (~2 minutes)",
        out="output directory (default benchmarks/results/local/<target>-compiled[-quick], untracked)",
        search="block-size search instead (benchmarks/tools/block_search.py): deviceless resource filter "
        "of every candidate, then timings when a GPU is present; writes block_search.json/md",
    )
    args = parser.parse_args(argv)
    if args.target in TPU_TARGETS:  # the TPU compile has its own flags and tables
        from .tpu_compile import main as tpu_main

        return tpu_main(argv)
    out, t0 = compile_run.start(parser, args, gpu_target, "GPU")
    devs = gpu_target.devices(target_config(args.target))
    info = compile_run.run_info(
        args.target,
        devs,
        out,
        quick=args.quick,
        plugin=gpu_target._version("jax-cuda12-plugin"),
        ptxas=_tool_version("ptxas"),
        cuobjdump=_tool_version("cuobjdump"),
        label=LABEL.format(target=args.target.upper()),
    )
    if args.search:
        return _search_main(devs, args, info, out, t0)
    shape = GATE_SHAPE if args.quick else BENCH_SHAPE
    kernels = kernel_records(devs, kernel_cases(args.quick), shape, args.target)
    attention = attention_records(devs, attention_cases(args.quick), shape, args.target)
    grouped = grouped_records(devs, args.quick, args.target, LABEL.format(target=args.target.upper()))
    programs = [] if args.skip_programs else program_records(devs, program_cases(args.quick), args.target)
    if not compile_run.stop(info, t0, kernels + programs):
        return 1
    compile_run.write_tables(
        out, info, {"kernels": kernels, "fwd_bwd": attention, "grouped_gemm": grouped, "programs": programs}
    )
    plot = plot_suite(out, "kernels", kernels, info)
    text = compile_tables.report(
        kernels, programs, info, os.path.basename(plot.path) if plot else None, attention, grouped
    )
    compile_run.write_report(out, info, text)
    failed = [r for r in kernels + attention + grouped + programs if r.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
