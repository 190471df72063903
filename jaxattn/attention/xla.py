"""``xla`` backend: attention as plain ``jnp`` math (the twin of torch SDPA's MATH backend); the CPU default.

Materialises the ``[B, Hkv, G, Sq, Sk]`` scores (O(Sq*Sk) memory); GQA reshapes q to ``[B, Sq, Hkv, G, D]``
instead of repeating K/V.  Dtypes: q@k^T is taken in the input dtype with fp32 accumulation
(``preferred_element_type``), softmax in fp32, and for bf16/fp16 inputs the probabilities are cast to the
input dtype before the p@v product (fp32 accumulation), as flash kernels and ``jax.nn.dot_product_attention``
do; the output has q's dtype.  One query per row (a decode step) takes the two products as a multiply and a sum
over D, then over Sk, in fp32 (the same products and fp32 sums): XLA's dot wants the batch dims (B, Hkv) outermost
and copied K and V transposed for it every step (benchmarks/NOTES.md, "A ring KV cache"). More queries go to that
layout first, ``[B, Hkv, G, S, D]``, so no O(Sq*Sk) block is transposed (NOTES, "`chunked`'s blocks in the
layout").  A row that sees no key gives zeros and zero gradients.  Differentiable by autodiff.  Tests compare it
with :func:`jaxattn.attention.reference.attention_reference`::

    out = attention(q, k, v, normalize(q, k, v, causal=True))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .args import AttnArgs, mask

__all__ = ["supports", "attention"]


def supports(q, k, v, args: AttnArgs):
    """The xla backend serves every call that ``normalize`` accepts."""
    return None


def attention(q, k, v, args: AttnArgs):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    qg = q.reshape(b, sq, hkv, hq // hkv, d)
    if sq == 1:  # decode: one pass over K in its own layout, no transposed copy
        s = jnp.sum(qg[:, 0, None].astype(f32) * k[:, :, :, None].astype(f32), axis=-1)  # [B, Sk, Hkv, G]
        s = jnp.transpose(s, (0, 2, 3, 1))[:, :, :, None] * args.scale  # [B, Hkv, G, 1, Sk]
    else:  # heads-major operands, so the dot writes the [B, Hkv, G, Sq, Sk] block in place (no transposed copy of it)
        qh = jnp.transpose(qg, (0, 2, 3, 1, 4))  # [B, Hkv, G, Sq, D]
        kh, vh = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, Hkv, Sk, D]
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qh, kh, preferred_element_type=f32, precision=hi) * args.scale
    if args.softcap is not None:
        s = args.softcap * jnp.tanh(s / args.softcap)
    m = mask(sq, sk, args)
    s = jnp.where(m[:, None, None] if m.ndim == 3 else m, s, -jnp.inf)  # [B, Sq, Sk] ids -> per batch
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(s - row_max)  # exactly 0 where masked
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)  # a row with no visible key stays all-zero
    pv_dtype = f32 if q.dtype == f32 else v.dtype
    if sq == 1:  # decode: one pass over V
        pk = jnp.transpose(p[:, :, :, 0].astype(pv_dtype).astype(f32), (0, 3, 1, 2))  # [B, Sk, Hkv, G]
        out = jnp.sum(pk[..., None] * v[:, :, :, None].astype(f32), axis=1)[:, None]  # [B, 1, Hkv, G, D]
    else:
        out = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(pv_dtype), vh, preferred_element_type=f32, precision=hi)
        out = jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, Sq, Hkv, G, D]
    return out.reshape(b, sq, hq, d).astype(q.dtype)
