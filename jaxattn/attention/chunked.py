"""``chunked`` backend: memory-efficient attention in pure JAX (the twin of torch's EFFICIENT_ATTENTION).

q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, the full contract of design §4.  Queries go in chunks,
each with a ``lax.scan`` over key chunks and an online softmax (Rabe & Staats 2021; the FlashAttention
recurrence), so only one ``[B, Hkv, G, Cq, Ck]`` score block exists at a time: O(S) memory.  A
``jax.custom_vjp`` saves only q, k, v, the output and the log-sum-exp and recomputes score blocks in the
backward (FlashAttention-2), so the backward is O(S) too (autodiff through the scan would keep every
block).  Key chunks hidden by the causal/window mask or by the segment ids are skipped; any length works
(padded and masked). Chunks default to 512, 256 on a CPU (finer skipping; no tile to fill)::

    out = chunked_attention(q, k, v, causal=True, q_chunk_size=256, kv_chunk_size=512)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from twincore.attention import visible_bounds

from .args import AttnArgs, mask, normalize
from .target import current_target

__all__ = ["supports", "attention", "chunked_attention", "default_chunks", "DEFAULT_Q_CHUNK", "DEFAULT_KV_CHUNK"]

DEFAULT_Q_CHUNK = 512
DEFAULT_KV_CHUNK = 512
# a CPU's: a 256-key window at S = 4096 ran in 0.6x the time of 512's, a plain causal call no slower
# (benchmarks/NOTES.md, "torch's FlexAttention beside SDPA and JAX's default, on masks")
CPU_CHUNK = 256
_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


class _Cfg(NamedTuple):  # static, hashable
    causal: bool
    scale: float
    window: tuple | None
    softcap: float | None
    q_len: int
    kv_len: int
    cq: int
    ck: int
    has_ids: bool


def supports(q, k, v, args: AttnArgs):
    """The chunked backend serves every call that ``normalize`` accepts."""
    return None


def default_chunks(platform: str) -> tuple[int, int]:
    """``(q_chunk_size, kv_chunk_size)`` when none is given, for a trace targeting ``platform``."""
    return (CPU_CHUNK, CPU_CHUNK) if platform == "cpu" else (DEFAULT_Q_CHUNK, DEFAULT_KV_CHUNK)


def attention(q, k, v, args: AttnArgs, *, q_chunk_size: int | None = None, kv_chunk_size: int | None = None):
    if q_chunk_size is None or kv_chunk_size is None:
        dq, dkv = default_chunks(current_target(q).platform)
        q_chunk_size = dq if q_chunk_size is None else q_chunk_size
        kv_chunk_size = dkv if kv_chunk_size is None else kv_chunk_size
    for name, c in (("q_chunk_size", q_chunk_size), ("kv_chunk_size", kv_chunk_size)):
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"{name} must be a positive int, got {c!r}")
    sq, sk = q.shape[1], k.shape[1]
    cfg = _Cfg(
        args.causal,
        float(args.scale),
        args.window,
        args.softcap,
        sq,
        sk,
        min(q_chunk_size, sq),
        min(kv_chunk_size, sk),
        args.has_segment_ids,
    )
    if args.has_segment_ids:
        qids, kvids = args.q_segment_ids.astype(jnp.int32), args.kv_segment_ids.astype(jnp.int32)
    else:  # dummies, never read
        qids = jnp.zeros((q.shape[0], sq), jnp.int32)
        kvids = jnp.zeros((q.shape[0], sk), jnp.int32)
    return _chunked(cfg, q, k, v, qids, kvids)


def chunked_attention(
    q,
    k,
    v,
    *,
    causal=False,
    segment_ids=None,
    scale=None,
    window=None,
    softcap=None,
    q_chunk_size: int | None = None,
    kv_chunk_size: int | None = None,
):
    """Public op with the contract's keywords plus the chunk sizes (q ``[B,Sq,Hq,D]``, k/v ``[B,Sk,Hkv,D]``; None:
    :func:`default_chunks` of the trace's platform)."""
    args = normalize(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, window=window, softcap=softcap)
    return attention(q, k, v, args, q_chunk_size=q_chunk_size, kv_chunk_size=kv_chunk_size)


