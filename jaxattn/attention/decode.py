"""``flash_decode`` backend: Pallas split-K ("flash-decoding") attention for KV-cache decode steps, forward only.

Flash-Decoding (Dao, Haziza, Massa, Sizov 2023): grid ``(B, Hkv, num_splits)``; each program runs FA2's online
softmax (Dao 2023, §3.1.1) over its share of one row's keys and writes an unnormalised fp32 partial (``acc``, max
``m``, sum ``l``); one XLA reduction merges the splits by the log-sum-exp rescale.  The ``G = Hq // Hkv`` query
heads (times ``Sq`` tokens) of a kv head are the rows of one program's q block (padded to 16), so each K/V tile
is read once per kv head.

Contract: q ``[B, Sq, Hq, D]`` with ``Sq * Hq/Hkv <= 64`` query rows per kv head, k/v ``[B, T, Hkv, D]``,
``lengths [B]``: keys ``>= lengths[b]`` are invisible and query ``i`` sits at position ``lengths[b] - Sq + i``
(its own key already written) for ``causal`` and ``window=(left, right)``; scale, softcap and segment ids as
design §4; a row with no visible key returns zeros; fp32 accumulation (fp32 inputs: three TF32 passes).
Differentiating through it raises.  Opt-in backend: ``attention_backend("flash_decode", "flash")``::

    out = flash_decode(q, k_cache, v_cache, lengths)     # q [B, Sq, Hq, D], k/v [B, T, Hkv, D], lengths [B]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as _plt  # masked loads (load(ref, mask=, other=)): jax 0.10 and 0.11

from twincore.attention import visible_bounds

from . import flash
from .args import AttnArgs, normalize
from .tiling import (
    LN2,
    LOG2E,
    MIN_BLOCK,
    NEG,
    cdiv,
    dot,
    is_pow2,
    next_pow2,
    resolve_interpret,
    scores,
    triton_compiler_params,
    unpack_refs,
)

__all__ = [
    "DecodeBlockSizes",
    "flash_decode",
    "flash_decode_reference",
    "num_splits_heuristic",
    "supports",
    "attention",
]

_MAX_ROWS = 64  # Sq * G query rows per kv head in one program (the fp32 accumulator's registers)
_MAX_SPLITS = 128  # FA2's cap on splits
_NUM_SMS = 132  # H100 SXM: the split heuristic's target
_CTAS_PER_SM = 2  # FA2 counts 2 resident 128-thread CTAs per SM ("num_sm * 2"), see benchmarks/NOTES.md


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


# ----------------------------------------------------------------------------------------- block sizes
@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Tiles and launch knobs of the decode kernel.

    ``block_k``: keys per inner step (a power of two in [16, 1024]; shrunk to the cache at call time).
    ``num_splits``: programs per (batch row, kv head) along the keys; None picks FlashAttention-2's
    ``num_splits_heuristic`` for an H100 (fill 2 CTAs x 132 SMs in whole waves, at most one split per key
    block of the cache).
    ``num_warps``/``num_stages``: the Triton launch (stages pipeline the K/V loads of the key loop).
    """

    block_k: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not is_pow2(self.block_k) or not MIN_BLOCK <= self.block_k <= 1024:
            raise ValueError(
                f"DecodeBlockSizes.block_k must be a power of two in [{MIN_BLOCK}, 1024] (Triton "
                f"block dims are powers of two and tl.dot needs >= 16), got {self.block_k!r}"
            )
        if self.num_splits is not None and (not _is_int(self.num_splits) or not 1 <= self.num_splits <= 1024):
            raise ValueError(
                f"DecodeBlockSizes.num_splits must be None (heuristic) or an int in [1, 1024], got {self.num_splits!r}"
            )
        if not _is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeBlockSizes.num_warps must be one of (1, 2, 4, 8, 16), got {self.num_warps!r}")
        if not _is_int(self.num_stages) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"DecodeBlockSizes.num_stages must be an int in [1, 8], got {self.num_stages!r}")


