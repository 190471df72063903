"""Mixture of Experts for the JAX model (twin: ``torchref/moe.py``): the router, its load-balancing and z losses, and
the experts' SwiGLUs — dropless (tokens sorted by expert, one grouped GEMM per projection: ``jax.lax.ragged_dot``,
or on a GPU our Pallas kernel ``jaxattn.grouped_matmul``, see :data:`GROUPED_GEMM`) or with a
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

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .attention.target import platform_of
from .quant import QArray

__all__ = [
    "route",
    "moe_block",
    "moe_losses",
    "expert_weight",
    "grouped_gemm",
    "GROUPED_GEMMS",
    "STAT_KEYS",
    "EXPERT_PARALLEL",
]

# Per-layer statistics a block returns (summed over its tokens): the model stacks them over layers.
STAT_KEYS = ("counts", "probs", "z", "tokens", "kept", "routed")

# Per-device seam (no mesh here): ``None`` (the block on the whole arrays) unless ``jaxattn.sharding``'s
# ``activation_sharding(mesh)`` sets a ``(x, p, cfg, mask) -> (y, stats)`` that runs :func:`moe_block` on each
# device's rows under ``shard_map`` (tokens routed locally; with an ``expert`` mesh axis, expert parallelism).
EXPERT_PARALLEL: contextvars.ContextVar = contextvars.ContextVar("jaxattn_expert_parallel", default=None)


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
    gate = checkpoint_name(matmul(x, expert_weight(p["e_gate"], x.dtype)), "gate_proj")
    up = checkpoint_name(matmul(x, expert_weight(p["e_up"], x.dtype)), "up_proj")
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden")
    return matmul(hidden, expert_weight(p["e_down"], x.dtype))


def _group_order(keys: jax.Array, n_groups: int) -> tuple[jax.Array, jax.Array]:
    """``(order, sizes)``: the stable permutation grouping ``keys [N]`` (ints in ``[0, n_groups)``) by value —
    ``keys[order]`` ascending, equal keys in their original order — and the group sizes. A counting sort (one-hot
    ranks, one scatter), not ``argsort``: XLA:GPU lowers a sort of more than 16K keys to CUB, whose scratch size it
    asks the CUDA runtime for while compiling, so a deviceless compile fails on it."""
    onehot = jax.nn.one_hot(keys, n_groups, dtype=jnp.int32)  # [N, G]
    sizes = jnp.sum(onehot, axis=0)  # [G]
    rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # [N] place within its group
    dest = (jnp.cumsum(sizes) - sizes)[keys] + rank  # [N] position in the grouped order
    return jnp.zeros_like(keys).at[dest].set(jnp.arange(keys.shape[0], dtype=keys.dtype)), sizes


def _dropless(x, weights, experts, n_experts, grouped):
    """``x [T, dim]``: every assignment computed. Sorted by expert (stable); ``grouped(rows, sizes)`` runs the
    experts' SwiGLU on rows grouped by expert (``sizes [E]``): one grouped GEMM per projection, or
    :func:`_exchange_grouped`'s all-to-all round trip."""
    t, k = experts.shape
    flat = experts.reshape(t * k)
    order, sizes = _group_order(flat, n_experts)  # [T*k] assignments grouped by expert, [E]
    ys = grouped(x[order // k], sizes)  # [T*k, dim]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)  # back in (token, choice) order
    out = jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights)
    return out.astype(x.dtype), sizes


GROUPED_GEMMS = ("auto", "xla", "pallas")
# The grouped GEMM's implementation: "auto" (our Pallas kernel, jaxattn.grouped_matmul, when the trace targets a GPU,
# where XLA lowers ragged_dot to dense masked dots; jax.lax.ragged_dot elsewhere), "xla" or "pallas" (interpreted
# off a GPU: the CPU tests' parity).
GROUPED_GEMM: contextvars.ContextVar = contextvars.ContextVar("jaxattn_grouped_gemm", default="auto")


@contextlib.contextmanager
def grouped_gemm(name: str):
    """Within the block, traced MoE blocks run their expert GEMMs with ``name`` (one of :data:`GROUPED_GEMMS`)."""
    if name not in GROUPED_GEMMS:
        raise ValueError(f"grouped_gemm: {name!r} is not one of {GROUPED_GEMMS}")
    token = GROUPED_GEMM.set(name)
    try:
        yield
    finally:
        GROUPED_GEMM.reset(token)


def _ragged(a, w, sizes):
    """``a [M, K]`` rows grouped by ``sizes [G]`` times ``w [G, K, N]``, by the :data:`GROUPED_GEMM` choice."""
    name = GROUPED_GEMM.get()
    if name == "pallas" or (name == "auto" and platform_of(a) == "gpu"):
        from .grouped_matmul import grouped_matmul  # Pallas on first use: importing it starts jax's TPU probing

        return grouped_matmul(a, w, sizes)
    return jax.lax.ragged_dot(a, w, sizes)


def _local_grouped(p):
    return lambda rows, sizes: _swiglu(rows, p, lambda a, w: _ragged(a, w, sizes))


def _exchange_grouped(p, axis: str, n: int, k: int):
    """Expert parallelism, dropless: this device's rows (grouped by expert, ``sizes [E]``) go to the ``n`` devices
    of ``axis`` that own ``E / n`` experts each (``p`` holds this device's), and come back computed.

    ``all_to_all`` needs equal-sized blocks, so each destination gets a block of ``R = T * min(k, E/n)`` rows
    (the most it can receive: a token picks an expert once), the valid rows first; ``ragged_all_to_all`` would
    send only those but XLA:CPU cannot run it. The received rows are regrouped by local expert (padding last,
    outside the group sizes, so the grouped GEMM skips it)."""

    def grouped(rows, sizes):
        total, d = rows.shape
        e_local = sizes.shape[0] // n
        per_rank = sizes.reshape(n, e_local)  # [n, E/n]
        r = total // k * min(k, e_local)  # T tokens send each expert at most T rows, a device at most T*k
        to_rank = jnp.sum(per_rank, axis=1)  # [n] rows for each destination
        dest = jnp.repeat(jnp.arange(n), to_rank, total_repeat_length=total)  # [T*k] sorted
        start = jnp.cumsum(to_rank) - to_rank  # [n]
        pos = jnp.arange(total) - start[dest]
        send = jnp.zeros((n, r, d), rows.dtype).at[dest, pos].set(rows)  # [n, R, dim]
        recv = jax.lax.all_to_all(send, axis, 0, 0)  # [n sources, R, dim]
        counts = jax.lax.all_to_all(per_rank, axis, 0, 0)  # [n sources, E/n]: what each source sent per expert
        ends = jnp.cumsum(counts, axis=1)  # [n, E/n]
        local = jnp.sum(jnp.arange(r)[None, :, None] >= ends[:, None, :], axis=-1)  # [n, R]; E/n = padding
        order = _group_order(local.reshape(n * r), e_local + 1)[0]
        ys = _swiglu(recv.reshape(n * r, d)[order], p, lambda a, w: _ragged(a, w, jnp.sum(counts, 0)))
        back = jax.lax.all_to_all(jnp.zeros_like(ys).at[order].set(ys).reshape(n, r, d), axis, 0, 0)
        return back[dest, pos]  # [T*k, dim] in this device's sorted order

    return grouped


def _with_capacity(x, weights, experts, n_experts, capacity, buffers):
    """``x [B, S, dim]``: per batch row each expert takes its first ``capacity`` assignments in (token, choice)
    order; the rest are dropped (contribute 0). Static shapes: ``buffers([B, E, capacity, dim])`` runs the experts
    (locally, or through :func:`_exchange_buffers`)."""
    b, s, k = experts.shape
    flat = experts.reshape(b, s * k)  # [B, S*k], token-major
    onehot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)  # [B, S*k, E]
    pos = jnp.sum(jnp.cumsum(onehot, axis=1) * onehot, axis=-1) - 1  # [B, S*k] place in its expert's queue
    keep = pos < capacity
    slot = jnp.where(keep, flat * capacity + pos, n_experts * capacity)  # dropped -> a spare slot
    rows = jnp.arange(b)[:, None]
    xr = jnp.broadcast_to(x[:, :, None, :], (b, s, k, x.shape[-1])).reshape(b, s * k, -1)  # [B, S*k, dim]
    buf = jnp.zeros((b, n_experts * capacity + 1, x.shape[-1]), x.dtype).at[rows, slot].set(xr)
    ys = buffers(buf[:, :-1].reshape(b, n_experts, capacity, -1))  # [B, E, C, dim]
    ys = jnp.concatenate([ys.reshape(b, n_experts * capacity, -1), jnp.zeros_like(ys[:, 0, :1])], axis=1)
    y = ys[rows, slot].reshape(b, s, k, -1)  # [B, S, k, dim]; dropped read the zero slot
    w = jnp.where(keep.reshape(b, s, k), weights.reshape(b, s, k), 0.0)
    out = jnp.einsum("bskd,bsk->bsd", y.astype(jnp.float32), w)
    kept = jnp.sum(onehot * keep[..., None], axis=(0, 1)).astype(jnp.int32)  # [E]
    return out.astype(x.dtype), kept


