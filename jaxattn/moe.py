"""Mixture of Experts for the JAX model (twin: ``torchref/moe.py``): the router, its load-balancing and z losses, and
the experts' SwiGLUs — dropless (tokens sorted by expert, one ``jax.lax.ragged_dot`` per projection) or with a
capacity factor (static ``[rows, experts, capacity]`` buffers; assignments past an expert's capacity are dropped).

    y, stats = moe_block(x, p, cfg)          # x [B, S, dim]; p: one layer's router / e_gate / e_up / e_down
    losses = moe_losses(stats, cfg)          # stats stacked over layers -> aux_loss, z_loss, tokens_per_expert, ...

Router (transformers' Mixtral / Qwen3-MoE order): float32 logits, softmax, top-k of the probabilities, then the k
weights renormalised to sum to 1 when ``cfg.norm_topk_prob``. Load balancing is ``load_balancing_loss_func``'s
(Switch Transformer eqs. 4-6 pooled over every layer): ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k
assignments and ``P_e`` the mean router probability of expert e, over the real tokens of all layers; the z-loss is
ST-MoE's ``mean(logsumexp(logits)^2)`` (§2.2 of Zoph et al. 2022). Written on ``jax.lax`` because no JAX library
keeps transformers' exact numbers; the capacity rule (token-major priority within a batch row, MaxText's) is ours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .quant import QArray

__all__ = ["route", "moe_block", "moe_losses", "expert_weight", "STAT_KEYS"]

# Per-layer statistics a block returns (summed over its tokens): the model stacks them over layers.
STAT_KEYS = ("counts", "probs", "z", "tokens", "kept", "routed")


def expert_weight(w, dtype) -> jax.Array:
    """An expert weight ``[E, in, out]`` in ``dtype``; an int8 one (``jaxattn.quant.QArray``) dequantized in that
    dtype, as ``jaxattn.quant.matmul`` does."""
    if isinstance(w, QArray):
        return w.q.astype(dtype) * w.scale.astype(dtype)
    return w.astype(dtype)


def route(x: jax.Array, router: jax.Array, cfg) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``x [T, dim]`` -> ``(logits [T, E] f32, probs [T, E] f32, weights [T, k] f32, experts [T, k] int32)``."""
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.experts_per_token)  # [T, k], descending
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, probs, weights, experts.astype(jnp.int32)


def _swiglu(x, p, matmul):
    gate = checkpoint_name(matmul(x, expert_weight(p["e_gate"], x.dtype)), "mlpwi_0")
    up = checkpoint_name(matmul(x, expert_weight(p["e_up"], x.dtype)), "mlpwi_1")
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden")
    return matmul(hidden, expert_weight(p["e_down"], x.dtype))


def _dropless(x, weights, experts, p, n_experts):
    """``x [T, dim]``: every assignment computed. Sorted by expert (stable), one grouped GEMM per projection."""
    t, k = experts.shape
    flat = experts.reshape(t * k)
    order = jnp.argsort(flat, stable=True)  # [T*k] assignments grouped by expert
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [E]
    xs = x[order // k]  # [T*k, dim]
    ys = _swiglu(xs, p, lambda a, w: jax.lax.ragged_dot(a, w, sizes))  # [T*k, dim]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)  # back in (token, choice) order
    out = jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights)
    return out.astype(x.dtype), sizes


