"""The MoE grouped GEMM compiled for an H100 without a GPU: our Pallas kernel (``jaxattn.grouped_matmul``) beside
``jax.lax.ragged_dot`` at one Mixtral-8x7B expert projection, forward and forward+backward: what each lowers to
(Triton calls, XLA dots and their largest operand, compiled temp memory, XLA's FLOPs against the grouped FLOPs) and
our kernels' resources (registers, spills, shared memory, wgmma), the evidence behind ``grouped_gemm("auto")``.

    records = grouped_records(devs, quick=False)   # python -m benchmarks compile writes them to grouped_gemm.json
"""

from __future__ import annotations

import math
import re
import tempfile
import time

import jax
import jax.numpy as jnp

from jaxattn import gpu_target

from . import kernel_stats
from .programs import cost_stats, error_record, memory_stats

# One Mixtral-8x7B expert up-projection (8 experts, 4096 tokens x top-2 = 8192 routed rows, 4096 -> 14336), and a
# small shape for --quick.
MIXTRAL = dict(g=8, m=8192, k=4096, n=14336)
QUICK = dict(g=4, m=512, k=256, n=512)
IMPLS = ("pallas", "ragged_dot")  # ours (jaxattn.grouped_matmul), XLA's
KERNELS = ("grouped_matmul", "grouped_matmul_t", "grouped_matmul_tgmm")  # out, d_lhs, d_rhs
TRITON = "__gpu$xla.gpu.triton"
_DOT_OPERAND = re.compile(r"(?:bf16|f16|f32)\[([\d,]+)\]\{[\d,]*\} parameter")


def compile_grouped(devs, impl: str, shape: dict, *, backward: bool, dump: str | None = None):
    """``(lowered, compiled)`` of ``impl``'s grouped GEMM at ``shape`` (bf16, rows grouped by a runtime ``[G]``
    size vector) for ``devs``: the forward, or forward + backward (``jax.vjp`` with the cotangent as an input)."""
    from jaxattn import grouped_matmul as gm

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    g, m, k, n = (shape[x] for x in "gmkn")
    sds = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
    )
    mm = gm.grouped_matmul if impl == "pallas" else jax.lax.ragged_dot

    def fwd(a, w, sizes):
        return mm(a, w, sizes)

    def fwd_bwd(a, w, sizes, ct):
        out, pull = jax.vjp(lambda a, w: mm(a, w, sizes), a, w)
        return out, pull(ct)

    args = gpu_target.place(sds if backward else sds[:3], devs)
    opts = {"xla_dump_to": dump} if dump else None
    return gpu_target.compile(fwd_bwd if backward else fwd, *args, compiler_options=opts)


def lowering(compiled) -> dict:
    """What a compiled grouped GEMM became: Triton calls, XLA dots, and the dots' operand shapes (the parameters of
    XLA's GEMM fusions: a dense ``[M, G*K]`` one is ragged_dot's expansion over every expert)."""
    text = compiled.as_text()
    gemm_fusions = "\n".join(c for c in text.split("\n\n") if re.search(r"\bdot\(", c))
    operands = sorted({tuple(int(d) for d in s.split(",")) for s in _DOT_OPERAND.findall(gemm_fusions)})
    largest = max(operands, key=lambda o: (math.prod(o), o), default=None)
    return dict(
        triton_calls=text.count(f'custom_call_target="{TRITON}"'),
        xla_dots=len(re.findall(r"\bdot\(", text)),
        dot_operands=[list(o) for o in operands],
        largest_dot_operand=list(largest) if largest else None,
    )


def grouped_flops(shape: dict, backward: bool) -> float:
    """The grouped GEMM's own FLOPs: 2·M·K·N forward (each row through its one expert); the backward's d_lhs and
    d_rhs as much again each."""
    f = 2.0 * shape["m"] * shape["k"] * shape["n"]
    return 3 * f if backward else f


def grouped_records(devs, quick: bool, target: str, label: str, log=print) -> list:
    """One ``what="lowering"`` record per (impl, forward | forward+backward) and, from the compile of our
    forward+backward, one ``what="kernel"`` record per Pallas kernel (:data:`KERNELS`), each labelled ``label``."""
    shape = QUICK if quick else MIXTRAL
    base = dict(dtype="bf16", label=label, **{x.upper(): v for x, v in shape.items()})
    records = []
    for impl in IMPLS:
        for backward in (False, True):
            what = dict(base, what="lowering", impl=impl, **{"pass": "fwd_bwd" if backward else "fwd"})
            t0 = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory() as dump:
                    _, compiled = compile_grouped(devs, impl, shape, backward=backward, dump=dump)
                    launches = kernel_stats.xla_launches(dump)
                    kernels = kernel_stats.from_xla_dump(dump, names=KERNELS) if impl == "pallas" and backward else {}
            except Exception as e:  # one failed compile is a record, not the end of the run
                records.append(error_record(what, e, f"grouped GEMM {impl} {what['pass']}", log))
                continue
            secs = round(time.perf_counter() - t0, 1)
            rec = dict(
                what,
                status="ok",
                compile_s=secs,
                launches=len(launches),
                grouped_flops=grouped_flops(shape, backward),
                **lowering(compiled),
                **memory_stats(compiled),
                **cost_stats(compiled),
            )
            records.append(rec)
            records += [
                dict(base, what="kernel", impl=impl, status="ok", compile_s=secs, **k) for k in kernels.values()
            ]
            log(
                f"  grouped GEMM {impl} {rec['pass']}: {rec['triton_calls']} Triton calls, {rec['xla_dots']} XLA dots, "
                f"temp {rec['temp'] / 2**20:.2f} MiB, {secs}s"
            )
    return records
