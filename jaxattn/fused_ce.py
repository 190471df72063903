"""Fused linear + cross-entropy: the LM head and the token loss in chunks of tokens, never the whole logits.

    loss = fused_cross_entropy(hidden, head, targets, weights, chunk=1024)   # = cross_entropy(hidden @ head, ...)
    loss = fused_cross_entropy(hidden, embed, targets, weights, transposed=True)   # tied head: hidden @ embed.T

``hidden`` ``[N, dim]`` (the final-norm hidden states, any float dtype), ``head`` ``[dim, vocab]`` (``[vocab, dim]``
with ``transposed=True``), ``targets`` int ``[N]``, ``weights`` float32 ``[N]``; the result is
``sum(w * nll) / denominator`` (default ``max(sum(w), 1)``) exactly as ``train_step.cross_entropy`` computes it from
full logits, with targets of weight 0 dropped before the softmax (a NaN there stays out). The tokens are cut into
chunks of ``chunk`` (the last padded with weight 0); a ``lax.scan`` computes each chunk's float32 logits
``[chunk, vocab]``, its log-sum-exp and the target logit, and keeps only the per-token log-sum-exp ``[N]`` for the
backward, as two floats: the max logit ``m`` and ``log(sum(exp(logits - m)))`` (one float32 ``m + log-sum`` rounds at
``ulp(m)``, and with it the softmax of logits near 1e4). The backward (``custom_vjp``) scans again, recomputes each
chunk's logits, forms
``dlogits = (softmax - onehot(target)) * w / denominator`` and produces ``d hidden = dlogits @ head.T`` per chunk and
``d head`` summed over chunks in float32 — Liger-Kernel's FusedLinearCrossEntropy and Apple's Cut Cross-Entropy,
written as a scan because neither runs on a CPU (written by hand: no jax library has one). Memory: one chunk's
``[chunk, vocab]`` float32 logits and their gradient instead of ``[N, vocab]``; compute: the head matmul runs twice
in the backward (once to recompute the logits, then the two gradient matmuls), i.e. 4 instead of 3 head matmuls.
Sharded (a batch split over devices), call it on each device's rows (``shard_map``; ``train_step`` does, through
``jaxattn.model.per_shard``): under plain GSPMD every chunk step would gather the head and reduce its gradient.
The twin is ``torchref/fused_ce.py``; ``parity_tests/test_fused_ce.py`` checks both against the dense loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from twincore.loss import DEFAULT_CHUNK

__all__ = ["fused_cross_entropy", "DEFAULT_CHUNK"]


def _check(hidden, head, targets, weights, chunk, transposed):
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_cross_entropy: hidden must be [N, dim] with targets and weights [N]; got hidden "
            f"{list(hidden.shape)}, targets {list(targets.shape)}, weights {list(weights.shape)}"
        )
    dim = head.shape[1] if transposed else head.shape[0]
    if head.ndim != 2 or dim != hidden.shape[1]:
        layout = "[vocab, dim] (transposed=True)" if transposed else "[dim, vocab]"
        raise ValueError(
            f"fused_cross_entropy: head must be {layout} with dim={hidden.shape[1]}; got {list(head.shape)}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"fused_cross_entropy: chunk must be a positive int (tokens per chunk), got {chunk!r}")


def fused_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    denominator: jax.Array | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    transposed: bool = False,
) -> jax.Array:
    """Weighted mean token cross-entropy of ``hidden @ head`` (see the module docstring); float32 scalar."""
    _check(hidden, head, targets, weights, chunk, transposed)
    weights = weights.astype(jnp.float32)
    if denominator is None:
        denominator = jnp.maximum(jnp.sum(weights), 1.0)
    n = hidden.shape[0]
    chunk = min(chunk, max(n, 1))
    pad = -n % chunk
    if pad:  # the last chunk padded with weight-0 tokens
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))
        weights = jnp.pad(weights, (0, pad))
    return _fused(
        hidden, head, targets.astype(jnp.int32), weights, jnp.asarray(denominator, jnp.float32), chunk, transposed
    )


def _chunk_logits(x, head, transposed):
    """float32 logits ``[chunk, vocab]`` of one chunk, as the model's head computes them."""
    w = head.astype(x.dtype)
    if transposed:
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _masked(logits, t, w):
    """Logits and targets of weight-0 tokens replaced by 0 (as ``train_step.cross_entropy`` does)."""
    keep = w > 0
    return jnp.where(keep[:, None], logits, 0.0), jnp.where(keep, t, 0)


def _max_and_log_sum(logits):
    """``(m, log(sum(exp(logits - m))))`` per token ``[chunk]`` each: the log-sum-exp with the max kept apart."""
    m = jnp.max(logits, axis=-1)
    return m, jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))


def _split(a, chunk):
    return a.reshape(a.shape[0] // chunk, chunk, *a.shape[1:])  # [n_chunks, chunk, ...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused(hidden, head, targets, weights, denominator, chunk, transposed):
    return _fused_fwd(hidden, head, targets, weights, denominator, chunk, transposed)[0]


def _fused_fwd(hidden, head, targets, weights, denominator, chunk, transposed):
    def body(total, xs):
        x, t, w = xs
        logits, t = _masked(_chunk_logits(x, head, transposed), t, w)
        m, log_sum = _max_and_log_sum(logits)  # [chunk] each
        target_logit = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return total + jnp.sum(((m - target_logit) + log_sum) * w), (m, log_sum)

    total, lse = jax.lax.scan(
        body, jnp.float32(0), (_split(hidden, chunk), _split(targets, chunk), _split(weights, chunk))
    )
    return total / denominator, (hidden, head, targets, weights, denominator, lse)


def _fused_bwd(chunk, transposed, res, g):
    hidden, head, targets, weights, denominator, lse = res
    scale = g / denominator

    def body(dhead, xs):
        x, t, w, (m, log_sum) = xs
        logits, t = _masked(_chunk_logits(x, head, transposed), t, w)
        probs = jnp.exp((logits - m[:, None]) - log_sum[:, None])  # softmax, from the forward's log-sum-exp
        dlogits = (probs - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)) * (w * scale)[:, None]
        dlogits_c = dlogits.astype(x.dtype)  # the head's compute dtype, float32 accumulation below
        w_c = head.astype(x.dtype)
        if transposed:  # logits = x @ head.T: dx = dlogits @ head, dhead = dlogits.T @ x
            dx = jnp.dot(dlogits_c, w_c, preferred_element_type=jnp.float32)
            dw = jnp.dot(dlogits_c.T, x, preferred_element_type=jnp.float32)
        else:  # logits = x @ head: dx = dlogits @ head.T, dhead = x.T @ dlogits
            dx = jnp.dot(dlogits_c, w_c.T, preferred_element_type=jnp.float32)
            dw = jnp.dot(x.T, dlogits_c, preferred_element_type=jnp.float32)
        return dhead + dw, dx.astype(x.dtype)

    xs = (_split(hidden, chunk), _split(targets, chunk), _split(weights, chunk), lse)  # lse: 2 x [n_chunks, chunk]
    dhead, dx = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), xs)
    dhidden = dx.reshape(hidden.shape)
    return dhidden, dhead.astype(head.dtype), None, jnp.zeros_like(weights), jnp.zeros_like(denominator)


_fused.defvjp(_fused_fwd, _fused_bwd)
