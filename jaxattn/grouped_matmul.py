"""Grouped matmul (the MoE expert GEMM): our Pallas kernels, forward and backward (Triton lowering on NVIDIA GPUs,
interpreted on CPU).

Rows of ``lhs`` come in consecutive groups (tokens sorted by expert); group g's rows are multiplied by ``rhs[g]``,
which is what ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` computes and what this drops in for::

    out = grouped_matmul(lhs, rhs, group_sizes)   # lhs [M, K], rhs [G, K, N], group_sizes int32 [G] -> [M, N]

Hand-written because XLA (jax 0.10.2) lowers ``ragged_dot`` on a GPU to DENSE masked dots: every row times every
expert (G times the grouped FLOPs, and a ``[M, G*K]`` operand in the forward; ``parity_tests/test_grouped_matmul.py``
compiles both for an H100 and compares).  The library peer is tokamax's ``ragged_dot`` (Pallas Triton / Mosaic
GPU); jax ships megablox (``pallas/ops/tpu/megablox``) for TPUs only.  The design is megablox's (Gale et al.,
MegaBlocks, 2022): three kernels, all writing ``bm x bn`` output tiles with a contraction in blocks of ``bk``:

* ``gmm`` (forward): a tile schedule over (group, m-tile) pairs, computed with ``jnp`` from ``group_sizes``
  (megablox's ``make_group_metadata``, plus a tail item that zeroes the rows past the sum); a program per (work
  item, n-tile), in L2-friendly super-rows (Triton's matmul ordering), multiplies its m-tile by its group's expert
  and stores only its group's rows, so two programs sharing a boundary tile write disjoint rows.
* ``gmm`` with ``transpose=True`` (d_lhs = d_out @ rhs[g]^T): the same kernel reading ``rhs`` tiles transposed,
  so ``rhs^T`` is never materialised.
* ``tgmm`` (d_rhs[g] = lhs_g^T @ d_out_g): a program per (K-tile, N-tile, group) loops over the group's rows in
  chunks of ``bk`` (a trip count read from the group offsets; an empty group stores exact zeros).

Any M, K, N (padded inside to the blocks; no copy when they divide), empty groups, rows past ``sum(group_sizes)``
(zero in the output, as ``ragged_dot``'s); float32 (three TF32 passes, :func:`jaxattn.attention.tiling.dot`),
bfloat16 and float16, accumulated in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .attention.tiling import MIN_BLOCK, cdiv, dot, is_pow2, next_pow2, plt, resolve_interpret, triton_call

__all__ = ["BlockSizes", "grouped_matmul", "grouped_matmul_reference", "tile_schedule"]

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------------------- block sizes
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16) and Triton launch knobs, shared by the three kernels.

    Every kernel writes ``bm x bn`` output tiles and contracts in blocks of ``bk``: the forward and d_lhs over
    (rows, columns) of their output with K (resp. N) as contraction; ``tgmm`` over (K, N) of ``d_rhs[g]`` with the
    group's rows as contraction.  A block larger than its (power-of-two-rounded) dimension is shrunk to it at call
    time, so the defaults work for tiny shapes.
    """

    bm: int = 128
    bk: int = 64
    bn: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for f in ("bm", "bk", "bn"):
            val = getattr(self, f)
            if not is_pow2(val) or val < MIN_BLOCK or val > 512:
                raise ValueError(
                    f"BlockSizes.{f} must be a power of two in [{MIN_BLOCK}, 512] (Triton block dims are powers "
                    f"of two and tl.dot needs >= 16), got {val!r}"
                )
        if isinstance(self.num_warps, bool) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps must be one of (1, 2, 4, 8, 16), got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"BlockSizes.num_stages must be an int in [1, 8], got {self.num_stages!r}")

    @classmethod
    def default(cls, dtype=jnp.bfloat16) -> BlockSizes:
        """16-bit: 128x128 tiles, bk 64, 8 warps, 3 stages (96 KiB of shared memory for the pipeline).  float32
        runs three TF32 passes per block (more registers, twice the bytes): 64x64 tiles, bk 32, 4 warps, 2 stages.
        Chosen by the deviceless H100 compile (no spills, shared memory within the SM), not by timings."""
        if jnp.dtype(dtype).itemsize >= 4:
            return cls(bm=64, bk=32, bn=64, num_warps=4, num_stages=2)
        return cls()


