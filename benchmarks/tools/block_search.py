"""Block-size search for the ``flash`` (Triton) and ``mosaic`` (Mosaic GPU) kernels: a deviceless resource
filter, then (on a GPU) timings.

    python -m benchmarks compile --search [--quick]        # filter every (kernel, D, dtype); time if a GPU is here
    python -m benchmarks.tools.block_search --kernel mosaic_bwd_dq --d 128 --dtype bf16

A candidate ``BlockSizes`` / ``MosaicBlockSizes`` of one kernel, compiled ALONE for the target, passes when it
spills nothing, fits the SM and (bf16/fp16) uses wgmma only; on a GPU every survivor is then timed (details:
benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxattn import gpu_target  # noqa: E402
from jaxattn.attention import flash, mosaic  # noqa: E402
from twincore.timing import paired_ratio, time_interleaved  # noqa: E402

from .. import measure  # noqa: E402
from ..report.records import read_results, write_results, write_text_atomic  # noqa: E402
from ..report.tables import format_ratio  # noqa: E402
from . import kernel_stats  # noqa: E402
from .deviceless import DTYPES, AttnShape, target_config  # noqa: E402
from .kernel_stats import H100_LIMITS  # noqa: E402

FLASH_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv")
MOSAIC_KERNELS = ("mosaic_fwd", "mosaic_bwd_dq", "mosaic_bwd_dkv")
KERNELS = FLASH_KERNELS + MOSAIC_KERNELS
# The block-size fields each kernel reads (its tile and its launch knobs); the Mosaic backward's live in
# ``MosaicBlockSizes.backward``, whose ring depth both backward kernels share.
FIELDS = {
    "flash_fwd": ("block_q", "block_k", "num_warps", "num_stages"),
    "flash_bwd_dq": ("block_q_dq", "block_k_dq", "num_warps_bwd", "num_stages_bwd"),
    "flash_bwd_dkv": ("block_q_dkv", "block_k_dkv", "num_warps_dkv", "num_stages_dkv"),
    "mosaic_fwd": ("block_q", "block_kv", "max_concurrent_steps", "overlap"),
    "mosaic_bwd_dq": ("block_q_dq", "block_kv_dq", "max_concurrent_steps"),
    "mosaic_bwd_dkv": ("block_kv_dkv", "block_q_dkv", "max_concurrent_steps"),
}


def group_key(row: dict) -> tuple:
    """A row's search group: (kernel, D, dtype, kv heads); rows written before GQA shapes were searched are the
    default shape's (:class:`AttnShape`'s 16 / 16 heads)."""
    return (row["kernel"], row["head_dim"], row["dtype"], row.get("kv_heads", AttnShape().hkv))


def _is_mosaic(kernel: str) -> bool:
    return kernel in MOSAIC_KERNELS


def _default(kernel: str, d: int, dtype):
    """The block sizes a call gets when it passes none."""
    return mosaic.MosaicBlockSizes.default(d) if _is_mosaic(kernel) else flash.BlockSizes.default(d, dtype)


def to_time(row: dict) -> bool:
    """Whether a GPU times this row: it passed the filter, or it is the default tile (the baseline to beat, timed
    even where it spills a little)."""
    return row["passed"] or (row.get("default", False) and row.get("registers") is not None)


def searchable(kernel: str, d: int, dtype) -> bool:
    """Whether ``kernel`` exists at (D, ``dtype``: a name of ``DTYPES`` or a jnp dtype): Mosaic GPU takes bf16 /
    fp16 only, and has its own backward at ``mosaic.BACKWARD_HEAD_DIMS`` only (D=256: the flash kernels)."""
    if not _is_mosaic(kernel):
        return True
    dtype = jnp.dtype(DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    return dtype in mosaic.DTYPES and (kernel == "mosaic_fwd" or d in mosaic.BACKWARD_HEAD_DIMS)


def _kernels(bs, d: int, dtype, shape: AttnShape):
    """The kernels' block-search hook at ``shape`` (``flash.kernel_callables`` / ``mosaic.kernel_callables``):
    each kernel runnable alone on operands padded to ``sq_pad`` / ``sk_pad`` / ``head_dim_pad``."""
    q, k, _ = shape.structs(d, dtype)
    family = mosaic if isinstance(bs, mosaic.MosaicBlockSizes) else flash
    return family.kernel_callables(q, k, bs, causal=shape.causal)


def block_sizes_of(row: dict):
    """The ``BlockSizes`` / ``MosaicBlockSizes`` a search row was compiled with (its ``block_sizes`` dict)."""
    if not _is_mosaic(row["kernel"]):
        return flash.BlockSizes(**row["block_sizes"])
    fields = dict(row["block_sizes"])
    bwd = fields.pop("backward", None)
    return mosaic.MosaicBlockSizes(**fields, backward=None if bwd is None else mosaic.MosaicBackwardBlockSizes(**bwd))


def _knobs(bs, kernel: str, d: int) -> dict:
    """The values of the fields ``kernel`` reads (None-valued launch knobs resolved as the kernel sees them)."""
    if _is_mosaic(kernel):
        sizes = bs if kernel == "mosaic_fwd" else bs.backward or mosaic.MosaicBackwardBlockSizes()
        return {f: getattr(sizes, f) for f in FIELDS[kernel]}
    cfg = _kernels(bs, d, jnp.bfloat16, AttnShape(s=4096))
    warps, stages = cfg.launch(kernel)
    a, b = FIELDS[kernel][:2]
    return {a: getattr(bs, a), b: getattr(bs, b), "num_warps": warps, "num_stages": stages}


def _operand_shapes(cfg, shape: AttnShape, kernel: str) -> tuple:
    """(q, k, v[, do, lse, delta]) shapes ``kernel`` takes (padded): a forward takes the first three."""
    q = (shape.b, cfg.sq_pad, shape.hq, cfg.head_dim_pad)
    kv = (shape.b, cfg.sk_pad, shape.hkv, cfg.head_dim_pad)
    row = (shape.b, shape.hq, cfg.sq_pad)
    return (q, kv, kv) if kernel.endswith("_fwd") else (q, kv, kv, q, row, row)


def compile_kernel(
    devs, kernel: str, d: int, dtype, bs, shape: AttnShape = AttnShape(), workdir: str | None = None
) -> dict:
    """Compile ``kernel`` alone with ``bs`` (a ``flash.BlockSizes`` or ``mosaic.MosaicBlockSizes``) for the
    deviceless target ``devs``; its :mod:`kernel_stats` record (registers, spills, smem, occupancy, SASS counts)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    cfg = _kernels(bs, d, dtype, shape)
    fn = cfg.calls[kernel]
    args = tuple(
        jax.ShapeDtypeStruct(s, dtype if len(s) == 4 else jnp.float32) for s in _operand_shapes(cfg, shape, kernel)
    )
    if _is_mosaic(kernel):
        thunk = lambda: gpu_target.compile(fn, *gpu_target.place(args, devs))  # noqa: E731
        return kernel_stats.mosaic_records(thunk, (kernel,), workdir)[kernel]
    with tempfile.TemporaryDirectory(dir=workdir) as dump:
        gpu_target.compile(fn, *gpu_target.place(args, devs), compiler_options={"xla_dump_to": dump})
        recs = kernel_stats.from_xla_dump(dump, names=(kernel,))
    if kernel not in recs:
        raise RuntimeError(f"{kernel} not found in the compiled program")
    return recs[kernel]


