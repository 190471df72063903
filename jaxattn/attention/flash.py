"""``flash`` backend: our Pallas flash-attention kernels (Triton lowering on NVIDIA GPUs, interpreted on CPU).

FlashAttention-2 (Dao 2023; forward §3.1.1 / Alg. 1, backward §3.1.2 / Alg. 2): a forward kernel (online
softmax; writes the output and the log-sum-exp) and two backward kernels, ``dkv`` (one key block; loops over
the whole GQA query group, so K/V are never repeated) and ``dq``.  The full contract of design §4: any
``Sq``/``Sk`` and head dim ``1..256`` (padded inside), bottom-right causal, ``(left, right)`` window, softcap,
segment ids, GQA/MQA, LSE and its gradient; fp32 accumulation, fp32 inputs as three TF32 passes
(:func:`jaxattn.attention.tiling.dot_tf32x3`).  :func:`flash_backward` is the backward on its own, for a forward
computed elsewhere (``mosaic`` uses it); :func:`kernel_callables` hands out each kernel alone, for the block
search (``benchmarks/block_search.py``)::

    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)   # q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D]

How padding, loop bounds, the masked/unmasked tile split and segment-id tile skipping work is written out,
and checked, in ``parity_tests/test_flash.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from twincore.attention import visible_bounds

from .args import MAX_HEAD_DIM, AttnArgs, normalize
from .target import Target, current_target
from .tiling import (
    LN2,
    LOG2E,
    MIN_BLOCK,
    NEG,
    cdiv,
    dot,
    is_pow2,
    next_pow2,
    plt,
    resolve_interpret,
    scores,
    tile_mask,
    triton_call,
    unpack_refs,
)

__all__ = [
    "BlockSizes",
    "FlashKernels",
    "flash_attention",
    "flash_backward",
    "kernel_callables",
    "supports",
    "attention",
]


# ----------------------------------------------------------------------------------------- block sizes
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (all powers of two >= 16) and the Triton launch knobs.

    ``block_q``/``block_k``: forward; ``block_q_dkv``/``block_k_dkv``: the dK/dV kernel (one key block
    per program, loops over query blocks); ``block_q_dq``/``block_k_dq``: the dQ kernel.  A block larger
    than the (power-of-two-rounded) sequence is shrunk to it at call time, so defaults work for S=1.
    ``num_warps=None`` picks 4 for head_dim <= 64 else 8; ``num_warps_bwd``/``num_stages_bwd`` launch the dq
    and dkv kernels (None: the forward's), ``num_warps_dkv``/``num_stages_dkv`` the dkv kernel alone (None: the
    backward's; the two kernels' best warp counts differ on Hopper).
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 32
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 32
    num_warps: int | None = None
    num_stages: int = 2
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None
    num_warps_dkv: int | None = None
    num_stages_dkv: int | None = None

    def __post_init__(self):
        for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            val = getattr(self, f)
            if not is_pow2(val) or val < MIN_BLOCK or val > 1024:
                raise ValueError(
                    f"BlockSizes.{f} must be a power of two in [{MIN_BLOCK}, 1024] (Triton "
                    f"block dims are powers of two and tl.dot needs >= 16), got {val!r}"
                )
        for f in ("num_warps", "num_warps_bwd", "num_warps_dkv"):
            val = getattr(self, f)
            if val is not None and (isinstance(val, bool) or val not in (1, 2, 4, 8, 16)):
                raise ValueError(f"BlockSizes.{f} must be None or one of (1, 2, 4, 8, 16), got {val!r}")
        for f in ("num_stages", "num_stages_bwd", "num_stages_dkv"):
            val = getattr(self, f)
            if val is None and f != "num_stages":
                continue
            if not isinstance(val, int) or isinstance(val, bool) or not 1 <= val <= 8:
                raise ValueError(
                    f"BlockSizes.{f} must be an int in [1, 8]{' or None' if f != 'num_stages' else ''}, got {val!r}"
                )

    @classmethod
    def default(cls, head_dim: int, dtype=jnp.bfloat16) -> BlockSizes:
        """The :data:`_DEFAULTS` row of ``head_dim`` (rounded up to 64/128/256) and dtype width."""
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be an int in [1, {MAX_HEAD_DIM}], got {head_dim!r}")
        wide = jnp.dtype(dtype).itemsize >= 4
        dp = max(64, next_pow2(head_dim))
        *blocks, warps, stages, warps_bwd, stages_bwd, warps_dkv, stages_dkv = _DEFAULTS[
            dp, "fp32" if wide else "16bit"
        ]
        return cls(
            *blocks,
            num_warps=warps,
            num_stages=stages,
            num_warps_bwd=warps_bwd,
            num_stages_bwd=stages_bwd,
            num_warps_dkv=warps_dkv,
            num_stages_dkv=stages_dkv,
        )


# Default BlockSizes per (head dim rounded up, dtype width), from the deviceless filter of
# benchmarks/block_search.py ("compiled for H100, not run"), then from timings where a GPU ran them:
# - D=128 16-bit dq tile: one H100 (2026-11-27: 0.58 ms against 1.12 for 64x32, kernel alone;
#   benchmarks/results/nvidia-h100-80gb-hbm3/block_search.json);
# - D=128 16-bit dkv tile and launch (32x128, 8 warps, 3 stages; was 32x64, 8 warps, 2 stages): paired against the
#   old default on one H200, 1.71x [1.65-1.81] at 16/16 heads and 1.62x [1.56-1.71] at 16/4 heads (GQA), the fastest
#   of 8 and 12 filter survivors (2026-11-28, nvidia-h200/block_search.json). No spill at either (238 / 248
#   registers); the 4-warp tiles, faster at 16/16 heads on 2026-11-27b, spill with GQA.
# How each row was chosen: benchmarks/NOTES.md, "attention kernels: history" and the GPU session sections.
#   fwd block_q, block_k | dkv block_q, block_k | dq block_q, block_k | fwd warps, stages | bwd warps, stages |
#   dkv warps, stages (None: the backward's)
_DEFAULTS = {
    (64, "16bit"): (128, 64, 32, 128, 128, 32, 4, 3, 8, 3, None, None),
    (128, "16bit"): (128, 64, 32, 128, 128, 64, 8, 2, 8, 2, 8, 3),
    (256, "16bit"): (64, 32, 16, 64, 128, 32, 8, 2, 8, 2, None, None),
    (64, "fp32"): (64, 64, 32, 64, 64, 64, 8, 2, 8, 2, None, None),
    (128, "fp32"): (32, 64, 16, 64, 64, 16, 8, 1, 8, 1, None, None),
    (256, "fp32"): (16, 32, 16, 16, 16, 16, 8, 1, 8, 1, None, None),
}


# ----------------------------------------------------------------------------------------- static config
@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Everything static about one call (hashable; the custom_vjp's nondiff argument)."""

    sq: int
    sk: int
    groups: int  # Hq // Hkv
    scale: float
    left: int | None  # window: key j visible iff i_abs - left <= j <= i_abs + right (None: unbounded)
    right: int | None
    softcap: float | None
    has_seg: bool
    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int
    num_warps: int
    num_stages: int
    num_warps_bwd: int
    num_stages_bwd: int
    num_warps_dkv: int
    num_stages_dkv: int
    interpret: bool
    poison: bool

    @property
    def sq_pad(self):
        return _round_up(self.sq, max(self.block_q, self.block_q_dkv, self.block_q_dq))

    @property
    def sk_pad(self):
        return _round_up(self.sk, max(self.block_k, self.block_k_dkv, self.block_k_dq))


