"""The attention oracle: the full contract (design §4) in plain ``jnp``, float32, ``Precision.HIGHEST``.

Every kernel test (xla, chunked, flash, mosaic) compares against this one function.  q ``[B, Sq, Hq, D]``,
k/v ``[B, Sk, Hkv, D]`` in any accepted dtype (upcast to float32); returns the output ``[B, Sq, Hq, D]``
float32 and, with ``return_lse``, the natural-log log-sum-exp ``[B, Hq, Sq]`` float32 (``-inf`` for a row
that sees no key, whose output and gradients are zero).  Differentiable by autodiff (it materialises the
``[B, Hkv, G, Sq, Sk]`` scores: for tests, not for speed)::

    out, lse = attention_reference(q, k, v, causal=True, window=(128, None), return_lse=True)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .args import mask, normalize

__all__ = ["attention_reference"]


def attention_reference(
    q, k, v, *, causal=False, segment_ids=None, scale=None, window=None, softcap=None, return_lse=False
):
    """``softmax(mask(softcap(scale * q k^T))) v`` in float32; arguments as
    :func:`jaxattn.attention.dot_product_attention` (``segment_ids`` ``[B, S]`` or ``(q_ids, kv_ids)``)."""
    args = normalize(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, window=window, softcap=softcap)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r} of type {type(return_lse).__name__}")
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = q.astype(f32).reshape(b, sq, hkv, hq // hkv, d)  # head h reads kv head h // G
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(f32), precision=hi) * args.scale
    if args.softcap is not None:
        s = args.softcap * jnp.tanh(s / args.softcap)
    vis = mask(sq, sk, args)  # [Sq, Sk], or [B, Sq, Sk] with segment ids
    vis = vis[:, None, None] if vis.ndim == 3 else vis[None, None, None]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p / l_safe, v.astype(f32), precision=hi).reshape(b, sq, hq, d)
    if not return_lse:
        return out
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]  # [B, Hkv, G, Sq]
    return out, lse.reshape(b, hq, sq)