def _local_buffers(p):
    return lambda buf: _swiglu(buf, p, lambda a, w: jnp.einsum("becd,edf->becf", a, w))


def _exchange_buffers(p, axis: str, n: int):
    """Expert parallelism with a capacity (GShard): the ``[B, E, C, dim]`` buffers split over experts, one
    ``all_to_all`` to the owners of ``E / n`` experts each, computed there, and one back."""

    def buffers(buf):
        b, e, c, d = buf.shape
        send = buf.transpose(1, 0, 2, 3).reshape(n, e // n, b * c, d)  # [n owners, E/n, B*C, dim]
        recv = jax.lax.all_to_all(send, axis, 0, 0)  # [n sources, E/n, B*C, dim]
        local = recv.transpose(1, 0, 2, 3).reshape(e // n, n * b * c, d)
        ys = _swiglu(local, p, lambda a, w: jnp.einsum("ecd,edf->ecf", a, w))  # [E/n, n*B*C, dim]
        back = jax.lax.all_to_all(ys.reshape(e // n, n, b * c, d).transpose(1, 0, 2, 3), axis, 0, 0)
        return back.reshape(e, b, c, d).transpose(1, 0, 2, 3)  # [B, E, C, dim]

    return buffers


def moe_block(
    x: jax.Array, p, cfg, mask: jax.Array | None = None, *, expert_axis: str | None = None, expert_shards: int = 1
) -> tuple[jax.Array, dict]:
    """The sparse MLP: ``x [B, S, dim]`` -> ``(y [B, S, dim], stats)``. ``mask [B, S]`` (bool; None = all): the
    real tokens, the only ones the balance and z statistics count (transformers' ``attention_mask``); padding is
    still routed and computed. ``stats``: :data:`STAT_KEYS` sums for :func:`moe_losses`.

    Under ``jaxattn.sharding`` (the :data:`EXPERT_PARALLEL` seam) each device runs this on its rows inside
    ``shard_map``; with ``expert_axis`` (``expert_shards`` devices) ``p`` holds this device's ``E / n`` experts and
    the assignments travel to their experts' devices and back by all-to-all."""
    hook = EXPERT_PARALLEL.get()
    if hook is not None and expert_axis is None:
        return hook(x, p, cfg, mask)
    b, s, d = x.shape
    e, k = cfg.n_experts, cfg.experts_per_token
    logits, probs, weights, experts = route(x.reshape(b * s, d), p["router"], cfg)  # [T, E], [T, k]
    capacity = cfg.expert_capacity(s)
    ep = expert_axis is not None and expert_shards > 1
    if capacity is None:
        grouped = _exchange_grouped(p, expert_axis, expert_shards, k) if ep else _local_grouped(p)
        y, kept = _dropless(x.reshape(b * s, d), weights, experts, e, grouped)
        y = y.reshape(b, s, d)
    else:
        buffers = _exchange_buffers(p, expert_axis, expert_shards) if ep else _local_buffers(p)
        y, kept = _with_capacity(x, weights.reshape(b, s, k), experts.reshape(b, s, k), e, capacity, buffers)
    m = jnp.ones((b * s,), jnp.float32) if mask is None else mask.reshape(b * s).astype(jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=1)  # [T, E]: 1 where chosen
    lse = jax.nn.logsumexp(logits, axis=-1)  # [T]
    stats = {
        "counts": m @ chosen,  # [E] top-k assignments of real tokens (integer-valued: no gradient)
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
    ``dropped_fraction`` (of the top-k assignments, 0 when dropless). Stats with a micro-batch axis before the
    layer axis (``[m, L, ...]``, a pipeline's): each micro-batch's losses, as one process's accumulation blocks have
    them, averaged (``tokens_per_expert`` then ``[m, L, E]``)."""
    if stats["tokens"].ndim == 2:  # [m, L]
        each = jax.vmap(lambda st: moe_losses(st, cfg))(stats)
        return {k: v if k == "tokens_per_expert" else jnp.mean(v) for k, v in each.items()}
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