def _round_up(n: int, m: int) -> int:
    return cdiv(n, m) * m


def _make_cfg(q, k, args: AttnArgs, block_sizes: BlockSizes | None, interpret: bool, poison: bool):
    _, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = BlockSizes.default(d, q.dtype) if block_sizes is None else block_sizes
    cap_q = max(MIN_BLOCK, next_pow2(sq))
    cap_k = max(MIN_BLOCK, next_pow2(sk))
    left, right = visible_bounds(args.causal, args.window)
    dp = max(MIN_BLOCK, next_pow2(d))
    warps = bs.num_warps if bs.num_warps is not None else (4 if dp <= 64 else 8)
    warps_bwd = warps if bs.num_warps_bwd is None else bs.num_warps_bwd
    stages_bwd = bs.num_stages if bs.num_stages_bwd is None else bs.num_stages_bwd
    return _Cfg(
        sq=sq,
        sk=sk,
        groups=hq // hkv,
        scale=float(args.scale),
        left=left,
        right=right,
        softcap=None if args.softcap is None else float(args.softcap),
        has_seg=args.has_segment_ids,
        block_q=min(bs.block_q, cap_q),
        block_k=min(bs.block_k, cap_k),
        block_q_dkv=min(bs.block_q_dkv, cap_q),
        block_k_dkv=min(bs.block_k_dkv, cap_k),
        block_q_dq=min(bs.block_q_dq, cap_q),
        block_k_dq=min(bs.block_k_dq, cap_k),
        num_warps=warps,
        num_stages=bs.num_stages,
        num_warps_bwd=warps_bwd,
        num_stages_bwd=stages_bwd,
        num_warps_dkv=warps_bwd if bs.num_warps_dkv is None else bs.num_warps_dkv,
        num_stages_dkv=stages_bwd if bs.num_stages_dkv is None else bs.num_stages_dkv,
        interpret=bool(interpret),
        poison=bool(poison),
    )


# ----------------------------------------------------------------------------------------- kernel pieces
def _scores(q, k, cfg: _Cfg):
    """``softcap(scale * q k^T)`` in fp32 and ``tanh`` (for the backward) or None."""
    return scores(q, k, cfg.scale, cfg.softcap)