# --------------------------------------------------------------------------------------------- helpers
def _pad_to(x, axis: int, n: int):
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, extra)
    return jnp.pad(x, pads)


def _chunks(x, c: int, axis: int = 1):
    """Split ``axis`` (padded up to a multiple of c) into chunks stacked first: [..., S, ...] -> [S/c, ..., c, ...]."""
    n = -(-x.shape[axis] // c)
    x = _pad_to(x, axis, n * c)
    return jnp.moveaxis(x.reshape(x.shape[:axis] + (n, c) + x.shape[axis + 1 :]), axis, 0)


def _unchunk(x, s: int, axis: int = 1):
    """The inverse of :func:`_chunks`: [n, ..., c, ...] -> [..., s, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(x, 0, s, axis=axis)


def _heads_major(x, hkv: int):
    """[B, S, H, D] -> [B, Hkv, G, S, D] (G = H / Hkv; G = 1 for keys and values): every block's matmul then
    reads its operands as they lie, one [G*c, D] by [D, c] per (batch, kv head), no copy in the loops."""
    b, s, h, d = x.shape
    return jnp.transpose(x.reshape(b, s, hkv, h // hkv, d), (0, 2, 3, 1, 4))


def _seq_major(x):
    """[B, Hkv, G, S, D] -> [B, S, Hkv * G, D], the inverse of :func:`_heads_major`."""
    b, hkv, g, s, d = x.shape
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, s, hkv * g, d)


def _kv_chunks(cfg: _Cfg, k, v):
    """k, v ``[B, Sk, Hkv, D]`` -> key-chunked ``[nk, B, Hkv, ck, D]`` each."""
    return tuple(_chunks(_heads_major(x, x.shape[2])[:, :, 0], cfg.ck, 2) for x in (k, v))


def _block_needed(cfg: _Cfg, q0, k0, qidc, kidc):
    """False when the causal/window rule, or the segment ids (``qidc [B, cq]``, ``kidc [B, ck]``), hide the whole
    [q0, q0+cq) x [k0, k0+ck) block (a scalar). Ids: hidden when in every row the two chunks' id ranges do not meet,
    which never hides an equal pair (padding, id 0, only widens a range)."""
    shift = cfg.kv_len - cfg.q_len
    q_first, q_last = q0 + shift, q0 + cfg.cq - 1 + shift  # absolute positions
    k_first, k_last = k0, k0 + cfg.ck - 1
    ok = jnp.asarray(True)
    left, right = visible_bounds(cfg.causal, cfg.window)
    if left is not None:
        ok = ok & (k_last >= q_first - left)
    if right is not None:
        ok = ok & (k_first <= q_last + right)
    if cfg.has_ids:
        meet = (qidc.min(axis=1) <= kidc.max(axis=1)) & (kidc.min(axis=1) <= qidc.max(axis=1))  # [B]
        ok = ok & meet.any()
    return ok


def _cap(cfg: _Cfg, s):
    """The softcap, ``(c * tanh(s / c), tanh(s / c))`` (the second for its derivative); ``(s, None)`` without one."""
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _block_mask(cfg: _Cfg, q0, k0, qidc, kidc):
    """Visibility of the [q0, q0+cq) x [k0, k0+ck) block: ``[cq, ck]``, or ``[B, cq, ck]`` with segment ids."""
    margs = AttnArgs(causal=cfg.causal, window=cfg.window)
    q_pos = q0 + jnp.arange(cfg.cq, dtype=jnp.int32)
    kv_pos = k0 + jnp.arange(cfg.ck, dtype=jnp.int32)
    ids = (qidc, kidc) if cfg.has_ids else ()
    return mask(cfg.q_len, cfg.kv_len, margs, *ids, q_pos=q_pos, kv_pos=kv_pos)


def _scores(cfg: _Cfg, qc, kc, q0, k0, qidc, kidc):
    """Masked (and capped) fp32 scores [B, Hkv, G, cq, ck] of ``qc [B, Hkv, G, cq, D]`` and ``kc [B, Hkv, ck, D]``;
    also tanh(s/c) for the softcap derivative."""
    s, t = _cap(cfg, jnp.einsum("bhgqd,bhkd->bhgqk", qc, kc, preferred_element_type=_F32, precision=_HI) * cfg.scale)
    m = _block_mask(cfg, q0, k0, qidc, kidc)
    return jnp.where(m[:, None, None] if cfg.has_ids else m, s, -jnp.inf), t


def _low(x, like):
    """Cast fp32 probabilities to the input dtype for the next matmul (no-op for fp32 inputs)."""
    return x if like.dtype == _F32 else x.astype(like.dtype)


# --------------------------------------------------------------------------------------------- forward
def _forward(cfg: _Cfg, q, k, v, qids, kvids):
    """``(out [B, Sq, Hq, D], lse [B, Hkv, G, Sq])``."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qch = _chunks(_heads_major(q, hkv), cfg.cq, 3)  # [nq, B, Hkv, G, cq, D]
    kch, vch = _kv_chunks(cfg, k, v)  # [nk, B, Hkv, ck, D]
    qidch, kidch = _chunks(qids, cfg.cq), _chunks(kvids, cfg.ck)
    nq, nk = qch.shape[0], kch.shape[0]
    k_starts = jnp.arange(nk, dtype=jnp.int32) * cfg.ck

    def q_step(_, xs):
        qc, qidc, q0 = xs

        def kv_step(carry, ys):
            kc, vc, kidc, k0 = ys

            def compute(carry):
                m, l, acc = carry
                s, _ = _scores(cfg, qc, kc, q0, k0, qidc, kidc)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(s - m_safe[..., None])
                l = alpha * l + p.sum(axis=-1)
                pv = jnp.einsum("bhgqk,bhkd->bhgqd", _low(p, vc), vc, preferred_element_type=_F32, precision=_HI)
                return m_new, l, alpha[..., None] * acc + pv

            carry = jax.lax.cond(_block_needed(cfg, q0, k0, qidc, kidc), compute, lambda c: c, carry)
            return carry, None

        init = (
            jnp.full((b, hkv, g, cfg.cq), -jnp.inf, _F32),
            jnp.zeros((b, hkv, g, cfg.cq), _F32),
            jnp.zeros((b, hkv, g, cfg.cq, d), _F32),
        )
        (m, l, acc), _ = jax.lax.scan(kv_step, init, (kch, vch, kidch, k_starts))
        alive = l > 0
        out = acc / jnp.where(alive, l, 1.0)[..., None]
        lse = jnp.where(alive, m + jnp.log(jnp.where(alive, l, 1.0)), 0.0)  # 0 for rows with no key
        return None, (out.astype(q.dtype), lse)  # [B, Hkv, G, cq, D], [B, Hkv, G, cq]

    q_starts = jnp.arange(nq, dtype=jnp.int32) * cfg.cq
    _, (out, lse) = jax.lax.scan(q_step, None, (qch, qidch, q_starts))
    return _seq_major(_unchunk(out, sq, 3)), _unchunk(lse, sq, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(cfg, q, k, v, qids, kvids):
    return _forward(cfg, q, k, v, qids, kvids)[0]


def _chunked_fwd(cfg, q, k, v, qids, kvids):
    out, lse = _forward(cfg, q, k, v, qids, kvids)
    return out, (q, k, v, qids, kvids, out, lse)


# --------------------------------------------------------------------------------------------- backward
def _scores_t(cfg: _Cfg, kc, qtc, q0, k0, qidc, kidc):
    """The backward's scores transposed, ``[B, Hkv, ck, G*cq]`` from ``kc [B, Hkv, ck, D]`` and the query chunk as
    ``qtc [B, Hkv, D, G*cq]``: every product of the block then reads and writes its operands as they lie (the
    forward's orientation would transpose P and dS for dV and dK). Also tanh(s/c) for the softcap derivative."""
    s, t = _cap(cfg, jnp.einsum("bhkd,bhdn->bhkn", kc, qtc, preferred_element_type=_F32, precision=_HI) * cfg.scale)
    m = jnp.swapaxes(_block_mask(cfg, q0, k0, qidc, kidc), -1, -2)  # [(B,) ck, cq]
    g = s.shape[-1] // cfg.cq
    m = jnp.broadcast_to(m[..., None, :], m.shape[:-1] + (g, cfg.cq)).reshape(m.shape[:-1] + (s.shape[-1],))
    return jnp.where(m[:, None] if cfg.has_ids else m, s, -jnp.inf), t


def _chunked_bwd(cfg, res, dout):
    q, k, v, qids, kvids, out, lse = res
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    n = g * cfg.cq  # a query chunk's rows of one kv head
    qh, doh = _heads_major(q, hkv), _heads_major(dout.astype(q.dtype), hkv)  # [B, Hkv, G, Sq, D]
    delta = jnp.sum(doh.astype(_F32) * _heads_major(out, hkv).astype(_F32), axis=-1)  # [B, Hkv, G, Sq]
    qch, doch = _chunks(qh, cfg.cq, 3), _chunks(doh, cfg.cq, 3)  # [nq, B, Hkv, G, cq, D]
    lsech, deltach = _chunks(lse, cfg.cq, 3), _chunks(delta, cfg.cq, 3)  # [nq, B, Hkv, G, cq]
    qidch, kidch = _chunks(qids, cfg.cq), _chunks(kvids, cfg.ck)
    kch, vch = _kv_chunks(cfg, k, v)  # [nk, B, Hkv, ck, D]
    ktch = jnp.swapaxes(kch, -1, -2)  # [nk, B, Hkv, D, ck]
    nq, nk = qch.shape[0], kch.shape[0]
    k_starts = jnp.arange(nk, dtype=jnp.int32) * cfg.ck
    q_starts = jnp.arange(nq, dtype=jnp.int32) * cfg.cq

    def q_step(dkv, xs):
        qc, doc, lsec, deltac, qidc, q0 = xs
        qn, don = qc.reshape(b, hkv, n, d), doc.reshape(b, hkv, n, d)  # [B, Hkv, N, D]
        qtc, dotc = jnp.swapaxes(qn, -1, -2), jnp.swapaxes(don, -1, -2)  # [B, Hkv, D, N]
        lse_n, delta_n = lsec.reshape(b, hkv, 1, n), deltac.reshape(b, hkv, 1, n)

        def kv_step(dqt, ys):
            kc, ktc, vc, kidc, k0 = ys

            def compute(dqt):
                st, t = _scores_t(cfg, kc, qtc, q0, k0, qidc, kidc)  # [B, Hkv, ck, N]
                pt = jnp.exp(st - lse_n)  # 0 where masked / dead rows
                dv = jnp.einsum("bhkn,bhnd->bhkd", _low(pt, don), don, preferred_element_type=_F32, precision=_HI)
                dpt = jnp.einsum("bhkd,bhdn->bhkn", vc, dotc, preferred_element_type=_F32, precision=_HI)
                dst = pt * (dpt - delta_n)
                if t is not None:
                    dst = dst * (1.0 - t * t)
                dst = dst * cfg.scale
                dk = jnp.einsum("bhkn,bhnd->bhkd", _low(dst, qn), qn, preferred_element_type=_F32, precision=_HI)
                dqt = dqt + jnp.einsum(
                    "bhdk,bhkn->bhdn", ktc, _low(dst, ktc), preferred_element_type=_F32, precision=_HI
                )  # dQ^T [B, Hkv, D, N]
                return dqt, (dk, dv)

            def skip(dqt):
                z = jnp.zeros((b, hkv, cfg.ck, d), _F32)
                return dqt, (z, z)

            return jax.lax.cond(_block_needed(cfg, q0, k0, qidc, kidc), compute, skip, dqt)

        dqt0 = jnp.zeros((b, hkv, d, n), _F32)
        dqt, (dk, dv) = jax.lax.scan(kv_step, dqt0, (kch, ktch, vch, kidch, k_starts))
        dq = jnp.moveaxis(dqt.reshape(b, hkv, d, g, cfg.cq), 2, 4)  # [B, Hkv, G, cq, D]
        return (dkv[0] + dk, dkv[1] + dv), dq

    zeros = jnp.zeros((nk, b, hkv, cfg.ck, d), _F32)
    (dk, dv), dq = jax.lax.scan(q_step, (zeros, zeros), (qch, doch, lsech, deltach, qidch, q_starts))
    dq = _seq_major(_unchunk(dq, sq, 3)).astype(q.dtype)
    dk, dv = (_seq_major(_unchunk(x, sk, 2)[:, :, None]).astype(k.dtype) for x in (dk, dv))
    return dq, dk, dv, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