def _with_capacity(x, weights, experts, p, n_experts, capacity):
    """``x [B, S, dim]``: per batch row each expert takes its first ``capacity`` assignments in (token, choice)
    order; the rest are dropped (contribute 0). Static shapes: ``[B, E, capacity, dim]`` buffers."""
    b, s, k = experts.shape
    flat = experts.reshape(b, s * k)  # [B, S*k], token-major
    onehot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)  # [B, S*k, E]
    pos = jnp.sum(jnp.cumsum(onehot, axis=1) * onehot, axis=-1) - 1  # [B, S*k] place in its expert's queue
    keep = pos < capacity
    slot = jnp.where(keep, flat * capacity + pos, n_experts * capacity)  # dropped -> a spare slot
    rows = jnp.arange(b)[:, None]
    xr = jnp.broadcast_to(x[:, :, None, :], (b, s, k, x.shape[-1])).reshape(b, s * k, -1)  # [B, S*k, dim]
    buf = jnp.zeros((b, n_experts * capacity + 1, x.shape[-1]), x.dtype).at[rows, slot].set(xr)
    buf = buf[:, :-1].reshape(b, n_experts, capacity, -1)  # [B, E, C, dim]
    ys = _swiglu(buf, p, lambda a, w: jnp.einsum("becd,edf->becf", a, w))  # [B, E, C, dim]
    ys = jnp.concatenate([ys.reshape(b, n_experts * capacity, -1), jnp.zeros_like(ys[:, 0, :1])], axis=1)
    y = ys[rows, slot].reshape(b, s, k, -1)  # [B, S, k, dim]; dropped read the zero slot
    w = jnp.where(keep.reshape(b, s, k), weights.reshape(b, s, k), 0.0)
    out = jnp.einsum("bskd,bsk->bsd", y.astype(jnp.float32), w)
    kept = jnp.sum(onehot * keep[..., None], axis=(0, 1)).astype(jnp.int32)  # [E]
    return out.astype(x.dtype), kept


def moe_block(x: jax.Array, p, cfg, mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The sparse MLP: ``x [B, S, dim]`` -> ``(y [B, S, dim], stats)``. ``mask [B, S]`` (bool; None = all): the
    real tokens, the only ones the balance and z statistics count (transformers' ``attention_mask``); padding is
    still routed and computed. ``stats``: :data:`STAT_KEYS` sums for :func:`moe_losses`."""
    b, s, d = x.shape
    e, k = cfg.n_experts, cfg.experts_per_token
    logits, probs, weights, experts = route(x.reshape(b * s, d), p["router"], cfg)  # [T, E], [T, k]
    capacity = cfg.expert_capacity(s)
    if capacity is None:
        y, kept = _dropless(x.reshape(b * s, d), weights, experts, p, e)
        y = y.reshape(b, s, d)
    else:
        y, kept = _with_capacity(x, weights.reshape(b, s, k), experts.reshape(b, s, k), p, e, capacity)
    m = jnp.ones((b * s,), jnp.float32) if mask is None else mask.reshape(b * s).astype(jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=1)  # [T, E]: 1 where chosen
    lse = jax.nn.logsumexp(logits, axis=-1)  # [T]
    stats = {
        "counts": jax.lax.stop_gradient(m @ chosen),  # [E] top-k assignments of real tokens
        "probs": m @ probs,  # [E]
        "z": jnp.sum(m * lse * lse),
        "tokens": jnp.sum(m),
        "kept": kept,  # [E] assignments computed (all tokens)
        "routed": jnp.asarray(b * s * k, jnp.int32),
    }
    return y, stats


def moe_losses(stats: dict, cfg) -> dict:
    """Per-layer ``stats`` stacked on a leading layer axis -> ``aux_loss`` (transformers' load-balancing loss, NOT
    multiplied by ``router_aux_loss_coef``), ``z_loss`` (likewise unweighted), ``tokens_per_expert [L, E]`` and
    ``dropped_fraction`` (of the top-k assignments, 0 when dropless)."""
    n = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)  # real tokens x layers
    f = jnp.sum(stats["counts"], axis=0) / n  # [E]
    share = jnp.sum(stats["probs"], axis=0) / n  # [E]
    routed = jnp.sum(stats["routed"]).astype(jnp.float32)
    return {
        "aux_loss": cfg.n_experts * jnp.sum(f * share),
        "z_loss": jnp.sum(stats["z"]) / n,
        "tokens_per_expert": stats["kept"],
        "dropped_fraction": 1.0 - jnp.sum(stats["kept"]).astype(jnp.float32) / routed,
    }