def _tile_mask(q_pos, k_pos, cfg: _Cfg, q_seg, k_seg, k_padded: bool, transposed: bool = False):
    """Visibility of a ``[bq, bk]`` tile, or of its transpose ``[bk, bq]`` (None when nothing can be masked)."""
    qi, ki = (slice(None), None), (None, slice(None))
    if transposed:
        qi, ki = ki, qi
    return tile_mask(
        q_pos[qi],
        k_pos[ki],
        shift=cfg.sk - cfg.sq,
        left=cfg.left,
        right=cfg.right,
        k_len=cfg.sk if k_padded else None,
        q_seg=None if q_seg is None else q_seg[qi],
        k_seg=None if k_seg is None else k_seg[ki],
    )


def _kv_block_range(q0, bq: int, bk: int, cfg: _Cfg):
    """Key blocks ``[lo, hi)`` that can hold a key visible to some query in ``[q0, q0 + bq)``."""
    off = cfg.sk - cfg.sq
    nk = cdiv(cfg.sk, bk)  # blocks made only of padding are never visited
    lo = jnp.int32(0)
    hi = jnp.int32(nk)
    if cfg.left is not None:
        lo = lax.div(jnp.maximum(q0 + (off - cfg.left), 0), bk).astype(jnp.int32)
    if cfg.right is not None:
        end = jnp.maximum(q0 + (bq + off + cfg.right), 0)  # one past the last visible key
        hi = jnp.minimum(lax.div(end + (bk - 1), bk), nk).astype(jnp.int32)
    hi = jnp.where(q0 >= cfg.sq, lo, jnp.maximum(hi, lo))  # a block of padded queries does no work
    return lo, hi


def _q_block_range(k0, bk: int, bq: int, cfg: _Cfg):
    """Query blocks ``[lo, hi)`` holding a query that can see a key in ``[k0, k0 + bk)``."""
    off = cfg.sk - cfg.sq
    nq = cdiv(cfg.sq, bq)
    lo = jnp.int32(0)
    hi = jnp.int32(nq)
    if cfg.right is not None:  # i + off + right >= j  ->  i >= j - right - off
        lo = lax.div(jnp.maximum(k0 - (cfg.right + off), 0), bq).astype(jnp.int32)
    if cfg.left is not None:  # i + off - left <= j  ->  i <= j + left - off
        end = jnp.maximum(k0 + (bk + cfg.left - off), 0)
        hi = jnp.minimum(lax.div(end + (bq - 1), bq), nq).astype(jnp.int32)
    hi = jnp.where(k0 >= cfg.sk, lo, jnp.maximum(hi, lo))
    return lo, hi


