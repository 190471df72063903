"""The ``compile`` suite: what ``python -m benchmarks compile`` measures, as one record list of a run.

    records = run(quick=True)   # kernel, MoE grouped-GEMM, then program records ("compiled for H100, not run")

The measurements are the compile tool's (``benchmarks/tools/compile.py``), its report.md section the tool's
tables (``benchmarks/report/compile_tables.py``); without the gpu-compile extra every record is skipped.
"""

from __future__ import annotations

from jaxattn import gpu_target

from ..report.compile_tables import LABEL
from ..tools import compile as tc
from ..tools.deviceless import BENCH_SHAPE, GATE_SHAPE, target_config
from ..tools.grouped_compile import grouped_records


def run(quick: bool = False, target: str = "h100", log=print) -> list:
    """The ``compile`` suite of ``python -m benchmarks run``: what ``python -m benchmarks compile`` measures
    (``--quick``: its quick kernels at the small gate shape and the tiny programs), as one record list: kernel
    records (``part`` "kernel": registers, spills, shared memory, ...), the MoE grouped GEMM's (``part``
    "grouped_gemm": ours beside ``ragged_dot``) then program records (``part``
    "program": compiled memory and FLOPs of the forward and the train step), each labelled "compiled for
    H100, not run". Without the gpu-compile extra every record is ``skipped`` with the reason (``all`` then
    skips the suite with a note)."""
    kcases, pcases = tc.kernel_cases(quick), tc.program_cases(quick)
    label = LABEL.format(target=target.upper())
    reason = gpu_target.unavailable_reason()
    if reason is not None:

        def skipped(part: str, impl: str, **keys) -> dict:
            return dict(part=part, framework="jax", impl=impl, **keys, label=label, status="skipped", reason=reason)

        return [skipped("kernel", impl, head_dim=d, dtype=dt) for impl, d, dt in kcases] + [
            skipped("program", kind, preset=preset, kind=kind) for preset, kind, *_ in pcases
        ]
    devs = gpu_target.devices(target_config(target))
    kernels = tc.kernel_records(devs, kcases, GATE_SHAPE if quick else BENCH_SHAPE, target, log=log)
    grouped = grouped_records(devs, quick, target, label, log=log)
    programs = tc.program_records(devs, pcases, target, log=log)
    return (
        [dict(r, part="kernel", framework="jax") for r in kernels]
        + [dict(r, part="grouped_gemm", framework="jax") for r in grouped]
        + [dict(r, part="program", framework="jax", impl=r["kind"]) for r in programs]
    )
