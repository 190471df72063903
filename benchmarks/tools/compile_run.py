"""What both deviceless compiles (GPU: ``tools/compile.py``, TPU: ``tools/tpu_compile.py``) run around their
compiles: the command line, the loops over an attention table's and a program table's cases (a clean skip for an
absent peer, an error record for a failed compile), the run's description, its clock, its tables and its report.

    parser = compile_parser("python -m benchmarks compile", __doc__, target=dict(choices=TARGETS, required=True), ...)
    records = attention_table(cases, shape, label, compile_case, to_records)
    records = program_table(cases, label, "flash", compile_program, to_record, describe)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import measure
from ..report.records import write_results, write_text_atomic
from .deviceless import DTYPES, AttnShape
from .programs import attention_base, error_record, out_dir, program_base, skipped_record


def compile_parser(prog: str, doc: str, *, target: dict, quick: str, out: str, search: str) -> argparse.ArgumentParser:
    """The flags of a compile command: ``--target`` (``target``: its ``add_argument`` keywords), ``--quick``,
    ``--out``, ``--skip-programs`` and ``--search`` (``quick`` / ``out`` / ``search``: their help)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", **target)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", default=None, help=out)
    parser.add_argument("--skip-programs", action="store_true", help="kernels only")
    parser.add_argument("--search", action="store_true", help=search)
    return parser


def start(parser, args, target_module, platform: str) -> tuple[str, float]:
    """``(out, t0)``: the checked ``--out`` and the run's start; the parser's error where ``target_module``
    (``jaxattn.gpu_target`` / ``tpu_target``) cannot compile for a ``platform`` here."""
    reason = target_module.unavailable_reason()
    if reason is not None:
        parser.error(f"cannot compile for a {platform} here: {reason}")
    return out_dir(parser, args), time.perf_counter()


def run_info(target: str, devs, out: str, **fields) -> dict:
    """The run's ``env`` (``measure.env_info``) with the target, its device kind and ``fields``; says where it
    compiles to."""
    info = measure.env_info()
    info.update(target=target, target_device=devs[0].device_kind, **fields)
    print(f"compiling for {devs[0].device_kind} (deviceless) -> {out}", flush=True)
    return info


def _compiled(record) -> bool:
    return record.get("status") == "ok"


def stop(info: dict, t0: float, records, ok=_compiled, nothing: str = "nothing compiled; no result written") -> bool:
    """Stamps ``info["wall_s"]``; False (and says ``nothing`` on stderr) where no record is ``ok(record)`` (default:
    status ok)."""
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    if any(ok(r) for r in records):
        return True
    print(nothing, file=sys.stderr)
    return False


def write_tables(out: str, info: dict, tables: dict) -> None:
    """Writes each table of ``tables`` (``{name: records}``) that has records, with the run's ``info``."""
    for name, records in tables.items():
        if records:
            write_results(out, name, records, info)


def write_report(out: str, info: dict, report: str) -> None:
    """Writes ``report.md`` and prints it; says where the run wrote."""
    write_text_atomic(os.path.join(out, "report.md"), report)
    print(report)
    print(f"wrote {out} in {info['wall_s']}s")


def attention_table(cases, shape: AttnShape, label: str, compile_case, to_records, what=None, log=print) -> list:
    """The records of an attention table, per ``(impl, D, dtype name)`` of ``cases``: :func:`.programs.skipped_record`
    where the peer is absent, an error record where ``compile_case(impl, D, dtype)`` raises (logged as ``what``,
    formatted with ``impl``, ``d`` and ``dt``; default ``"{impl} D={d} {dt}"``), else the list
    ``to_records(ok, compile_case's result)`` (``ok``: :func:`.programs.attention_base`'s keys, status ok and the
    compile seconds)."""
    records = []
    for impl, d, dt in cases:
        base = attention_base(impl, d, dt, shape, label)
        skip = skipped_record(base, log)
        if skip is not None:
            records.append(skip)
            continue
        t0 = time.perf_counter()
        try:
            result = compile_case(impl, d, DTYPES[dt])
        except Exception as e:  # one failed compile is a record, not the end of the run
            records.append(error_record(base, e, (what or "{impl} D={d} {dt}").format(impl=impl, d=d, dt=dt), log))
            continue
        records.extend(to_records(dict(base, status="ok", compile_s=round(time.perf_counter() - t0, 1)), result))
    return records


def program_table(cases, label: str, attention: str, compile_program, to_record, describe, declined=None, log=print):
    """The records of a program table, per case of :func:`.programs.program_cases`, compiled with ``attention``:
    ``to_record(ok, compile_program(case)'s result)`` (``ok``: :func:`.programs.program_base`'s keys, status ok and
    the compile seconds), else ``declined(base, exception)`` where that is a record (a finding, not a failure),
    else an error record. Each record is logged with ``describe(record)``."""
    from jaxattn.attention import attention_backend

    records = []
    for case in cases:
        preset, kind, batch, seq, overrides, loss, gemm = case
        t0 = time.perf_counter()
        base = program_base(preset, kind, batch, seq, overrides, loss, attention, label, gemm)
        try:
            with attention_backend(attention):
                result = compile_program(case)
            rec = to_record(dict(base, status="ok", compile_s=round(time.perf_counter() - t0, 1)), result)
        except Exception as e:
            rec = declined(base, e) if declined is not None else None
            if rec is None:
                records.append(error_record(base, e, f"{preset} {kind} {loss}", log))
                continue
        records.append(rec)
        log(f"  {preset} {kind} B={batch} S={seq} {base['loss'] or ''}: {describe(rec)}")
    return records