def num_splits_heuristic(
    programs: int, n_blocks: int, slots: int = _NUM_SMS * _CTAS_PER_SM, max_splits: int = _MAX_SPLITS
) -> int:
    """FlashAttention-2's ``num_splits_heuristic`` (flash_api.cpp, called with ``num_sm * 2``): 1 when
    ``programs`` already fill 80% of the ``slots``; else the fewest splits whose wave efficiency ``n/ceil(n)``
    (``n = programs * splits / slots``) is within 85% of the best, skipping split counts that leave the
    blocks per split unchanged."""
    if programs >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, n_blocks))
    eligible = [s for s in range(1, max_splits + 1) if s == 1 or cdiv(n_blocks, s) != cdiv(n_blocks, s - 1)]
    eff = {s: (programs * s / slots) / math.ceil(programs * s / slots) for s in eligible}
    best = max(eff.values())
    return next(s for s in eligible if eff[s] >= 0.85 * best)


# ----------------------------------------------------------------------------------------- static config
@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Everything static about one call (hashable)."""

    sq: int
    groups: int  # G = Hq // Hkv
    rows: int  # q rows per program: Sq * G padded to a power of two >= 16
    t: int  # cache slots (after padding a cache shorter than 16)
    scale: float
    softcap: float | None
    left: int | None  # window relative to a query's position (None: unbounded); causal -> right = 0
    right: int | None
    has_seg: bool
    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int
    interpret: bool
    poison: bool


def _make_cfg(q, k, args: AttnArgs, bs: DecodeBlockSizes | None, interpret: bool, poison: bool) -> _Cfg:
    b, sq, hq, _ = q.shape
    t, hkv = k.shape[1], k.shape[2]
    bs = DecodeBlockSizes() if bs is None else bs
    t = max(t, MIN_BLOCK)
    block_k = min(bs.block_k, 1 << (t.bit_length() - 1))  # <= t: a block_k slice fits the cache's ref
    splits = bs.num_splits
    if splits is None:
        splits = num_splits_heuristic(b * hkv, cdiv(t, block_k))
    left, right = visible_bounds(args.causal, args.window)
    return _Cfg(
        sq=sq,
        groups=hq // hkv,
        rows=max(MIN_BLOCK, next_pow2(sq * (hq // hkv))),
        t=t,
        scale=float(args.scale),
        softcap=None if args.softcap is None else float(args.softcap),
        left=left,
        right=right,
        has_seg=args.has_segment_ids,
        block_k=block_k,
        num_splits=int(splits),
        num_warps=bs.num_warps,
        num_stages=bs.num_stages,
        interpret=bool(interpret),
        poison=bool(poison),
    )


# ----------------------------------------------------------------------------------------- kernel
def _decode_kernel(*refs, cfg: _Cfg):
    """Phase 1, one program = (batch row, kv head, split): FA2's online softmax over this split's key blocks.
    q rows are ``i * G + g`` (query token i, head g of the group); writes unnormalised acc, max m (log2
    units) and sum l; an empty split writes (0, NEG, 0), which the merge weights by exactly 0."""
    (q_ref, k_ref, v_ref, lo_ref, hi_ref, len_ref), qs_ref, ks_ref, (o_ref, m_ref, l_ref) = unpack_refs(
        refs, 6, cfg.has_seg
    )
    bk, rows = cfg.block_k, cfg.rows
    lo, hi, kv_len = lo_ref[()], hi_ref[()], len_ref[()]  # visited keys [lo, hi); query positions from kv_len
    # This split's share of the row's key blocks (the row's range, not the cache, is split: ragged rows balance).
    first = lax.div(lo, bk)
    n_blocks = jnp.maximum(lax.div(hi + (bk - 1), bk) - first, 0)
    chunk = lax.div(n_blocks + (cfg.num_splits - 1), cfg.num_splits)
    start = first + pl.program_id(2) * chunk
    end = jnp.minimum(start + chunk, first + n_blocks)

    q = q_ref[...]
    dp = q.shape[-1]
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    i_abs = kv_len - cfg.sq + jnp.minimum(lax.div(r, cfg.groups), cfg.sq - 1)  # padded rows copy the last
    q_seg = qs_ref[...] if cfg.has_seg else None
    pv_dtype = jnp.float32 if v_ref.dtype == jnp.float32 else v_ref.dtype

    def body(j, carry):
        acc, m_prev, l_prev = carry
        k0 = j * bk
        k_pos = k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        valid = k_pos < hi  # also keeps every load inside the cache (hi <= T)
        tile = jnp.broadcast_to(valid[:, None], (bk, dp))
        k = _plt.load(k_ref.at[pl.ds(k0, bk), :], mask=tile, other=jnp.zeros((), k_ref.dtype))
        v = _plt.load(v_ref.at[pl.ds(k0, bk), :], mask=tile, other=jnp.zeros((), v_ref.dtype))
        vis = jnp.broadcast_to(valid[None, :], (rows, bk))
        if cfg.right is not None:
            vis = jnp.logical_and(vis, k_pos[None, :] <= (i_abs + cfg.right)[:, None])
        if cfg.left is not None:
            vis = jnp.logical_and(vis, k_pos[None, :] >= (i_abs - cfg.left)[:, None])
        if cfg.has_seg:
            k_seg = _plt.load(ks_ref.at[pl.ds(k0, bk)], mask=valid, other=jnp.zeros((), ks_ref.dtype))
            vis = jnp.logical_and(vis, q_seg[:, None] == k_seg[None, :])
        s, _ = scores(q, k, cfg.scale, cfg.softcap)  # softcap(scale * q k^T), fp32
        s = jnp.where(vis, s * LOG2E, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.where(vis, jnp.exp2(s - m_new[:, None]), 0.0)  # a fully masked row would get p = 1 otherwise
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(pv_dtype), v, 1, 0)
        return acc, m_new, l_new

    init = (jnp.zeros((rows, dp), jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(start, end, body, init)
    if rows == cfg.sq * cfg.groups:
        o_ref[...], m_ref[...], l_ref[...] = acc, m, l
    else:  # the partials hold only the Sq * G real rows: masked stores skip the padding rows' HBM traffic
        real = r < cfg.sq * cfg.groups
        _plt.store(o_ref, acc, mask=jnp.broadcast_to(real[:, None], (rows, dp)))
        _plt.store(m_ref, m, mask=real)
        _plt.store(l_ref, l, mask=real)


def _decode_call(cfg: _Cfg, q, k, v, lo, hi, kv_len, q_ids, kv_ids):
    """``pallas_call`` of phase 1: q ``[B, Hkv, rows, Dp]``, k/v ``[B, T, Hkv, Dp]`` (K/V of kv head h
    addressed in place); returns partial ``(o [B, Hkv, S, R, Dp], m, l [B, Hkv, S, R])`` fp32 for the
    ``R = Sq * G`` real rows (the blocks are ``rows`` tall; the kernel stores the first R)."""
    b, hkv, rows, dp = q.shape
    t, ns, real = k.shape[1], cfg.num_splits, cfg.sq * cfg.groups
    row = pl.BlockSpec((None,), lambda bb, h, s: (bb,))
    kv_spec = pl.BlockSpec((None, t, None, dp), lambda bb, h, s: (bb, 0, h, 0))
    in_specs = [pl.BlockSpec((None, None, rows, dp), lambda bb, h, s: (bb, h, 0, 0)), kv_spec, kv_spec, row, row, row]
    args = [q, k, v, lo, hi, kv_len]
    if cfg.has_seg:
        in_specs += [
            pl.BlockSpec((None, rows), lambda bb, h, s: (bb, 0)),
            pl.BlockSpec((None, t), lambda bb, h, s: (bb, 0)),
        ]
        args += [q_ids, kv_ids]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, dp), lambda bb, h, s: (bb, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bb, h, s: (bb, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bb, h, s: (bb, h, s, 0)),
    ]
    out_shapes = [
        jax.ShapeDtypeStruct((b, hkv, ns, real, dp), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, ns, real), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, ns, real), jnp.float32),
    ]
    kernel = functools.partial(_decode_kernel, cfg=cfg)
    aliases = {}
    if cfg.poison:  # NaN-filled outputs aliased in (the flash kernel's mechanism): an unwritten block shows
        n_in = len(args)
        for idx, (shape, spec) in enumerate(zip(out_shapes, out_specs)):
            aliases[n_in + idx] = idx
            args.append(jnp.full(shape.shape, jnp.nan, shape.dtype))
            in_specs.append(spec)

        def kernel(*refs, _inner=kernel):
            return _inner(*refs[:n_in], *refs[n_in + len(out_shapes) :])

    return pl.pallas_call(
        kernel,
        grid=(b, hkv, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        interpret=cfg.interpret,
        name="flash_decode",
        compiler_params=triton_compiler_params(cfg.num_warps, cfg.num_stages),
    )(*args)


# ----------------------------------------------------------------------------------------- forward only
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decode_core(cfg: _Cfg, q, k, v, lo, hi, kv_len, q_ids, kv_ids):
    return tuple(_decode_call(cfg, q, k, v, lo, hi, kv_len, q_ids, kv_ids))


def _decode_core_fwd(cfg, *args):
    raise NotImplementedError(
        "flash_decode is forward-only (a KV-cache decoding kernel): it has no backward. Differentiate through "
        "another attention backend, e.g. attention_backend('flash') or ('xla'), or dot_product_attention("
        "..., backend='flash')."
    )


def _decode_core_bwd(cfg, res, cts):  # pragma: no cover - the forward rule already refused
    raise NotImplementedError("flash_decode is forward-only")


_decode_core.defvjp(_decode_core_fwd, _decode_core_bwd)


def _merge(o, m, l):
    """Phase 2: ``m* = max_s m_s``, ``out = sum_s 2^(m_s - m*) o_s / sum_s 2^(m_s - m*) l_s`` (m in log2
    units); zeros and LSE ``-inf`` for a row whose splits saw no key (every l_s == 0)."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)  # empty splits: m_s = NEG -> weight 0 (or 1 with l_s = 0 when all are empty)
    lsum = jnp.sum(w * l, axis=2)
    seen = lsum > 0.0
    l_safe = jnp.where(seen, lsum, 1.0)
    out = jnp.sum(w[..., None] * o, axis=2) / l_safe[..., None]
    lse = jnp.where(seen, m_max[:, :, 0] * LN2 + jnp.log(l_safe), -jnp.inf)
    return out, lse