def _kv_full_range(q0, bq: int, bk: int, cfg: _Cfg):
    """Key blocks ``[u_lo, u_hi)`` in which EVERY (query, key) pair of the tile is visible, so the tile
    needs no mask (padded query rows included: they only extend the band downwards)."""
    off = cfg.sk - cfg.sq
    u_lo = jnp.int32(0)
    u_hi = jnp.int32(cfg.sk // bk)  # tiles without padded keys
    if cfg.right is not None:  # first row q0 sees keys <= q0 + off + right
        u_hi = jnp.minimum(u_hi, lax.div(jnp.maximum(q0 + (off + cfg.right + 1), 0), bk)).astype(jnp.int32)
    if cfg.left is not None:  # last row sees keys >= q0 + bq - 1 + off - left
        start = jnp.maximum(q0 + (bq - 1 + off - cfg.left), 0)
        u_lo = lax.div(start + (bk - 1), bk).astype(jnp.int32)
    return u_lo, u_hi


def _q_full_range(k0, bk: int, bq: int, cfg: _Cfg):
    """Query blocks ``[u_lo, u_hi)`` that see EVERY key of ``[k0, k0 + bk)`` (no mask needed)."""
    off = cfg.sk - cfg.sq
    u_lo = jnp.int32(0)
    u_hi = jnp.int32(cdiv(cfg.sq, bq))
    if cfg.right is not None:  # first row of the block must see the last key: qb*bq >= k0+bk-1-off-right
        u_lo = lax.div(jnp.maximum(k0 + (bk - 1 - off - cfg.right), 0) + (bq - 1), bq).astype(jnp.int32)
    if cfg.left is not None:  # last row must see the first key: qb*bq + bq - 1 <= k0 + left - off
        u_hi = jnp.minimum(u_hi, lax.div(jnp.maximum(k0 + (cfg.left - off + 1), 0), bq)).astype(jnp.int32)
    u_hi = jnp.where(k0 + bk > cfg.sk, jnp.int32(0), u_hi)  # a tile with padded keys keeps its mask
    return u_lo, u_hi


def _split_loop(lo, hi, full, body, carry):
    """Run ``body(j, carry, masked)`` for j in ``[lo, hi)``: tiles of the fully visible sub-range ``full``
    without computing a mask (FlashAttention-2's split of the causal loop), the others with it.
    With segment ids (``full`` is None) every tile is masked."""
    if full is None:
        return lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    a = jnp.minimum(jnp.maximum(full[0], lo), hi)
    b = jnp.minimum(jnp.maximum(full[1], a), hi)
    carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
    return lax.fori_loop(b, hi, functools.partial(body, masked=True), carry)


def _any(m):
    # Explicit single-axis reductions (what the Triton lowering emits for a 2-D reduction anyway).
    return jnp.max(jnp.max(m.astype(jnp.int32), axis=1), axis=0) > 0


def _maybe_skip(tmask, cfg: _Cfg, compute, carry):
    """Run ``compute(carry)`` unless segment ids make the whole tile invisible."""
    if cfg.has_seg and tmask is not None:
        return lax.cond(_any(tmask), compute, lambda c: c, carry)
    return compute(carry)


def _kv_loop(q0, bq: int, bk: int, cfg: _Cfg, q_seg, k_ref, v_ref, ks_ref, update, init):
    """The forward's and dQ's loop over the key blocks query block ``q0`` sees (:func:`_split_loop`: the
    unmasked tiles without a mask): ``carry = update(carry, k, v, tmask)`` per key tile, a tile that segment
    ids hide entirely skipped (:func:`_maybe_skip`)."""
    q_pos = q0 + lax.broadcasted_iota(jnp.int32, (bq,), 0)
    k_padded = cfg.sk_pad != cfg.sk

    def body(j, carry, masked):
        k0 = j * bk
        k_pos = k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        k_seg = ks_ref[pl.ds(k0, bk)] if cfg.has_seg else None
        tmask = _tile_mask(q_pos, k_pos, cfg, q_seg, k_seg, k_padded) if masked else None

        def compute(c):
            return update(c, k_ref[pl.ds(k0, bk), :], v_ref[pl.ds(k0, bk), :], tmask)

        return _maybe_skip(tmask, cfg, compute, carry)

    lo, hi = _kv_block_range(q0, bq, bk, cfg)
    full = None if cfg.has_seg else _kv_full_range(q0, bq, bk, cfg)
    return _split_loop(lo, hi, full, body, init)


def _fwd_kernel(*refs, cfg: _Cfg):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref) = unpack_refs(refs, 3, cfg.has_seg)
    bq, bk = cfg.block_q, cfg.block_k
    q0 = pl.program_id(0) * bq
    q = q_ref[...]
    dp = q.shape[-1]
    q_seg = qs_ref[...] if cfg.has_seg else None
    pv_dtype = jnp.float32 if v_ref.dtype == jnp.float32 else v_ref.dtype

    def update(c, k, v, tmask):
        acc, m_prev, l_prev = c
        s, _ = _scores(q, k, cfg)
        s = s * LOG2E
        if tmask is not None:
            s = jnp.where(tmask, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if tmask is not None:  # a fully masked row has m_new == NEG and would get p == 1
            p = jnp.where(tmask, p, 0.0)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(pv_dtype), v, 1, 0)
        return acc, m_new, l_new

    init = (jnp.zeros((bq, dp), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = _kv_loop(q0, bq, bk, cfg, q_seg, k_ref, v_ref, ks_ref, update, init)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m * LN2 + jnp.log(l_safe), -jnp.inf)


def _bwd_tile(q, k, v, do, lse, delta, tmask, cfg: _Cfg):
    """Shared backward algebra of one tile: returns ``(p, ds)`` with ds = dL/d(scaled, uncapped s)."""
    s, t = _scores(q, k, cfg)
    p = jnp.exp2(s * LOG2E - (lse * LOG2E)[:, None])  # rows that see no key carry lse = +inf: p = 0
    if tmask is not None:  # masked entries contribute exactly 0
        p = jnp.where(tmask, p, 0.0)
    dpv = dot(do, v, 1, 1)
    ds = p * (dpv - delta[:, None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    return p, ds


def _bwd_tile_t(q, k, v, do, lse, delta, tmask_t, cfg: _Cfg):
    """:func:`_bwd_tile` transposed, ``(p^T, ds^T)`` as ``[bk, bq]``: the dK/dV kernel computes ``k q^T`` and
    ``v do^T`` so every dot has M = ``block_k_dkv`` (wgmma needs M >= 64 per warpgroup; FA2 §3.1.2 leaves the
    operand order free)."""
    s, t = _scores(k, q, cfg)
    p = jnp.exp2(s * LOG2E - (lse * LOG2E)[None, :])
    if tmask_t is not None:
        p = jnp.where(tmask_t, p, 0.0)
    dpv = dot(v, do, 1, 1)
    ds = p * (dpv - delta[None, :])
    if t is not None:
        ds = ds * (1.0 - t * t)
    return p, ds


def _dkv_kernel(*refs, cfg: _Cfg):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dk_ref, dv_ref) = unpack_refs(
        refs, 6, cfg.has_seg
    )
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    k0 = pl.program_id(0) * bk
    k = k_ref[...]
    v = v_ref[...]
    dp = k.shape[-1]
    k_pos = k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k_seg = ks_ref[...] if cfg.has_seg else None
    k_padded = cfg.sk_pad != cfg.sk
    lo, hi = _q_block_range(k0, bk, bq, cfg)
    full = None if cfg.has_seg else _q_full_range(k0, bk, bq, cfg)

    def group_body(g, carry):
        def q_body(i, c, masked):
            q0 = i * bq
            q_pos = q0 + lax.broadcasted_iota(jnp.int32, (bq,), 0)
            q_seg = qs_ref[pl.ds(q0, bq)] if cfg.has_seg else None
            tmask = _tile_mask(q_pos, k_pos, cfg, q_seg, k_seg, k_padded, transposed=True) if masked else None

            def compute(cc):
                dk, dv = cc
                q = q_ref[pl.ds(q0, bq), g, :]
                do = do_ref[pl.ds(q0, bq), g, :]
                lse = lse_ref[g, pl.ds(q0, bq)]
                delta = delta_ref[g, pl.ds(q0, bq)]
                p_t, ds_t = _bwd_tile_t(q, k, v, do, lse, delta, tmask, cfg)
                dv = dv + dot(p_t.astype(do.dtype), do, 1, 0)
                dk = dk + dot(ds_t.astype(q.dtype), q, 1, 0)
                return dk, dv

            return _maybe_skip(tmask, cfg, compute, c)

        return _split_loop(lo, hi, full, q_body, carry)

    zeros = jnp.zeros((bk, dp), jnp.float32)
    dk, dv = lax.fori_loop(0, cfg.groups, group_body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, cfg: _Cfg):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dq_ref,) = unpack_refs(refs, 6, cfg.has_seg)
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    q0 = pl.program_id(0) * bq
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    dp = q.shape[-1]
    q_seg = qs_ref[...] if cfg.has_seg else None

    def update(dq, k, v, tmask):
        _, ds = _bwd_tile(q, k, v, do, lse, delta, tmask, cfg)
        return dq + dot(ds.astype(k.dtype), k, 1, 0)

    dq = _kv_loop(q0, bq, bk, cfg, q_seg, k_ref, v_ref, ks_ref, update, jnp.zeros((bq, dp), jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------- pallas calls
def _with_segments(cfg: _Cfg, in_specs, args, q_ids, kv_ids, q_rows: int, k_rows: int, q_blocked: bool):
    """A kernel's ``(in_specs, args)`` followed by the query and key segment ids where ``cfg`` has them (the refs
    :func:`~jaxattn.attention.tiling.unpack_refs` reads after the operands): ``q_rows`` / ``k_rows`` of each row,
    the query ids blocked along the grid's first axis and the key ids whole (``q_blocked``: the forward, dQ) or
    the other way (dK/dV)."""
    if not cfg.has_seg:
        return in_specs, args
    at_block = lambda i, bb, h: (bb, i)  # noqa: E731
    whole = lambda i, bb, h: (bb, 0)  # noqa: E731
    q_seg = pl.BlockSpec((None, q_rows), at_block if q_blocked else whole)
    k_seg = pl.BlockSpec((None, k_rows), whole if q_blocked else at_block)
    return in_specs + [q_seg, k_seg], args + [q_ids, kv_ids]


def _launch_knobs(cfg, name: str) -> tuple[int, int]:
    """(num_warps, num_stages) kernel ``name`` launches with, from a resolved ``_Cfg`` or :class:`FlashKernels`."""
    if name == "flash_fwd":
        return cfg.num_warps, cfg.num_stages
    if name == "flash_bwd_dkv":
        return cfg.num_warps_dkv, cfg.num_stages_dkv
    return cfg.num_warps_bwd, cfg.num_stages_bwd


def _call(kernel, cfg: _Cfg, *, name, grid, in_specs, out_specs, out_shapes, args):
    """:func:`~jaxattn.attention.tiling.triton_call` with the forward's or the backward's launch knobs."""
    warps, stages = _launch_knobs(cfg, name)
    return triton_call(
        kernel,
        name=name,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shapes=out_shapes,
        args=args,
        interpret=cfg.interpret,
        poison=cfg.poison,
        num_warps=warps,
        num_stages=stages,
    )


def _launch(kernel, cfg: _Cfg, name, grid, in_specs, args, out_specs, out_shapes, segments):
    """:func:`_call` of ``kernel(..., cfg=cfg)``, the segment ids after ``args`` where ``cfg`` has them
    (``segments``: ``(q_ids, kv_ids, q_rows, k_rows, q_blocked)``, :func:`_with_segments`)."""
    in_specs, args = _with_segments(cfg, in_specs, args, *segments)
    call = dict(name=name, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shapes=out_shapes, args=args)
    return _call(functools.partial(kernel, cfg=cfg), cfg, **call)


def _fwd_call(cfg: _Cfg, q, k, v, q_ids, kv_ids):
    b, sqp, hq, dp = q.shape
    skp = k.shape[1]
    g, bq = cfg.groups, cfg.block_q
    in_specs = [
        pl.BlockSpec((None, bq, None, dp), lambda i, bb, h: (bb, i, h, 0)),
        pl.BlockSpec((None, skp, None, dp), lambda i, bb, h: (bb, 0, h // g, 0)),
        pl.BlockSpec((None, skp, None, dp), lambda i, bb, h: (bb, 0, h // g, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, bq, None, dp), lambda i, bb, h: (bb, i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i)),
    ]
    out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sqp), jnp.float32)]
    grid, segments = (sqp // bq, b, hq), (q_ids, kv_ids, bq, skp, True)
    return _launch(_fwd_kernel, cfg, "flash_fwd", grid, in_specs, [q, k, v], out_specs, out_shapes, segments)


def _dkv_call(cfg: _Cfg, q, k, v, do, lse, delta, q_ids, kv_ids):
    b, sqp, hq, dp = q.shape
    skp, hkv = k.shape[1], k.shape[2]
    g, bk = cfg.groups, cfg.block_k_dkv
    kv_spec = pl.BlockSpec((None, bk, None, dp), lambda j, bb, h: (bb, j, h, 0))
    grp_spec = pl.BlockSpec((None, sqp, g, dp), lambda j, bb, h: (bb, 0, h, 0))  # the query group of h
    row_spec = pl.BlockSpec((None, g, sqp), lambda j, bb, h: (bb, h, 0))
    in_specs = [grp_spec, kv_spec, kv_spec, grp_spec, row_spec, row_spec]
    args = [q, k, v, do, lse, delta]
    out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    grid, segments = (skp // bk, b, hkv), (q_ids, kv_ids, sqp, bk, False)
    return _launch(_dkv_kernel, cfg, "flash_bwd_dkv", grid, in_specs, args, [kv_spec, kv_spec], out_shapes, segments)


def _dq_call(cfg: _Cfg, q, k, v, do, lse, delta, q_ids, kv_ids):
    b, sqp, hq, dp = q.shape
    skp = k.shape[1]
    g, bq = cfg.groups, cfg.block_q_dq
    q_spec = pl.BlockSpec((None, bq, None, dp), lambda i, bb, h: (bb, i, h, 0))
    kv_spec = pl.BlockSpec((None, skp, None, dp), lambda i, bb, h: (bb, 0, h // g, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [q, k, v, do, lse, delta]
    grid, segments = (sqp // bq, b, hq), (q_ids, kv_ids, bq, skp, True)
    out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    (dq,) = _launch(_dq_kernel, cfg, "flash_bwd_dq", grid, in_specs, args, [q_spec], out_shapes, segments)
    return dq


# ----------------------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_core(cfg: _Cfg, q, k, v, q_ids, kv_ids):
    """Padded arrays in, padded ``(out [B,Sqp,Hq,Dp], lse [B,Hq,Sqp] f32)`` out."""
    return tuple(_fwd_call(cfg, q, k, v, q_ids, kv_ids))


def _flash_core_fwd(cfg, q, k, v, q_ids, kv_ids):
    out, lse = _fwd_call(cfg, q, k, v, q_ids, kv_ids)
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _flash_core_bwd(cfg, res, cts):
    q, k, v, q_ids, kv_ids, out, lse = res
    do, dlse = cts
    return _bwd_padded(cfg, q, k, v, q_ids, kv_ids, out, lse, do, dlse) + (None, None)


def _bwd_padded(cfg: _Cfg, q, k, v, q_ids, kv_ids, out, lse, do, dlse):
    """``(dq, dk, dv)`` on padded arrays: the delta reduction, then the dkv and dq kernels."""
    do = do.astype(q.dtype)
    # d lse / d s = p, so an LSE cotangent folds into delta: ds = p * (dp - (rowsum(dO*O) - dlse)).
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    delta = delta - dlse.astype(jnp.float32)
    delta = jnp.where(jnp.isfinite(lse), delta, 0.0)
    # A row that saw no key (lse = -inf; also a block of padded query rows, which the forward never
    # visits) gets lse = +inf here, so p = exp(s - lse) is exactly 0 for it in every tile, masked or not.
    # Without this, a padded row that the mask does not exclude would give p = inf and inf * 0 = NaN.
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
    dk, dv = _dkv_call(cfg, q, k, v, do, lse, delta, q_ids, kv_ids)
    dq = _dq_call(cfg, q, k, v, do, lse, delta, q_ids, kv_ids)
    return dq, dk, dv


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)


def _pad_rows(x, n: int, dp: int):
    """Zero-pad ``[B, S, H, D]`` to ``[B, n, H, dp]``."""
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, dp - x.shape[3])))


def _pad_inputs(cfg: _Cfg, q, k, v, q_ids, kv_ids):
    dp = max(MIN_BLOCK, next_pow2(q.shape[-1]))
    qp, kp, vp = _pad_rows(q, cfg.sq_pad, dp), _pad_rows(k, cfg.sk_pad, dp), _pad_rows(v, cfg.sk_pad, dp)
    if not cfg.has_seg:
        return qp, kp, vp, None, None
    # edge padding keeps the ids of real positions; padded keys are masked by index
    q_ids = jnp.pad(q_ids.astype(jnp.int32), ((0, 0), (0, cfg.sq_pad - cfg.sq)), mode="edge")
    kv_ids = jnp.pad(kv_ids.astype(jnp.int32), ((0, 0), (0, cfg.sk_pad - cfg.sk)), mode="edge")
    return qp, kp, vp, q_ids, kv_ids


@functools.partial(jax.jit, static_argnames=("cfg", "return_lse"))
def _run(q, k, v, q_ids, kv_ids, *, cfg: _Cfg, return_lse: bool):
    out, lse = _flash_core(cfg, *_pad_inputs(cfg, q, k, v, q_ids, kv_ids))
    out = out[:, : cfg.sq, :, : q.shape[-1]]
    if return_lse:
        return out, lse[:, :, : cfg.sq]
    return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def _run_bwd(q, k, v, out, lse, do, dlse, q_ids, kv_ids, *, cfg: _Cfg):
    d = q.shape[-1]
    qp, kp, vp, q_ids, kv_ids = _pad_inputs(cfg, q, k, v, q_ids, kv_ids)
    dp, pad_q = qp.shape[-1], ((0, 0), (0, 0), (0, cfg.sq_pad - cfg.sq))
    lse = jnp.pad(lse.astype(jnp.float32), pad_q, constant_values=-jnp.inf)  # padded rows see no key
    dlse = jnp.pad(dlse.astype(jnp.float32), pad_q)
    dq, dk, dv = _bwd_padded(
        cfg,
        qp,
        kp,
        vp,
        q_ids,
        kv_ids,
        _pad_rows(out, cfg.sq_pad, dp),
        lse,
        _pad_rows(do.astype(q.dtype), cfg.sq_pad, dp),
        dlse,
    )
    return dq[:, : cfg.sq, :, :d], dk[:, : cfg.sk, :, :d], dv[:, : cfg.sk, :, :d]


# ----------------------------------------------------------------------------------------- public API
def _from_args(q, k, v, args: AttnArgs, *, return_lse=False, block_sizes=None, interpret=None, poison=False):
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be None or a flash.BlockSizes, got {type(block_sizes).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    cfg = _make_cfg(q, k, args, block_sizes, resolve_interpret(interpret, q), poison)
    return _run(q, k, v, args.q_segment_ids, args.kv_segment_ids, cfg=cfg, return_lse=bool(return_lse))


def _segment_pair(q_segment_ids, kv_segment_ids):
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "q_segment_ids and kv_segment_ids must be given together (q_ids [B, Sq], kv_ids "
            f"[B, Sk]) or both be None; got q_segment_ids={'None' if q_segment_ids is None else 'array'}"
            f", kv_segment_ids={'None' if kv_segment_ids is None else 'array'}"
        )
    return None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)


def flash_attention(
    q,
    k,
    v,
    *,
    causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    scale=None,
    window=None,
    softcap=None,
    return_lse=False,
    block_sizes=None,
    interpret=None,
    _poison_outputs=False,
):
    """Flash attention with our Pallas kernel; q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``.

    Same contract as :func:`jaxattn.attention.dot_product_attention` (bottom-right ``causal``,
    ``window=(left, right)``, ``softcap``, ``q_segment_ids [B, Sq]`` with ``kv_segment_ids [B, Sk]``,
    ``scale`` default ``1/sqrt(D)``).  Returns ``out`` in q's dtype, or ``(out, lse)`` with
    ``lse [B, Hq, Sq]`` float32 (natural log; ``-inf`` for a row that sees no key) when ``return_lse``;
    both are differentiable.  ``block_sizes`` (default :meth:`BlockSizes.default`) and ``interpret``
    (None: interpret unless jax's default backend is a GPU) are kernel knobs.  ``_poison_outputs`` (tests)
    pre-fills the kernel output buffers with NaN.
    """
    args = normalize(
        q,
        k,
        v,
        causal=causal,
        segment_ids=_segment_pair(q_segment_ids, kv_segment_ids),
        scale=scale,
        window=window,
        softcap=softcap,
    )
    return _from_args(
        q, k, v, args, return_lse=return_lse, block_sizes=block_sizes, interpret=interpret, poison=_poison_outputs
    )


def flash_backward(q, k, v, out, lse, do, args: AttnArgs, *, dlse=None, block_sizes=None, interpret=None):
    """``(dq, dk, dv)`` of attention by the flash backward kernels, from a forward computed anywhere.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, ``out``/``do`` ``[B, Sq, Hq, D]``, ``lse`` ``[B, Hq, Sq]``
    (natural log, ``-inf`` for a row that sees no key), ``args`` from :func:`normalize` for the same call;
    ``dlse`` (default none) is a cotangent of the LSE.  Gradients come back in the dtypes of q, k, v.
    """
    if not isinstance(args, AttnArgs):
        raise TypeError(f"args must be the AttnArgs that normalize() returned for this call, got {type(args).__name__}")
    b, sq, hq, _ = q.shape
    for name, x, want in (
        ("out", out, q.shape),
        ("do", do, q.shape),
        ("lse", lse, (b, hq, sq)),
        ("dlse", lse if dlse is None else dlse, (b, hq, sq)),
    ):
        if tuple(getattr(x, "shape", ())) != tuple(want):
            raise ValueError(
                f"{name} must have shape {tuple(want)} (q is {tuple(q.shape)}), got {tuple(getattr(x, 'shape', ()))}"
            )
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be None or a flash.BlockSizes, got {type(block_sizes).__name__}")
    cfg = _make_cfg(q, k, args, block_sizes, resolve_interpret(interpret, q), False)
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    dq, dk, dv = _run_bwd(q, k, v, out, lse, do, dlse, args.q_segment_ids, args.kv_segment_ids, cfg=cfg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------------------- block search
@dataclasses.dataclass(frozen=True)
class FlashKernels:
    """The three ``pallas_call``s of one call, each callable on its own (``benchmarks/block_search.py`` compiles
    and times one kernel at a time).  They take PADDED arrays: q/do ``[B, sq_pad, Hq, head_dim_pad]``, k/v
    ``[B, sk_pad, Hkv, head_dim_pad]``, lse/delta ``[B, Hq, sq_pad]`` float32 (no segment ids)::

        calls["flash_fwd"](q, k, v) -> (out, lse)
        calls["flash_bwd_dq"](q, k, v, do, lse, delta) -> dq
        calls["flash_bwd_dkv"](q, k, v, do, lse, delta) -> (dk, dv)

    ``num_warps``/``num_stages`` launch the forward, ``num_warps_bwd``/``num_stages_bwd`` the dq kernel and
    ``num_warps_dkv``/``num_stages_dkv`` the dkv kernel, as resolved from the :class:`BlockSizes` (None fields
    filled)."""

    calls: dict[str, Callable]
    sq_pad: int
    sk_pad: int
    head_dim_pad: int
    num_warps: int
    num_stages: int
    num_warps_bwd: int
    num_stages_bwd: int
    num_warps_dkv: int
    num_stages_dkv: int

    def launch(self, name: str) -> tuple[int, int]:
        """(num_warps, num_stages) of kernel ``name`` (``flash_fwd``, ``flash_bwd_dq``, ``flash_bwd_dkv``)."""
        return _launch_knobs(self, name)


def kernel_callables(
    q, k, block_sizes: BlockSizes | None = None, *, causal: bool = False, interpret: bool | None = False
) -> FlashKernels:
    """:class:`FlashKernels` for q ``[B, Sq, Hq, D]`` and k/v ``[B, Sk, Hkv, D]`` (arrays or ShapeDtypeStructs)
    with ``block_sizes`` (default :meth:`BlockSizes.default`); ``interpret=False`` gives the Triton kernels (a
    GPU or deviceless GPU compile), None follows the target as :func:`flash_attention` does."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be None or a flash.BlockSizes, got {type(block_sizes).__name__}")
    cfg = _make_cfg(q, k, normalize(q, k, k, causal=causal), block_sizes, resolve_interpret(interpret, q), False)

    def fwd(q, k, v):
        return _fwd_call(cfg, q, k, v, None, None)

    def dq(q, k, v, do, lse, delta):
        return _dq_call(cfg, q, k, v, do, lse, delta, None, None)

    def dkv(q, k, v, do, lse, delta):
        return _dkv_call(cfg, q, k, v, do, lse, delta, None, None)

    return FlashKernels(
        calls={"flash_fwd": fwd, "flash_bwd_dq": dq, "flash_bwd_dkv": dkv},
        sq_pad=cfg.sq_pad,
        sk_pad=cfg.sk_pad,
        head_dim_pad=max(MIN_BLOCK, next_pow2(q.shape[-1])),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        num_warps_bwd=cfg.num_warps_bwd,
        num_stages_bwd=cfg.num_stages_bwd,
        num_warps_dkv=cfg.num_warps_dkv,
        num_stages_dkv=cfg.num_stages_dkv,
    )


# ----------------------------------------------------------------------------------------- backend API
def supports(q, k, v, args: AttnArgs, *, target: Target | None = None):
    """None when this kernel can serve the call, else a one-line reason.

    Serves NVIDIA GPUs (Triton lowering; bf16 needs compute capability >= 8.0) and CPU (interpret mode,
    slow: meant for tests); declines other platforms and head dims > 256.  ``target``: the
    :class:`~jaxattn.attention.Target` to decide for (default: :func:`current_target` of q, read once)."""
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        return f"head_dim {d} > {MAX_HEAD_DIM}"
    target = current_target(q) if target is None else target  # a target_platform block, q's sharding, ...
    plat = target.platform
    if plat == "cpu":
        return None
    if plat != "gpu":
        return f"the Triton lowering needs an NVIDIA GPU (found {plat})"
    if plt is None:
        return "jax.experimental.pallas.triton is not importable in this jax"
    kind = str(target.device_kind or "")
    version = ""
    if jax.default_backend() == "gpu":  # a live GPU: its client tells CUDA from ROCm
        try:
            version = str(getattr(jax.devices("gpu")[0].client, "platform_version", ""))
        except Exception:  # pragma: no cover
            version = ""
    if "rocm" in version.lower() or "amd" in kind.lower() or "instinct" in kind.lower():
        return f"the Triton lowering here targets NVIDIA GPUs (found {kind or version})"
    cc = target.compute_capability
    if cc is not None and cc < (8, 0) and q.dtype == jnp.bfloat16:
        return f"bfloat16 needs compute capability >= 8.0 (found {cc[0]}.{cc[1]})"
    return None


def attention(q, k, v, args: AttnArgs):
    """Backend entry point (default block sizes, interpret iff no GPU)."""
    return _from_args(q, k, v, args)
