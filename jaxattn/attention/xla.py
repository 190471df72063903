"""``xla`` backend: attention as plain ``jnp`` math (the twin of torch SDPA's MATH backend).

Materialises the full ``[B, Hkv, G, Sq, Sk]`` score tensor, so memory is O(Sq*Sk); it is the readable
reference the other backends are tested against and the CPU default.  Scores and softmax are computed in
float32 whatever the input dtype (``preferred_element_type=float32`` on the q@k^T product, so bf16/fp16
inputs are multiplied exactly and accumulated in fp32); for bf16/fp16 inputs the probabilities are cast
to the input dtype before the p@v product (fp32 accumulation), as flash kernels and
``jax.nn.dot_product_attention`` do.  GQA reshapes q to ``[B, S, Hkv, G, D]`` instead of repeating K/V.
A query row that sees no key gives zeros (and zero gradients), never NaN.  Differentiable by autodiff.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import AttnArgs, mask

__all__ = ["supports", "attention", "scores_mask"]


def supports(q, k, v, args: AttnArgs):
    """The xla backend serves every call that ``normalize`` accepts."""
    return None


def scores_mask(q_len: int, kv_len: int, args: AttnArgs):
    """The visibility mask shaped to broadcast against ``[B, Hkv, G, Sq, Sk]`` scores."""
    m = mask(q_len, kv_len, args)
    if m.ndim == 3:  # [B, Sq, Sk] from segment ids
        return m[:, None, None]
    return m[None, None, None]


def attention(q, k, v, args: AttnArgs):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    f32 = jnp.float32
    qg = q.reshape(b, sq, hkv, g, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=f32,
                   precision=jax.lax.Precision.HIGHEST) * args.scale
    if args.softcap is not None:
        c = args.softcap
        s = c * jnp.tanh(s / c)
    m = scores_mask(sq, sk, args)
    s = jnp.where(m, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(s - row_max)  # exactly 0 where masked
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)  # a row with no visible key stays all-zero
    pv_dtype = f32 if q.dtype == f32 else v.dtype
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(pv_dtype), v, preferred_element_type=f32,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, sq, hq, d).astype(q.dtype)