@functools.partial(jax.jit, static_argnames=("cfg", "return_lse"))
def _run(q, k, v, kv_len, q_ids, kv_ids, *, cfg: _Cfg, return_lse: bool):
    b, sq, hq, d = q.shape
    t0, hkv = k.shape[1], k.shape[2]
    g, rows = cfg.groups, cfg.rows
    dp = max(MIN_BLOCK, next_pow2(d))
    kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, t0)
    # Visited key range per row: [0, kv_len), cut by the window's left edge and by the segment ids.
    lo = jnp.zeros((b,), jnp.int32)
    hi = kv_len
    if cfg.left is not None:
        lo = jnp.maximum(kv_len - sq - cfg.left, 0)
    if cfg.has_seg:
        j = jnp.arange(t0, dtype=jnp.int32)
        seen = jnp.any(kv_ids[:, None, :] == q_ids[:, :, None], axis=1) & (j[None, :] < kv_len[:, None])
        hi = jnp.minimum(hi, jnp.max(jnp.where(seen, j + 1, 0), axis=1))
        lo = jnp.maximum(lo, jnp.min(jnp.where(seen, j, t0), axis=1))
        # rows: query token r // G (padded rows repeat the last token's id)
        q_rows = jnp.take(q_ids.astype(jnp.int32), jnp.minimum(jnp.arange(rows) // g, sq - 1), axis=1)
        kv_ids = kv_ids.astype(jnp.int32)
        if cfg.t != t0:
            kv_ids = jnp.pad(kv_ids, ((0, 0), (0, cfg.t - t0)))
    else:
        q_rows = None
    # q [B, Sq, Hkv*G, D] -> rows i*G + g of kv head h: [B, Hkv, rows, Dp] (tiny; K/V are not copied
    # unless D needs padding or the cache is shorter than 16 slots).
    qr = q.reshape(b, sq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, sq * g, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - sq * g), (0, dp - d)))
    if dp != d or cfg.t != t0:
        pad = ((0, 0), (0, cfg.t - t0), (0, 0), (0, dp - d))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    o, m, l = _decode_core(cfg, qr, k, v, lo, hi, kv_len, q_rows, kv_ids if cfg.has_seg else None)
    out, lse = _merge(o, m, l)  # [B, Hkv, Sq*G, Dp], [B, Hkv, Sq*G]
    out = out[..., :d].reshape(b, hkv, sq, g, d).transpose(0, 2, 1, 3, 4).reshape(b, sq, hq, d)
    out = out.astype(q.dtype)
    if not return_lse:
        return out
    return out, lse.reshape(b, hkv, sq, g).transpose(0, 1, 3, 2).reshape(b, hq, sq)


