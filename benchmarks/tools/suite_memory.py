"""Do the model and train suites' rows fit one H100? Their JAX programs compiled for the target without a GPU
(deviceless, ``jaxattn.gpu_target``) and XLA's compiled memory read back, beside the device's memory.

    python -m benchmarks.tools.suite_memory --out benchmarks/results/h100-compiled   # every non-quick row
    python -m benchmarks.tools.suite_memory --quick                                  # tiny rows, a CI check

The programs are the suites' own (``suites.model.jax_passes``, ``suites.train.jax_program``) at the suites' shapes,
with abstract inputs. A row's JAX side fits when its compiled total (arguments + outputs + temporaries - aliased)
is at most :data:`USABLE` of the device's memory. torch has no such analysis; its estimate is JAX's total times the
torch / JAX peak ratio of the one row measured on both sides on a GPU (:func:`torch_ratio`: model 125m
fwd_bwd, read from ``benchmarks/results/nvidia-h100-80gb-hbm3/model.json``). Both suites time JAX and torch as a
pair, both frameworks' programs and state alive at once (and JAX's allocator keeps what it grew), so a row that
runs must fit both together (``fits_both``); a row that does not is recorded as an out-of-memory skip on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..report.compile_tables import suite_memory_table as table
from ..report.records import check_out_dir, write_results
from .deviceless import target_config

USABLE = 0.9  # of the device's memory: the CUDA context, cuBLAS/cuDNN workspaces and torch's share take the rest
DEVICE_BYTES = {"h100": 80 * 10**9, "h200": 141 * 10**9}  # the targets' HBM (the descriptions in benchmarks/targets/)


def _compile(devs, jitted, args, backend=None) -> dict:
    import contextlib

    from jaxattn import gpu_target

    from .programs import memory_stats

    with backend() if backend else contextlib.nullcontext():
        _, compiled = gpu_target.compile(jitted, *gpu_target.place(args, devs), jitted=jitted)
    return memory_stats(compiled)


def model_rows(devs, quick: bool, log=print) -> list[dict]:
    """The model suite's fwd and fwd_bwd programs per preset (fp32 weights, as the suite runs them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.model import Llama
    from torchref.config import ModelConfig as TConfig

    from ..suites import model
    from ..twins import jax_config

    rows = []
    for preset, b, s in model.shapes(quick):
        cfg = jax_config(TConfig.preset(preset))
        abstract = nnx.eval_shape(lambda cfg=cfg: Llama(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        params, rest = nnx.split(abstract, nnx.Param, ...)[1:]
        passes = model.jax_passes(graphdef)
        args = {
            "fwd": (state, jax.ShapeDtypeStruct((b, s), jnp.int32)),
            "fwd_bwd": (params, rest, jax.ShapeDtypeStruct((b, s), jnp.int32)),
        }
        for name, fn in passes.items():
            rows.append(_row(devs, "model", {"preset": preset, "B": b, "S": s, "pass": name}, fn, args[name], log=log))
    return rows


def train_rows(devs, quick: bool, toggles=None, log=print) -> list[dict]:
    """The train suite's JAX step per toggle (``torch_compile`` has no JAX row: JAX's step is always jitted)."""
    from ..suites import train

    rows = []
    for toggle in toggles or [t for t in train.TOGGLES if t != "torch_compile"]:
        jitted, args, backend, preset = train.jax_program(toggle, quick)
        b, s1 = args[1]["tokens"].shape
        base = {"preset": preset, "toggle": toggle, "B": b, "S": s1 - 1}
        rows.append(_row(devs, "train", base, jitted, args, backend=backend, log=log))
    return rows


def _row(devs, suite, base, jitted, args, backend=None, log=print) -> dict:
    import jax

    t0 = time.perf_counter()
    rec = {"suite": suite, **base, "framework": "jax", "impl": "jaxattn"}
    try:
        mem = _compile(devs, jitted, args, backend)
    except Exception as e:  # noqa: BLE001 - a program that does not compile for the target is a record
        rec.update(status="error", reason=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
        log(f"  {base}: error {rec['reason']}")
        return rec
    finally:
        jax.clear_caches()
    rec.update(status="ok", memory=mem, compile_s=round(time.perf_counter() - t0, 1))
    log(f"  {suite} {base}: {mem['peak'] / 2**30:.2f} GiB ({rec['compile_s']} s to compile)")
    return rec


MEASURED = Path(__file__).resolve().parent.parent / "results" / "nvidia-h100-80gb-hbm3" / "model.json"


def torch_ratio(path: Path = MEASURED) -> float | None:
    """torch's peak over JAX's on the one model-suite row both measured on a GPU (fwd_bwd of the first preset
    with both peaks), or None without such a record."""
    import json

    if not path.exists():
        return None
    recs = [
        r for r in json.loads(path.read_text())["records"] if r.get("pass") == "fwd_bwd" and r.get("peak_mem_bytes")
    ]
    by = {}
    for r in recs:
        by.setdefault(r["preset"], {})[r["framework"]] = r["peak_mem_bytes"]
    both = [v for v in by.values() if {"jax", "torch"} <= set(v)]
    return both[0]["torch"] / both[0]["jax"] if both else None


def judge(rows: list[dict], device_bytes: int, ratio: float | None = None) -> list[dict]:
    """Adds the limit, ``fits`` (JAX's compiled total <= USABLE x the device's bytes) and, given torch's
    ``ratio``, ``torch_estimate_bytes`` and ``fits_both`` (JAX and torch in one process) to every measured row."""
    for r in rows:
        if r.get("status") == "ok":
            r["device_bytes"] = device_bytes
            r["fits"] = r["memory"]["peak"] <= USABLE * device_bytes
            if ratio is not None:
                r["torch_estimate_bytes"] = int(ratio * r["memory"]["peak"])
                r["fits_both"] = r["memory"]["peak"] + r["torch_estimate_bytes"] <= USABLE * device_bytes
    return rows


def write_markdown(out: str, rows: list[dict], info: dict) -> str:
    """``<out>/suite_memory.md``: the table of :func:`table` under a line saying what it is."""
    import os

    from ..report.records import write_text_atomic

    text = (
        f"# Do the model and train suites' rows fit one {info.get('target', 'h100').upper()}? "
        f"({info.get('label', 'compiled, not run')})\n\n"
        "`python -m benchmarks.tools.suite_memory --out DIR`: each row's JAX program compiled for the target without "
        f"a GPU (jax {info.get('jax')}); fits = XLA's compiled total <= {USABLE:.0%} of the device's memory; torch "
        "estimate = that total times torch's / JAX's peak on the one row measured on both (model 125m fwd_bwd, "
        "one H100). Both suites time the two frameworks as a pair in one process: a row runs only if it fits both."
        "\n\n" + table(rows) + "\n"
    )
    return write_text_atomic(os.path.join(out, "suite_memory.md"), text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.suite_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", choices=tuple(DEVICE_BYTES), default="h100")
    p.add_argument("--quick", action="store_true", help="the suites' --quick rows (tiny models)")
    p.add_argument("--suite", choices=("model", "train"), action="append", help="default: both")
    p.add_argument("--out", default=None, help="write DIR/suite_memory.json")
    args = p.parse_args(argv)
    try:
        out = check_out_dir(args.out) if args.out else None
    except ValueError as e:
        p.error(str(e))
    from jaxattn import gpu_target

    from .. import measure

    why = gpu_target.unavailable_reason()
    if why:
        print(f"suite_memory: cannot compile for a GPU here: {why}", file=sys.stderr)
        return 2
    devs = gpu_target.devices(target_config(args.target))
    rows = []
    for suite in args.suite or ("model", "train"):
        rows += (model_rows if suite == "model" else train_rows)(devs, args.quick)
    rows = judge(rows, DEVICE_BYTES[args.target], torch_ratio())
    print(table(rows))
    if out:
        info = dict(measure.env_info(), target=args.target, label=f"compiled for {args.target.upper()}, not run")
        print(f"wrote {write_results(out, 'suite_memory', rows, info)}")
        print(f"wrote {write_markdown(out, rows, info)}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