# ------------------------------------------------------------------------------------------------ candidates
def candidates(kernel: str, d: int, dtype, quick: bool = False) -> list:
    """Candidate :class:`BlockSizes` for one kernel, varying only the fields it reads (the others keep the
    defaults).  The M dimension of every dot (fwd ``block_q``, dq ``block_q_dq``, dkv ``block_k_dkv``) is >= 64
    for bf16/fp16, wgmma's minimum; fp32 (TF32 passes) tries M in 32/64, N in 16/32/64, 8 warps, 1-2 stages.
    ``quick``: a handful (2 tiles x 2 warp counts), for CI.  Mosaic kernels: :func:`mosaic_candidates`."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if _is_mosaic(kernel):
        return mosaic_candidates(kernel, d, dtype, quick)
    wide = jnp.dtype(dtype).itemsize >= 4
    if wide:  # fp32 tiles are twice the bytes and the TF32x3 split doubles the live operands: at 4 warps every
        # tile spilled more than at 8 (first full pass, NOTES.md), and a 16-wide N often removes the spill
        ms, ns, warps, stages = (32, 64), (16, 32, 64), (8,), (1, 2)
        if d > 128:  # D=256: every M >= 32 spilled KBs or overflowed shared memory (first pass); 16 did not
            ms, ns = (16, 32), (16, 32)
    else:
        ns = {"flash_fwd": (32, 64, 128), "flash_bwd_dq": (32, 64), "flash_bwd_dkv": (16, 32, 64)}[kernel]
        ms, warps, stages = (64, 128), (4, 8), (2, 3)
    if quick:
        ms, ns, warps, stages = ms[-2:], ns[-1:], (4, 8), stages[-1:]
    m_field, n_field, w_field, s_field = FIELDS[kernel]
    if kernel == "flash_bwd_dkv":  # block_k_dkv is M; the query block streams (N of k q^T, K of dv/dk)
        n_field, m_field = m_field, n_field
    base = flash.BlockSizes.default(d, dtype)
    out = []
    for m, n, w, s in itertools.product(ms, ns, warps, stages):
        out.append(dataclasses.replace(base, **{m_field: m, n_field: n, w_field: w, s_field: s}))
    return list(dict.fromkeys(out))


def mosaic_candidates(kernel: str, d: int, dtype, quick: bool = False) -> list[mosaic.MosaicBlockSizes]:
    """Candidate :class:`MosaicBlockSizes` for one Mosaic kernel: its M tile (rows per consumer warpgroup) in
    64 / 128, its streamed block in 64 / 128 (the forward's keys also 192, FA3's N for D=128 being 176 / 128),
    a ring of 2 or 3 slots, and the forward with and without FA3's intra-warpgroup ``overlap``; the other fields
    keep the defaults (FA3's Hopper tiles).  A candidate over the shared memory is a rejected row (its ValueError).
    ``quick``: the largest streamed block, 2 slots (the forward: both ``overlap`` settings)."""
    if not searchable(kernel, d, dtype):
        raise ValueError(f"{kernel} has no kernel at D={d} {jnp.dtype(dtype).name} (bf16 / fp16; see searchable)")
    ms, ns, slots = (64, 128), (64, 128, 192) if kernel == "mosaic_fwd" else (64, 128), (2, 3)
    if quick:
        ms, ns, slots = (64,), ns[-1:], (2,)
    m_field, n_field, s_field = FIELDS[kernel][:3]
    base = mosaic.MosaicBlockSizes.default(d)
    out = []
    for m, n, s in itertools.product(ms, ns, slots):
        tile = {m_field: m, n_field: n, s_field: s}
        if kernel == "mosaic_fwd":
            out += [dataclasses.replace(base, **tile, overlap=o) for o in (False, True)]
        else:
            out.append(dataclasses.replace(base, backward=mosaic.MosaicBackwardBlockSizes(**tile)))
    return out


def verdict(rec: dict, dtype) -> str | None:
    """None when a compiled kernel passes the resource filter, else why not."""
    if rec.get("spill_stores") or rec.get("spill_loads"):
        return f"spills {rec['spill_stores']}/{rec['spill_loads']} B"
    if rec.get("wgmma_serialized"):
        return f"ptxas serializes its wgmma ({rec['wgmma_serialized'][:80]})"
    if rec.get("registers") is None or rec["registers"] > H100_LIMITS["max_regs_per_thread"]:
        return f"registers {rec.get('registers')}"
    if not rec.get("fits") or rec.get("blocks_per_sm", 0) < 1:
        return f"does not fit an SM ({rec.get('limited_by')})"
    if rec["smem_bytes"] > H100_LIMITS["smem_per_block"]:
        return f"shared memory {rec['smem_bytes']} B"
    sass = rec.get("sass")
    if jnp.dtype(dtype).itemsize < 4 and sass is not None and (sass["HMMA"] or not sass["HGMMA"]):
        return f"not wgmma-only (HGMMA {sass['HGMMA']}, HMMA {sass['HMMA']})"
    return None


def rank_key(row: dict):
    """Order of the survivors when no GPU has timed them: the largest tile (arithmetic intensity per loaded
    byte), then occupancy, then more pipeline stages, then fewer registers.  A placeholder for a timing."""
    k = row["knobs"]
    tile = [v for f, v in k.items() if f.startswith("block")]
    stages = k["max_concurrent_steps"] if "max_concurrent_steps" in k else k["num_stages"]
    return (-(tile[0] * tile[1]), -row["occupancy"], -stages, row["registers"])


def filter_kernel(
    devs, kernel: str, d: int, dtype, cands: Sequence, shape: AttnShape = AttnShape(), log=print
) -> list[dict]:
    """Compile every candidate of one kernel; rows ``{knobs, block_sizes, default, registers, spills, smem,
    occupancy, sass, verdict}`` (``default``: the kernel's default tile), passing rows first in :func:`rank_key`
    order."""
    rows = []
    for bs in cands:
        row = {
            "kernel": kernel,
            "head_dim": d,
            "dtype": jnp.dtype(dtype).name,
            "knobs": _knobs(bs, kernel, d),
            "block_sizes": dataclasses.asdict(bs),
            "q_heads": shape.hq,
            "kv_heads": shape.hkv,
        }
        row["default"] = row["knobs"] == _knobs(_default(kernel, d, dtype), kernel, d)
        t0 = time.perf_counter()
        try:
            rec = compile_kernel(devs, kernel, d, dtype, bs, shape)
        except Exception as e:  # a candidate that does not compile (or fit) is a rejected row, not the end
            row.update(verdict=f"compile error: {type(e).__name__}: {str(e)[:200]}", passed=False)
            rows.append(row)
            log(f"    {row['knobs']}: {row['verdict'][:120]}")
            continue
        why = verdict(rec, dtype)
        row.update(
            {
                k: rec.get(k)
                for k in (
                    "registers",
                    "spill_stores",
                    "spill_loads",
                    "smem_bytes",
                    "threads",
                    "blocks_per_sm",
                    "occupancy",
                    "limited_by",
                    "sass",
                    "wgmma_serialized",
                )
            },
            verdict=why or "pass",
            passed=why is None,
            compile_s=round(time.perf_counter() - t0, 1),
        )
        rows.append(row)
        log(
            f"    {row['knobs']}: regs {rec['registers']} spill {rec['spill_stores']}/{rec['spill_loads']} "
            f"smem {rec['smem_bytes']} occ {rec.get('occupancy', 0):.3f} -> {row['verdict']}"
        )
    passed = sorted((r for r in rows if r["passed"]), key=rank_key)
    return passed + [r for r in rows if not r["passed"]]


# ------------------------------------------------------------------------------------------------ timing
def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _timed_call(row: dict, shape: AttnShape):
    """A zero-argument call of ``row``'s kernel alone, jitted, on random inputs of ``shape`` (a backward kernel gets
    the LSE of its family's forward on those inputs and a random delta)."""
    kernel, dtype = row["kernel"], jnp.dtype(row["dtype"])
    cfg = _kernels(block_sizes_of(row), row["head_dim"], dtype, shape)
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    q_shape, kv_shape = _operand_shapes(cfg, shape, kernel)[:2]
    q = jax.random.normal(key[0], q_shape, dtype)
    kv = jax.random.normal(key[1], kv_shape, dtype)
    args = (q, kv, kv)
    if not kernel.endswith("_fwd"):
        _, lse = cfg.calls[(MOSAIC_KERNELS if _is_mosaic(kernel) else FLASH_KERNELS)[0]](q, kv, kv)
        delta = jax.random.normal(key[2], lse.shape, jnp.float32)
        args += (jax.random.normal(key[3], q.shape, dtype), lse, delta)
    fn = jax.jit(cfg.calls[kernel])
    return lambda: fn(*args)


def is_default(row: dict) -> bool:
    """Whether ``row`` is the tile a call gets when it passes no block sizes (by the knobs its kernel reads, so a
    row written before rows carried ``default`` is recognised too)."""
    if row.get("default"):
        return True
    kernel, d = row["kernel"], row["head_dim"]
    return row["knobs"] == _knobs(_default(kernel, d, jnp.dtype(row["dtype"])), kernel, d)


def pair_best_with_default(rows: list[dict], call_of, rounds: int = 10, sync=measure.sync) -> dict | None:
    """The fastest timed row against the default tile of the same (kernel, D, dtype), timed again alternately
    (``twincore.timing.time_interleaved``: the order reversed every other round): its speed-up over the default
    (``paired_ratio`` of default / best per round, with its interval and ``unstable``), stored on the fastest row as
    ``vs_default`` and returned. None when nothing was timed, the default was not, or the default is the fastest.
    ``call_of(row)`` gives a row's zero-argument call (on a GPU :func:`_timed_call`)."""
    timed = [r for r in rows if "time" in r]
    default = next((r for r in timed if is_default(r)), None)
    if default is None:
        return None
    best = min(timed, key=lambda r: r["time"]["median_s"])
    if best is default:
        return None
    t = time_interleaved({"best": call_of(best), "default": call_of(default)}, rounds=rounds, sync=sync)
    best["vs_default"] = dict(
        paired_ratio(t["default"]["rounds"], t["best"]["rounds"], cv=(t["best"]["cv"], t["default"]["cv"])),
        default_knobs=default["knobs"],
    )
    return best["vs_default"]


def time_rows(rows: list[dict], shape: AttnShape = AttnShape(), iters: int = 20, on_row=None) -> list[dict]:
    """On a GPU: the median time of each :func:`to_time` row's kernel alone (``measure.timeit``, random inputs of
    ``shape``), and its rank; then, per (kernel, D, dtype), the fastest against the default, paired
    (:func:`pair_best_with_default`); ``on_row(row)`` after each timed row (e.g. an incremental write).  Without a
    GPU, returns ``rows`` unchanged (the caller says so)."""
    if not has_gpu():
        return rows
    calls = {}
    for row in rows:
        if not to_time(row):
            continue
        calls[id(row)] = _timed_call(row, shape)
        try:
            row["time"] = measure.timeit(calls[id(row)], iters=iters)
        except Exception as e:  # pragma: no cover - GPU only
            row["time_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if on_row is not None:
            on_row(row)
    timed = sorted((r for r in rows if "time" in r), key=lambda r: r["time"]["median_s"])
    for i, r in enumerate(timed):
        r["time_rank"] = i
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_key(r), []).append(r)
    for group in groups.values():
        try:
            if pair_best_with_default(group, lambda r: calls[id(r)]) is not None and on_row is not None:
                on_row(group[0])
        except Exception as e:  # pragma: no cover - GPU only
            group[0]["pair_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return rows


# ------------------------------------------------------------------------------------------------ driver
def cases(quick: bool = False):
    """``[(kernel, D, dtype name)]`` searched: bf16 and fp32 (fp16 tiles are bf16's: same bytes, same dots), for
    the kernels that exist there (:func:`searchable`)."""
    ds, dts = ((64,), ("bf16",)) if quick else ((64, 128, 256), ("bf16", "fp32"))
    return [(k, d, dt) for dt in dts for d in ds for k in KERNELS if searchable(k, d, dt)]


def search(devs, quick: bool = False, shape: AttnShape = AttnShape(), log=print) -> list[dict]:
    """Filter (deviceless) every case of :func:`cases`, then time the survivors when a GPU is present."""
    rows = []
    for kernel, d, dt in cases(quick):
        log(f"  {kernel} D={d} {dt}")
        got = filter_kernel(devs, kernel, d, DTYPES[dt], candidates(kernel, d, DTYPES[dt], quick), shape, log)
        rows += time_rows(got, shape)
    if not has_gpu():
        log(
            "  no GPU here: timing skipped; the survivors are ranked by rank_key (tile, occupancy, stages), "
            "not by speed"
        )
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: per (kernel, D, dtype) the best surviving candidate and how many passed."""
    lines = [
        "| kernel | D | dtype | candidates | pass | best | regs | smem B | occupancy | HGMMA | HMMA | time ms "
        "| speed-up over the default, paired |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_key(r), []).append(r)
    for (kernel, d, dt, hkv), rs in groups.items():
        if hkv != AttnShape().hkv:  # a GQA group: its heads beside the kernel's name
            kernel = f"{kernel} ({rs[0].get('q_heads', AttnShape().hq)}/{hkv} heads)"
        ok = [r for r in rs if r["passed"]]
        times = [r for r in rs if "time" in r]  # the survivors and the default, on a GPU
        best = min(times, key=lambda r: r["time"]["median_s"]) if times else (ok[0] if ok else None)
        note = " (the default)" if best is not None and best.get("default") else ""
        if best is None:  # nothing passes: show the least-spilling compiled candidate
            spilled = [r for r in rs if r.get("registers") is not None]
            if not spilled:
                lines.append(f"| {kernel} | {d} | {dt} | {len(rs)} | 0 | none compiled | | | | | | | |")
                continue
            best = min(spilled, key=lambda r: (r["spill_stores"] + r["spill_loads"], rank_key(r)))
            note = f" (none passes; least spill {best['spill_stores']}/{best['spill_loads']} B)"
        k = ", ".join(f"{f}={v}" for f, v in best["knobs"].items()) + note
        sass = best.get("sass") or {}
        t = best.get("time", {}).get("median_s")
        pair = best.get("vs_default")
        lines.append(
            f"| {kernel} | {d} | {dt} | {len(rs)} | {len(ok)} | {k} | {best['registers']} | "
            f"{best['smem_bytes']:,} | {best['occupancy']:.3f} | {sass.get('HGMMA', 'n/a')} | "
            f"{sass.get('HMMA', 'n/a')} | {'' if t is None else f'{t * 1e3:.3f}'} | "
            f"{'' if pair is None else format_ratio(pair['ratio'], pair)} |"
        )
    return "\n".join(lines)


def write(out: str, rows: list[dict], info: dict, complete: bool = True) -> str:
    """Merge ``rows`` into ``<out>/block_search.json`` (groups (kernel, D, dtype, kv heads) searched now replace the
    stored ones, the others stay, so a partial search never erases a finished one) and rewrite
    ``block_search.md``; returns the markdown."""
    path = os.path.join(out, "block_search.json")
    old = read_results(out).get("block_search", {}).get("records", []) if os.path.exists(path) else []
    now = {group_key(r) for r in rows}
    merged = [r for r in old if group_key(r) not in now] + list(rows)
    merged.sort(key=lambda r: (KERNELS.index(r["kernel"]), r["dtype"], r["head_dim"], -group_key(r)[3]))
    write_results(out, "block_search", merged, info, complete=complete)
    timed = any("time" in r for r in merged)
    text = (
        f"# Block-size search for the flash and mosaic kernels, {info.get('label', 'compiled for H100, not run')}\n\n"
        "Deviceless filter (`python -m benchmarks compile --search`, or `python -m benchmarks.tools.block_search "
        "--out DIR` per kernel/D/dtype): each candidate kernel compiled ALONE at B=1, S=4096, H=16, causal (a GQA "
        "group, `--kv-heads`: 16 query heads over the kv heads its name gives); "
        "it passes with no spill, a fit on the SM and, for bf16/fp16, wgmma only (HMMA = 0). "
        + (
            "Best = the fastest timed row (the survivors and the default tile, timed even where it spills); where "
            "it is not the default, the two are timed again alternately (10 rounds) for the last column: a "
            "default changes only on a paired speed-up that is a finding and not unstable."
            if timed
            else "No GPU has timed these: best = the first survivor in `rank_key` order (largest tile, occupancy, "
            "stages, fewer registers), not a speed."
        )
        + " `BlockSizes.default` is chosen from these rows (see flash.py); the Mosaic defaults are FA3's published "
        "Hopper tiles until a GPU times these (see mosaic.py).\n\n" + table(merged) + "\n"
    )
    write_text_atomic(os.path.join(out, "block_search.md"), text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.block_search",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kernel", choices=KERNELS, action="append")
    p.add_argument("--d", type=int, action="append")
    p.add_argument("--dtype", choices=tuple(DTYPES), action="append")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--target", default="h100")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=AttnShape().hkv,
        help=f"kv heads of the searched call, {AttnShape().hq} query heads over them (default {AttnShape().hkv}: "
        "no GQA; 4: Llama 3 8b's 4 query heads per kv head, as the 1b and Mixtral presets)",
    )
    p.add_argument("--out", default=None, help="merge the rows into DIR/block_search.{json,md}")
    p.add_argument(
        "--survivors",
        metavar="FILE",
        default=None,
        help="skip the filter: time the rows of FILE (a block_search.json) that passed it, for the --kernel/--d/"
        "--dtype given (on a GPU; a GPU session's search, e.g. benchmarks/results/h100-compiled/block_search.json)",
    )
    args = p.parse_args(argv)
    hq = AttnShape().hq
    if args.kv_heads < 1 or hq % args.kv_heads:
        p.error(f"--kv-heads must divide the {hq} query heads (1, 2, 4, 8 or 16), got {args.kv_heads}")
    shape = AttnShape(hkv=args.kv_heads)
    groups = [
        (kernel, d, dt)
        for kernel in args.kernel or KERNELS
        for d in args.d or (64, 128, 256)
        for dt in args.dtype or ("bf16",)
        if searchable(kernel, d, dt)
    ]
    if not groups:
        p.error("no kernel exists at the --kernel / --d / --dtype given (Mosaic: bf16 / fp16, backward at D 64 / 128)")
    rows: list[dict] = []
    info = dict(measure.env_info(), target=args.target, label=f"compiled for {args.target.upper()}, not run")

    def save(_row=None, complete=False):  # after every timed row (complete: false): a kill keeps what was timed
        if args.out and rows:
            timed_on = measure.jax_device_name() if any("time" in r for r in rows) else None
            label = info["label"] if timed_on is None else f"compiled for {args.target.upper()}, timed on {timed_on}"
            write(args.out, rows, dict(info, timed_on=timed_on, label=label), complete=complete)

    if args.survivors:
        stored = read_results(os.path.dirname(os.path.abspath(args.survivors))).get("block_search", {})
        for kernel, d, dt in groups:
            got = [
                dict(r)
                for r in stored.get("records", [])
                if group_key(r) == (kernel, d, jnp.dtype(DTYPES[dt]).name, args.kv_heads)
            ]
            if not got:
                p.error(f"--survivors {args.survivors}: no rows for {kernel} D={d} {dt} with {args.kv_heads} kv heads")
            print(
                f"  {kernel} D={d} {dt}: timing {sum(map(to_time, got))} rows (survivors and the default)", flush=True
            )
            rows += got
            time_rows(got, shape, on_row=save)
    else:
        devs = gpu_target.devices(target_config(args.target))
        for kernel, d, dt in groups:
            print(f"  {kernel} D={d} {dt}", flush=True)
            got = filter_kernel(
                devs,
                kernel,
                d,
                DTYPES[dt],
                candidates(kernel, d, DTYPES[dt], args.quick),
                shape,
                log=lambda *a: print(*a, flush=True),
            )
            rows += time_rows(got, shape, on_row=save)
    if not has_gpu():
        print("no GPU here: timing skipped (deviceless filter only)")
    print(table(rows))
    if args.out:
        save(complete=True)
        print(f"merged into {args.out}/block_search.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