# ----------------------------------------------------------------------------------------- static config
@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Everything static about one call (hashable; the custom_vjp's nondiff argument)."""

    bm: int
    bk: int
    bn: int
    num_warps: int
    num_stages: int
    out_dtype: str
    interpret: bool
    poison: bool


def _blocks(cfg: _Cfg, rows: int, contract: int, cols: int) -> tuple[int, int, int]:
    """The block sizes for a ``[rows, contract] x [contract, cols]`` kernel, shrunk to small dimensions."""

    def cap(b, n):
        return min(b, max(MIN_BLOCK, next_pow2(n)))

    return cap(cfg.bm, rows), cap(cfg.bk, contract), cap(cfg.bn, cols)


def _round_up(n: int, m: int) -> int:
    return cdiv(n, m) * m


def _pad_to(x, shape):
    """Zero-pad ``x`` at the end of each axis to ``shape`` (no op when it already has it)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


# ----------------------------------------------------------------------------------------- tile schedule
def _group_bounds(group_sizes, m: int):
    """``(starts, ends)`` int32 ``[G]``: group g owns rows ``[starts[g], ends[g])``, clipped to ``[0, m]``."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def tile_schedule(group_sizes, m: int, bm: int):
    """The forward's work list (megablox ``make_group_metadata``), four int32 ``[W]`` arrays with
    ``W = cdiv(m, bm) + G``: ``group`` (``G`` for the tail, rows past ``sum(group_sizes)``, which get zeros),
    ``tile`` (m-tile index) and ``lo``/``hi`` (the rows of that tile the item stores).  A group touches the tiles
    ``[start // bm, cdiv(end, bm))``; neighbours share at most one, so the G groups and the tail need at most
    ``cdiv(m, bm) + G`` items.  Unused items get ``lo == hi == 0`` and store nothing."""
    g = group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])  # the tail as group G: rows [sum, m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = starts // bm
    counts = jnp.where(ends > starts, cdiv(ends, bm) - first, 0)
    item_end = jnp.cumsum(counts)
    w = jnp.arange(cdiv(m, bm) + g, dtype=jnp.int32)
    group = jnp.searchsorted(item_end, w, side="right").astype(jnp.int32)  # g + 1 for an unused item
    used = group <= g
    gc = jnp.minimum(group, g)
    tile = jnp.where(used, first[gc] + w - (item_end[gc] - counts[gc]), 0)
    lo = jnp.where(used, starts[gc], 0)
    hi = jnp.where(used, ends[gc], 0)
    return gc, tile.astype(jnp.int32), lo, hi


# ----------------------------------------------------------------------------------------- kernels
_GROUP_M = 8  # work items per L2 super-row (Triton's matmul tutorial, GROUP_SIZE_M)


