"""``python -m benchmarks compile --target v5e|v5p|v6e [--quick] [--out DIR]``: compile our TPU programs for one chip
of a TPU slice on a machine without a TPU (libtpu's topology descriptions, ``jaxattn.tpu_target``).

    python -m benchmarks compile --target v5e --quick      # splash at one shape + the tiny model, ~20 s

Kernels: the splash attention forward+backward (``dot_product_attention(backend="splash")`` under ``jax.grad``)
per head dim and dtype, and beside it jax's Pallas TPU ``flash_attention``, tokamax's Mosaic TPU attention (where
tokamax is installed) and XLA's attention: Mosaic TPU custom calls, compiled memory, XLA's cost analysis.
Programs: the model forward and the bf16 train step (tiny, 1b, 8b; dense and fused loss, the GPU compile's cases)
with splash attention: compiled memory against the chip's HBM, XLA's FLOPs and bytes and the compiler's time estimate
(``optimal_seconds``: "compiler estimate, not run"; the Pallas custom calls are not costed and a while loop's body
counts once, so it covers one layer of the scan and no attention); a program larger than the chip is refused by
the TPU compiler, recorded as ``does_not_fit`` with what it says it needs. Writes ``tpu_kernels.json``,
``tpu_programs.json`` and ``report.md`` under ``--out`` (default ``benchmarks/results/local/<target>-compiled
[-quick]/``; the committed record: ``--out benchmarks/results/<target>-compiled``).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from jaxattn import tpu_target
from twincore.flops import attention_flops

from ..report import compile_tables
from ..report.compile_tables import LABEL
from ..report.records import read_results, write_results, write_text_atomic
from . import compile_run
from .deviceless import BENCH_SHAPE, DTYPES, GATE_SHAPE, AttnShape
from .programs import (
    PEER_TPU_FLASH,
    TOKAMAX_MOSAIC,
    attention_loss,
    build_program,
    memory_stats,
    peer_context,
    program_cases,
    xla_cost,
)

TARGETS = tuple(tpu_target.CHIPS)


TPU_PEERS = (PEER_TPU_FLASH, TOKAMAX_MOSAIC, "xla")  # beside splash: jax's Pallas TPU flash, tokamax, plain XLA


def kernel_cases(quick: bool):
    """``[(impl, D, dtype name)]``: splash per head dim and dtype and, outside ``--quick``, the peers beside it
    (:data:`TPU_PEERS`) at bf16 D 64 / 128."""
    if quick:
        return [("splash", 128, "bf16")]
    splash = [("splash", d, dt) for dt in ("bf16", "fp32") for d in (64, 128, 256)]
    return splash + [(p, d, "bf16") for p in TPU_PEERS for d in (64, 128)]


def cost(compiled) -> dict:
    """XLA's cost analysis of a compiled TPU executable: FLOPs, bytes accessed and the compiler's time estimate
    (``optimal_seconds``; a Pallas custom call counts what its ``cost_estimate`` says, 0 without one: splash gives
    none here, jax's Pallas TPU flash_attention and tokamax do)."""
    c, _ = xla_cost(compiled)
    est = c.get("optimal_seconds")
    return {
        "xla_flops": float(c.get("flops", 0.0)),
        "xla_bytes_accessed": float(c.get("bytes accessed", 0.0)),
        "compiler_estimate_s": float(est) if est is not None and est >= 0 else None,
    }


def _fwd_bwd(chip_devs, impl: str, shape: AttnShape, d: int, dtype):
    """``(lowered, compiled)``: ``jax.grad`` of ``impl``'s attention (:func:`.programs.attention_loss`) for the chip."""
    # at jax's default matmul precision, as a bf16 training step runs: Mosaic TPU refuses a bf16 dot asked for float32
    # precision ("Bad lhs type"), which a process-wide "highest" (our parity tests' setting) would ask of the peers
    with peer_context(impl, chip_devs), jax.default_matmul_precision("default"):
        return tpu_target.compile(
            jax.grad(attention_loss(impl, shape, d), argnums=(0, 1, 2)),
            *tpu_target.place(shape.structs(d, dtype), chip_devs),
        )


def kernel_records(chip_devs, cases, shape: AttnShape, target: str, log=print) -> list:
    """One record per ``(impl, D, dtype)``: its attention forward+backward compiled for the chip."""

    def compile_case(impl, d, dtype):
        return _fwd_bwd(chip_devs, impl, shape, d, dtype)

    def to_records(ok, result):
        (lowered, compiled), d = result, ok["head_dim"]
        rec = dict(
            ok,
            tpu_custom_calls=lowered.as_text().count("tpu_custom_call"),
            attention_flops=attention_flops(shape.b, shape.hq, shape.s, shape.s, d, shape.causal, backward=True),
            **memory_stats(compiled),
            **cost(compiled),
        )
        log(
            f"  {ok['impl']} D={d} {ok['dtype']}: {rec['tpu_custom_calls']} Mosaic calls, "
            f"temp {rec['temp'] / 2**20:.1f} MiB"
        )
        return [rec]

    return compile_run.attention_table(cases, shape, LABEL.format(target=target), compile_case, to_records, log=log)


SEARCH_SHAPE = AttnShape(b=1, s=8192, hq=8, hkv=8)  # long enough for 2048-blocks to divide it
SEARCH_BLOCKS = (2048, 1024, 512, 256)


def search_cases(quick: bool):
    """``[(D, dtype name)]`` of the block-size search (``--quick``: one)."""
    return [(256, "fp32")] if quick else [(d, dt) for dt in ("bf16", "fp32") for d in (64, 128, 256)]


def block_search(chip_devs, cases, target: str, blocks=SEARCH_BLOCKS, log=print) -> list:
    """Per ``(D, dtype)`` and square block size: does our splash backend's causal forward+backward, with that block
    (``splash_attention(block=...)``), compile within the chip's scoped VMEM? ``status`` ok (with the compiled temp)
    or ``vmem_oom`` (the compiler's ``CompileTimeScopedVmemOom``). The compiler tells fit, not speed."""
    from jaxattn.attention import splash
    from jaxattn.attention.args import normalize

    shape = SEARCH_SHAPE
    records = []
    for d, dt in cases:
        for block in blocks:

            def loss(q, k, v, block=block):
                out = splash.splash_attention(q, k, v, normalize(q, k, v, causal=True), block=block)
                return out.astype(jnp.float32).sum()

            q, _, _ = shape.structs(d, DTYPES[dt])
            base = dict(head_dim=d, dtype=dt, block=block, S=shape.s, H=shape.hq, label=LABEL.format(target=target))
            t0 = time.perf_counter()
            try:
                with jax.default_matmul_precision("default"):  # see _fwd_bwd
                    _, compiled = tpu_target.compile(
                        jax.grad(loss, argnums=(0, 1, 2)), *tpu_target.place((q, q, q), chip_devs)
                    )
                rec = dict(base, status="ok", temp=memory_stats(compiled)["temp"])
            except Exception as e:
                oom = "ScopedVmemOom" in str(e)
                rec = dict(base, status="vmem_oom" if oom else "error", error=f"{type(e).__name__}: {str(e)[:300]}")
            rec["compile_s"] = round(time.perf_counter() - t0, 1)
            records.append(rec)
            log(f"  splash D={d} {dt} block {block}: {rec['status']} ({rec['compile_s']}s)")
    return records


def vmem_caps(records) -> dict:
    """``{(D, jnp dtype name): largest block that compiled}`` from :func:`block_search`'s records."""
    caps: dict = {}
    for r in records:
        if r["status"] == "ok":
            key = (r["head_dim"], jnp.dtype(DTYPES[r["dtype"]]).name)
            caps[key] = max(caps.get(key, 0), r["block"])
    return caps


def program_records(chip_devs, cases, target: str, hbm_bytes: int, log=print) -> list:
    """One record per dense :func:`.programs.program_cases` case: the program compiled with splash attention, its
    memory against the chip's ``hbm_bytes`` and XLA's cost analysis; ``does_not_fit`` where the compiler refuses it
    for memory."""

    def compile_program(case):
        preset, kind, batch, seq, overrides, loss, _ = case
        jitted, args, _ = build_program(chip_devs, preset, kind, batch, seq, overrides, loss)
        return tpu_target.compile(None, *args, jitted=jitted)

    def to_record(ok, result):
        lowered, compiled = result
        rec = dict(
            ok,
            tpu_custom_calls=lowered.as_text().count("tpu_custom_call"),
            **memory_stats(compiled),
            **cost(compiled),
        )
        rec["hbm_bytes"] = hbm_bytes
        rec["fits"] = rec["peak"] <= hbm_bytes
        return rec

    def declined(base, e):
        refused = tpu_target.refused_for_memory(e)
        if not refused:
            return None
        # the TPU compiler refuses a program that does not fit: a finding, not an error
        rec = dict(base, status="does_not_fit", fits=False, hbm_bytes=hbm_bytes)
        rec.update(required_temp_gib=refused[0], available_hbm_gib=refused[1])
        return rec

    def describe(rec):
        if rec["status"] == "does_not_fit":
            return f"does not fit ({rec['required_temp_gib']} GiB temp)"
        return (
            f"peak {rec['peak'] / 2**30:.2f} GiB "
            f"({'fits' if rec['fits'] else 'does not fit'} {hbm_bytes / 2**30:g} GiB), {rec['compile_s']}s"
        )

    # MoE cases: the grouped GEMM's TPU kernel (megablox) is not compiled here yet
    dense = [case for case in cases if case[-1] is None]
    label = LABEL.format(target=target)
    return compile_run.program_table(dense, label, "splash", compile_program, to_record, describe, declined, log)


def main(argv=None, prog: str = "python -m benchmarks compile") -> int:
    parser = compile_run.compile_parser(
        prog,
        __doc__,
        target=dict(choices=TARGETS, required=True, help="TPU generation (one chip of its host)"),
        quick="one splash shape and the tiny model (~20 s)",
        out="default benchmarks/results/local/<target>-compiled[-quick]",
        search="splash block-size search instead: which block sizes fit the chip's scoped VMEM (writes "
        "splash_blocks.json; jaxattn.attention.splash.VMEM_CAPS is checked against it)",
    )
    args = parser.parse_args(argv)
    out, t0 = compile_run.start(parser, args, tpu_target, "TPU")
    chip = tpu_target.CHIPS[args.target]
    devs = tpu_target.devices(args.target)[:1]
    info = compile_run.run_info(
        args.target,
        devs,
        out,
        topology=f"{chip.prefix}:{chip.host} (one chip)",
        hbm_bytes=chip.hbm_bytes,
        quick=args.quick,
        libtpu=tpu_target._version("libtpu"),
        label=LABEL.format(target=args.target),
    )
    if args.search:
        return _search_main(devs, args, info, out, t0)
    shape = GATE_SHAPE if args.quick else BENCH_SHAPE
    kernels = kernel_records(devs, kernel_cases(args.quick), shape, args.target)
    programs = (
        [] if args.skip_programs else program_records(devs, program_cases(args.quick), args.target, chip.hbm_bytes)
    )
    if not compile_run.stop(info, t0, kernels + programs):
        return 1
    compile_run.write_tables(out, info, {"tpu_kernels": kernels, "tpu_programs": programs})
    blocks = (read_results(out).get("splash_blocks") or {}).get("records")  # an earlier --search's, kept
    compile_run.write_report(out, info, compile_tables.tpu_report(kernels, programs, info, blocks))
    return 1 if any(r.get("status") not in ("ok", "does_not_fit", "skipped") for r in kernels + programs) else 0


def _search_main(devs, args, info, out, t0) -> int:
    records = block_search(devs, search_cases(args.quick), args.target)
    if not compile_run.stop(
        info, t0, records, lambda r: r["status"] == "ok", "no block size compiled; no result written"
    ):
        return 1
    write_results(out, "splash_blocks", records, info)
    found = read_results(out)
    if "tpu_kernels" in found:  # the directory's report gains the search's table
        write_text_atomic(os.path.join(out, "report.md"), compile_tables.tpu_dir_report(found))
    print("\n".join(compile_tables.splash_blocks_table(records, args.target)))
    print(f"wrote {out} in {info['wall_s']}s")
    return 1 if any(r["status"] == "error" for r in records) else 0