# ----------------------------------------------------------------------------------------- public API
def _check_rows(q, k):
    sq, hq, hkv = q.shape[1], q.shape[2], k.shape[2]
    if sq * (hq // hkv) > _MAX_ROWS:
        return (
            f"flash_decode serves decoding: Sq * Hq/Hkv = {sq} * {hq // hkv} = {sq * (hq // hkv)} query rows "
            f"per kv head, more than {_MAX_ROWS}; use the 'flash' backend for prefill/training-sized calls"
        )
    return None


def _check_lengths(lengths, b: int, t: int):
    if not (hasattr(lengths, "shape") and hasattr(lengths, "dtype")):
        try:
            lengths = jnp.asarray(lengths)
        except (TypeError, ValueError):
            raise TypeError(f"lengths must be an integer array [B] = [{b}], got {type(lengths).__name__}") from None
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must have an integer dtype (the cache's int32 lengths), got {lengths.dtype}")
    if tuple(lengths.shape) != (b,):
        raise ValueError(
            f"lengths must have shape (B,) = ({b},), one valid length per batch row, got shape {tuple(lengths.shape)}"
        )
    try:
        host = np.asarray(lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return lengths  # under jit: values outside [0, T] are clamped to it
    if host.size and (host.min() < 0 or host.max() > t):
        raise ValueError(
            f"lengths must lie in [0, T] = [0, {t}] (T = k.shape[1], the cache slots), got {host.tolist()}"
        )
    return lengths


def _from_args(
    q, k, v, args: AttnArgs, kv_len=None, *, return_lse=False, block_sizes=None, interpret=None, poison=False
):
    if block_sizes is not None and not isinstance(block_sizes, DecodeBlockSizes):
        raise TypeError(f"block_sizes must be None or a decode.DecodeBlockSizes, got {type(block_sizes).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    reason = _check_rows(q, k)
    if reason is not None:
        raise ValueError(reason)
    b, t = q.shape[0], k.shape[1]
    kv_len = jnp.full((b,), t, jnp.int32) if kv_len is None else _check_lengths(kv_len, b, t)
    cfg = _make_cfg(q, k, args, block_sizes, resolve_interpret(interpret, q), poison)
    return _run(q, k, v, kv_len, args.q_segment_ids, args.kv_segment_ids, cfg=cfg, return_lse=bool(return_lse))


def flash_decode(
    q,
    k,
    v,
    lengths=None,
    *,
    causal=False,
    window=None,
    softcap=None,
    scale=None,
    return_lse=False,
    block_sizes=None,
    interpret=None,
    _poison_outputs=False,
):
    """Split-K decode attention; q ``[B, Sq, Hq, D]`` (``Sq * Hq/Hkv <= 64``), k/v ``[B, T, Hkv, D]``.

    ``lengths [B]`` (int, in ``[0, T]``: checked when concrete, clamped under ``jit``): keys ``>= lengths[b]``
    of row b are invisible (None: all ``T``); query i of row b sits at position ``lengths[b] - Sq + i`` for
    ``causal`` (sees keys ``<=`` it) and ``window=(left, right)``; ``softcap``, ``scale`` (default
    ``1/sqrt(D)``) as design §4.  Returns ``out`` in q's
    dtype, or ``(out, lse [B, Hq, Sq] f32)`` (natural log; ``-inf`` and zero output for a row that sees no
    key).  ``block_sizes``: :class:`DecodeBlockSizes`; ``interpret`` (None: interpret unless the trace
    targets a GPU).  Forward only.  ``_poison_outputs`` (tests) NaN-fills the kernel's output buffers.
    """
    args = normalize(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    return _from_args(
        q,
        k,
        v,
        args,
        lengths,
        return_lse=return_lse,
        block_sizes=block_sizes,
        interpret=interpret,
        poison=_poison_outputs,
    )


def flash_decode_reference(
    q, k, v, lengths=None, *, causal=False, window=None, softcap=None, scale=None, return_lse=False
):
    """:func:`flash_decode`'s semantics in plain ``jnp`` (float32, ``Precision.HIGHEST``, full score matrix)."""
    args = normalize(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    b, sq, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else _check_lengths(lengths, b, t)
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    s = (
        jnp.einsum("bqhgd,bkhd->bhgqk", q.astype(f32).reshape(b, sq, hkv, hq // hkv, d), k.astype(f32), precision=hi)
        * args.scale
    )
    if args.softcap is not None:
        s = args.softcap * jnp.tanh(s / args.softcap)
    j = jnp.arange(t)[None, None, :]
    i_abs = (jnp.clip(lengths, 0, t)[:, None] - sq + jnp.arange(sq)[None, :])[:, :, None]  # [B, Sq, 1]
    vis = j < jnp.clip(lengths, 0, t)[:, None, None]
    left, right = visible_bounds(args.causal, args.window)
    if right is not None:
        vis = vis & (j <= i_abs + right)
    if left is not None:
        vis = vis & (j >= i_abs - left)
    vis = vis[:, None, None]  # [B, 1, 1, Sq, T]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p / l_safe, v.astype(f32), precision=hi).reshape(b, sq, hq, d)
    if not return_lse:
        return out
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return out, lse.reshape(b, hq, sq)


# ----------------------------------------------------------------------------------------- backend API
def supports(q, k, v, args: AttnArgs):
    """None when the kernel can serve the call, else a one-line reason: the flash kernel's platform/dtype/head
    dim rules (NVIDIA GPU via Triton, or CPU interpret mode for tests), and at most 64 query rows
    (``Sq * Hq/Hkv``) per kv head."""
    reason = _check_rows(q, k)
    if reason is not None:
        return reason
    reason = flash.supports(q, k, v, args)
    return None if reason is None else f"the Triton kernels decline: {reason}"


def attention(q, k, v, args: AttnArgs):
    """Backend entry point (default block sizes, interpret iff the trace does not target a GPU)."""
    return _from_args(q, k, v, args)