def _swizzle(pid, *, n_w: int, n_j: int):
    """``(work item, n-tile)`` of program ``pid`` on the 1-D grid of ``n_w * n_j``: ``_GROUP_M`` consecutive items
    sweep every n-tile before the next ones start, so a wave of programs reads a few lhs m-tiles and rhs column
    strips that stay in L2 (item-major order would stream all of lhs once per wave)."""
    per = jnp.int32(_GROUP_M * n_j)
    first = lax.div(pid, per) * _GROUP_M
    size = lax.min(jnp.int32(n_w) - first, jnp.int32(_GROUP_M))
    local = lax.rem(pid, per)
    return first + lax.rem(local, size), lax.div(local, size)


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, *, bm, bk, n_k, groups, transpose):
    """One (work item, n-tile): ``out[rows of the item, n-tile] = lhs[m-tile] @ rhs[g][:, n-tile]`` (or
    ``rhs[g][n-tile, :]^T``).  ``lhs_ref [Mp, Cp]``, ``rhs_ref [G, Cp, bn]`` (``[G, bn, Cp]`` transposed),
    ``out_ref [Mp, bn]``: whole arrays, indexed by the item's dynamic tile and group."""
    g = group_ref[...]
    lo = lo_ref[...]
    hi = hi_ref[...]
    r0 = pl.multiple_of(tile_ref[...] * bm, bm)
    bn = out_ref.shape[1]
    # The tail item (g == G) and unused items contract nothing: the tail stores zeros, unused ones store no row.
    n_iter = jnp.where((g < groups) & (lo < hi), jnp.int32(n_k), jnp.int32(0))
    gi = jnp.minimum(g, groups - 1)

    def body(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        a = lhs_ref[pl.ds(r0, bm), pl.ds(k0, bk)]
        if transpose:
            return acc + dot(a, rhs_ref[gi, :, pl.ds(k0, bk)], 1, 1)
        return acc + dot(a, rhs_ref[gi, pl.ds(k0, bk), :], 1, 0)

    acc = lax.fori_loop(0, n_iter, body, jnp.zeros((bm, bn), jnp.float32))
    rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    # Masked store (megablox's): programs that share a boundary tile write disjoint rows.
    plt.store(out_ref.at[pl.ds(r0, bm), :], acc.astype(out_ref.dtype), mask=(rows >= lo) & (rows < hi))


def _tgmm_kernel(lo_ref, hi_ref, lhs_ref, dout_ref, out_ref, *, bk):
    """One (group, K-tile, N-tile): ``out = lhs[lo:hi, K-tile]^T @ dout[lo:hi, N-tile]``, rows in chunks of ``bk``
    aligned to ``bk``; only the chunks holding the group's first or last row are masked."""
    lo = lo_ref[...]
    hi = hi_ref[...]
    bm, bn = out_ref.shape
    first = lax.div(lo, bk)
    last = jnp.where(hi > lo, lax.div(hi + (bk - 1), bk), first)  # an empty group loops zero times
    inner_lo = jnp.clip(lax.div(lo + (bk - 1), bk), first, last)  # chunks [inner_lo, inner_hi) need no mask
    inner_hi = jnp.clip(lax.div(hi, bk), inner_lo, last)

    def body(i, acc, masked):
        r0 = pl.multiple_of(i * bk, bk)
        x = lhs_ref[pl.ds(r0, bk), :]
        dy = dout_ref[pl.ds(r0, bk), :]
        if masked:  # both operands: a row of another group may hold inf, and 0 * inf = NaN
            rows = r0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            keep = (rows >= lo) & (rows < hi)
            x = jnp.where(keep, x, jnp.zeros_like(x))
            dy = jnp.where(keep, dy, jnp.zeros_like(dy))
        return acc + dot(x, dy, 0, 0)

    acc = jnp.zeros((bm, bn), jnp.float32)
    acc = lax.fori_loop(first, inner_lo, functools.partial(body, masked=True), acc)
    acc = lax.fori_loop(inner_lo, inner_hi, functools.partial(body, masked=False), acc)
    acc = lax.fori_loop(inner_hi, last, functools.partial(body, masked=True), acc)
    out_ref[...] = acc.astype(out_ref.dtype)


# ----------------------------------------------------------------------------------------- pallas calls
def _call(kernel, cfg: _Cfg, *, name, grid, in_specs, out_spec, out_shape, args):
    """:func:`~jaxattn.attention.tiling.triton_call` of one output (poisoned with NaN under ``cfg.poison``)."""
    (out,) = triton_call(
        kernel,
        name=name,
        grid=grid,
        in_specs=in_specs,
        out_specs=[out_spec],
        out_shapes=[out_shape],
        args=args,
        interpret=cfg.interpret,
        poison=cfg.poison,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _gmm(cfg: _Cfg, lhs, rhs, group_sizes, out_dtype, transpose: bool = False):
    """``lhs [M, C]`` times ``rhs [G, C, N]`` (``[G, N, C]`` when ``transpose``) per group -> ``[M, N]``."""
    m, c = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose else rhs.shape[2]
    bm, bk, bn = _blocks(cfg, m, c, n)
    mp, cp, np_ = _round_up(m, bm), _round_up(c, bk), _round_up(n, bn)
    lhs = _pad_to(lhs, (mp, cp))
    rhs = _pad_to(rhs, (groups, np_, cp) if transpose else (groups, cp, np_))
    sched = tile_schedule(group_sizes, m, bm)
    n_w, n_j = sched[0].shape[0], np_ // bn
    wj = functools.partial(_swizzle, n_w=n_w, n_j=n_j)
    item = pl.BlockSpec((None,), lambda p: (wj(p)[0],))
    if transpose:
        rhs_spec = pl.BlockSpec((groups, bn, cp), lambda p: (0, wj(p)[1], 0))
    else:
        rhs_spec = pl.BlockSpec((groups, cp, bn), lambda p: (0, 0, wj(p)[1]))
    kernel = functools.partial(_gmm_kernel, bm=bm, bk=bk, n_k=cp // bk, groups=groups, transpose=transpose)
    out = _call(
        kernel,
        cfg,
        name="grouped_matmul_t" if transpose else "grouped_matmul",
        grid=(n_w * n_j,),
        in_specs=[item] * 4 + [pl.BlockSpec((mp, cp), lambda p: (0, 0)), rhs_spec],
        out_spec=pl.BlockSpec((mp, bn), lambda p: (0, wj(p)[1])),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        args=[*sched, lhs, rhs],
    )
    return out[:m, :n]


def _tgmm(cfg: _Cfg, lhs, dout, group_sizes, out_dtype):
    """``d_rhs[g] = lhs[group g]^T @ dout[group g]``: ``lhs [M, K]``, ``dout [M, N]`` -> ``[G, K, N]``."""
    m, k = lhs.shape
    n = dout.shape[1]
    groups = group_sizes.shape[0]
    bm, bk, bn = _blocks(cfg, k, m, n)  # output tile over (K, N); contraction over rows
    mp, kp, np_ = _round_up(m, bk), _round_up(k, bm), _round_up(n, bn)
    lhs = _pad_to(lhs, (mp, kp))
    dout = _pad_to(dout, (mp, np_))
    starts, ends = _group_bounds(group_sizes, m)
    # K-tiles fastest, the group slowest: a wave of programs shares one group, whose lhs rows ([rows_g, K], a few
    # MiB) stay in L2 while the N-tiles sweep past (group-major order would re-read lhs once per N-tile).
    item = pl.BlockSpec((None,), lambda i, j, g: (g,))
    out = _call(
        functools.partial(_tgmm_kernel, bk=bk),
        cfg,
        name="grouped_matmul_tgmm",
        grid=(kp // bm, np_ // bn, groups),
        in_specs=[
            item,
            item,
            pl.BlockSpec((mp, bm), lambda i, j, g: (0, i)),
            pl.BlockSpec((mp, bn), lambda i, j, g: (0, j)),
        ],
        out_spec=pl.BlockSpec((None, bm, bn), lambda i, j, g: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, kp, np_), out_dtype),
        args=[starts, ends, lhs, dout],
    )
    return out[:, :k, :n]


# ----------------------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm_core(cfg: _Cfg, lhs, rhs, group_sizes):
    return _gmm(cfg, lhs, rhs, group_sizes, jnp.dtype(cfg.out_dtype))


def _gmm_core_fwd(cfg, lhs, rhs, group_sizes):
    return _gmm_core(cfg, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_core_bwd(cfg, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)  # the kernels' operands share one dtype (flash does the same with do)
    d_lhs = _gmm(cfg, dout, rhs, group_sizes, lhs.dtype, transpose=True)
    d_rhs = _tgmm(cfg, lhs, dout, group_sizes, rhs.dtype)
    return d_lhs, d_rhs, None  # group_sizes is integer: no cotangent (float0 zeros)


_gmm_core.defvjp(_gmm_core_fwd, _gmm_core_bwd)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _run(lhs, rhs, group_sizes, *, cfg: _Cfg):
    return _gmm_core(cfg, lhs, rhs, group_sizes)


# ----------------------------------------------------------------------------------------- public API
def _check(lhs, rhs, group_sizes, preferred_element_type, block_sizes):
    for name, x, rank, what in (
        ("lhs", lhs, 2, "[M, K]"),
        ("rhs", rhs, 3, "[G, K, N]"),
        ("group_sizes", group_sizes, 1, "[G]"),
    ):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != rank:
            raise ValueError(f"{name} must be a rank-{rank} array {what}, got shape {shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"lhs [M, K] and rhs [G, K, N] must share K: lhs.shape={tuple(lhs.shape)}, rhs.shape={tuple(rhs.shape)}"
        )
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"group_sizes must have one entry per group of rhs (G={rhs.shape[0]}), got shape {tuple(group_sizes.shape)}"
        )
    if rhs.shape[0] < 1:
        raise ValueError(f"rhs must hold at least one group, got shape {tuple(rhs.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array (int32), got dtype {group_sizes.dtype}")
    if jnp.dtype(lhs.dtype) not in _DTYPES:
        raise TypeError(f"lhs must be float32, bfloat16 or float16, got dtype {lhs.dtype}")
    if jnp.dtype(rhs.dtype) != jnp.dtype(lhs.dtype):
        raise TypeError(f"rhs must have lhs's dtype ({lhs.dtype}), got dtype {rhs.dtype}: cast one of them")
    out = jnp.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    if out not in _DTYPES:
        raise TypeError(f"preferred_element_type must be None, float32, bfloat16 or float16, got {out}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be None or a grouped_matmul.BlockSizes, got {type(block_sizes).__name__}")
    return out


def grouped_matmul(
    lhs, rhs, group_sizes, *, block_sizes=None, interpret=None, preferred_element_type=None, _poison_outputs=False
):
    """``out[r] = lhs[r] @ rhs[g]`` for each row r of group g: ``lhs [M, K]`` with rows in consecutive groups,
    ``rhs [G, K, N]``, ``group_sizes`` integer ``[G]`` (groups past row M are clipped; rows past
    ``sum(group_sizes)`` are zero in the output).  ``jax.lax.ragged_dot(lhs, rhs, group_sizes)``'s contract (its default
    dimension numbers; no ``precision``/``group_offset``), so it drops in where that is called; differentiable in
    ``lhs`` and ``rhs`` (Pallas kernels both ways).

    lhs and rhs share a dtype (float32, bfloat16, float16); the output has ``preferred_element_type`` (default
    lhs's), accumulation is float32.  ``block_sizes`` (default :meth:`BlockSizes.default` of the dtype) and
    ``interpret`` (None: interpret unless the trace targets a GPU, as the flash kernels do) are kernel knobs;
    ``_poison_outputs`` (tests) pre-fills the kernel output buffers with NaN.
    """
    out_dtype = _check(lhs, rhs, group_sizes, preferred_element_type, block_sizes)
    m, k = lhs.shape
    n = rhs.shape[2]
    if m == 0 or n == 0 or k == 0:  # nothing to contract or nothing to write: ragged_dot's zeros
        return jnp.zeros((m, n), out_dtype)
    bs = BlockSizes.default(lhs.dtype) if block_sizes is None else block_sizes
    cfg = _Cfg(
        bm=bs.bm,
        bk=bs.bk,
        bn=bs.bn,
        num_warps=bs.num_warps,
        num_stages=bs.num_stages,
        out_dtype=out_dtype.name,
        interpret=resolve_interpret(interpret, lhs),
        poison=bool(_poison_outputs),
    )
    return _run(lhs, rhs, group_sizes.astype(jnp.int32), cfg=cfg)


def grouped_matmul_reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """Plain ``jnp``: one masked dot per group at ``Precision.HIGHEST`` in float32 (G times the FLOPs; tests)."""
    starts, ends = _group_bounds(jnp.asarray(group_sizes), lhs.shape[0])
    rows = jnp.arange(lhs.shape[0])[:, None]
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        y = jnp.dot(lhs, rhs[g], precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        out = out + jnp.where((rows >= starts[g]) & (rows < ends[g]), y, 0.0)
    return out.astype(lhs.dtype if preferred_element_type is None else preferred_element_type)
