"""Preallocated KV cache for ``jaxattn.model.Llama`` decoding (twin of ``torchref/kv_cache.py``).

    cache = KVCache.init(model.config, batch=2, max_len=64)
    logits, cache = model(prompt_tokens, cache=cache)         # prefill (right-padded prompts)
    cache = cache.with_lengths(prompt_lengths)                 # the valid length of each row
    logits, cache = model(next_tokens[:, None], cache=cache)  # one decode step, Sq = 1

A pytree of static shapes, ``k``/``v`` ``[n_layers, B, max_len, Hkv, D]`` and ``lengths [B]``, so the decode step
compiles once. Rows are right-padded: row ``b`` holds its tokens at slots ``0 .. lengths[b] - 1`` with positions
``0, 1, ...`` as when it runs alone; a call with ``S`` tokens writes slots ``lengths[b] .. lengths[b] + S - 1``.
A decode step (``S = 1``) attends over the cache through the attention contract with segment ids (1 for the
visible slots, 0 for the rest), so the active ``attention_backend`` picks the kernel (``flash_decode``, the split-K
kernel, when asked); a prefill (``S > 1``) needs an empty cache and attends causally (in the window). The caller
keeps ``lengths + S <= max_len`` (``jaxattn.generate`` sizes the cache so), except in a ring.

A ring: with the model's ``sliding_window`` w and ``max_len >= w``, position p lives in slot ``p % max_len`` and
a decode step sees the slots holding positions ``lengths - w < p <= lengths``, so decoding runs past ``max_len``
while the cache holds only the window (Hugging Face's sliding-window cache; ``max_len = w`` is the smallest, a
step then reads w slots instead of the length). Until it wraps, a ring is the plain cache slot for slot. A prefill
needs a slot per token: a longer prompt fills a plain cache, whose :meth:`KVCache.ring` keeps the window.

A cache made with ``append=True`` takes calls of ``S > 1`` tokens on what it holds (a chunked prefill, a second turn:
``jaxattn.generate``'s ``prefill_chunk``): the tokens are written at their slots and attend over the layer's slots
read in position order (newest last), causally and in the window, the empty ones masked by segment ids, through the
attention contract. In a ring that needs ``S <= max_len - w + 1``, so a call never writes over a slot its own first
query still sees (nor, with right padding, over one that a row's next token sees); a plain cache drops the writes
past its end.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from twincore.batch import check_append, is_ring

from .attention import dot_product_attention

# The CPU's model programs read each layer's slots and write every layer's keys after the layer scan
# (``cached_attention``'s ``layer=None``); False: the carried cache of the GPU's and TPU's programs, on the CPU too
# (the tests run that way there).
WRITE_AFTER_THE_SCAN_ON_CPU = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [n_layers, B, max_len, Hkv, D]
    v: jax.Array  # [n_layers, B, max_len, Hkv, D]
    lengths: jax.Array  # [B] int32: tokens held per row
    append: bool = dataclasses.field(default=False, metadata=dict(static=True))  # S > 1 appends (module docstring)

    @classmethod
    def init(cls, config, batch: int, max_len: int, dtype=jnp.float32, append: bool = False) -> KVCache:
        for name, val in (("batch", batch), ("max_len", max_len)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                raise ValueError(f"KVCache.init: {name} must be an int >= 1, got {val!r}")
        if not isinstance(append, (bool, np.bool_)):
            raise ValueError(f"KVCache.init: append must be a bool, got {append!r}")
        shape = (config.n_layers, batch, int(max_len), config.n_kv_heads, config.resolved_head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32), bool(append))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def with_lengths(self, lengths) -> KVCache:
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32).reshape(self.lengths.shape))

    def ring(self, slots: int) -> KVCache:
        """A ring of ``slots`` slots (for a model whose ``sliding_window`` is at most ``slots``) holding each row's
        last ``slots`` positions, position p in slot ``p % slots``; the lengths are kept. ``generate`` prefills a
        prompt longer than its ring into a plain cache and keeps this of it."""
        if not isinstance(slots, (int, np.integer)) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"KVCache.ring: slots must be an int >= 1, got {slots!r}")
        j = jnp.arange(slots)[None, :]  # [1, slots]
        last = self.lengths[:, None] - 1  # [B, 1]
        at = jnp.maximum(last - (last - j) % slots, 0)  # [B, slots]: the position each slot holds (0: none yet)
        take = lambda c: jnp.take_along_axis(c, at[None, :, :, None, None], axis=2)  # noqa: E731
        return dataclasses.replace(self, k=take(self.k), v=take(self.v))

    def written(self, k: jax.Array, v: jax.Array, window: int | None = None) -> KVCache:
        """This cache after a call of ``S`` tokens: every layer's new keys and values ``k``/``v`` ``[n_layers, B, S,
        Hkv, D]`` written at their slots (one scatter each, in place where the cache is donated; past a plain cache's
        end: dropped), the lengths advanced by ``S``. ``window``: the model's ``sliding_window`` (a ring's slots)."""
        rows, cols = _slots(self.lengths, k.shape[2], self.max_len, is_ring(self.max_len, window))
        write = lambda c, x: c.at[:, rows, cols].set(x.astype(c.dtype), mode="drop")  # noqa: E731
        return dataclasses.replace(self, k=write(self.k, k), v=write(self.v, v), lengths=self.lengths + k.shape[2])

    def positions(self, s: int) -> jax.Array:
        """RoPE positions ``[B, s]`` of the next ``s`` tokens of each row."""
        return self.lengths[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]

    def check_call(self, tokens_shape) -> None:
        """Shape checks of a model call with this cache (and, when concrete, the empty-cache rule of prefill;
        :func:`cached_attention` checks an appending call's length against the window)."""
        b, s = tokens_shape
        if b != self.batch:
            raise ValueError(f"cache: tokens batch {b} != the cache's batch {self.batch}")
        if s > self.max_len:
            raise ValueError(f"cache: {s} tokens do not fit a cache of max_len {self.max_len}")
        if s > 1 and not self.append:
            try:
                lengths = np.asarray(self.lengths)
            except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
                return  # under jit: the caller's contract
            if lengths.max() > 0:
                raise ValueError(
                    f"cache: a call with {s} > 1 tokens is a prefill and needs an empty cache, got "
                    f"lengths {lengths.tolist()}; decode one token per call"
                )


def _slots(lengths, s: int, t: int, ring: bool):
    """``(rows [B, 1], cols [B, S])``: where a call of ``s`` tokens writes in a cache of ``t`` slots (position
    ``lengths[b] + j``, modulo ``t`` in a ring; past ``t`` in a plain cache: dropped by the writes)."""
    cols = lengths[:, None] + jnp.arange(s)[None, :]  # [B, S]: the positions written
    return jnp.arange(lengths.shape[0])[:, None], cols % t if ring else cols


def cached_attention(q, k, v, k_cache, v_cache, layer, lengths, window: int | None = None, append: bool = False):
    """One layer's attention over its cache. The call's new keys and values ``k``/``v`` ``[B, S, Hkv, D]`` go at slot
    ``lengths[b]`` of each row (``lengths[b] % T`` in a ring) and the queries attend over the layer's slots; returns
    ``(o [B, S, Hq, D], kv)``. Two ways, one result:

    * ``layer`` an index: ``k_cache``/``v_cache`` are the stacked cache ``[n_layers, B, T, Hkv, D]``, carried through
      the layer scan; the call's keys are written into it, then the layer is read; ``kv = (k_cache, v_cache)``
      written (in place where XLA can: the GPU's and TPU's programs).
    * ``layer`` None: ``k_cache``/``v_cache`` are the layer's slots ``[B, T, Hkv, D]`` before the call; the call's
      keys are written into this copy only, and ``kv = (k, v)``, for one write of every layer's after the scan
      (:meth:`KVCache.written`). XLA:CPU copies a carried cache whole, twice per layer, when it is written and
      read in one layer, and jax 0.10 converts a carried bf16 cache to float32 per layer (benchmarks/NOTES.md, "A
      conversation's next turn"): the CPU's programs take this way (``jaxattn.model``).

    ``window``: the model's ``sliding_window`` (a token sees itself and the ``window - 1`` before it); ``append``: the
    cache's (a call of ``S > 1`` tokens attends over the slots too)."""
    t = k_cache.shape[-3]
    ring, contract_window = is_ring(t, window), None if window is None else (window - 1, None)  # the contract's window
    b, s = q.shape[:2]
    rows, cols = _slots(lengths, s, t, ring)
    if layer is None:  # the layer's slots, this call's written into them: [B, T, Hkv, D]; the cache after the scan
        kv = (k, v)
        if s == 1 or append:
            k_layer = k_cache.at[rows, cols].set(k.astype(k_cache.dtype), mode="drop")
            v_layer = v_cache.at[rows, cols].set(v.astype(v_cache.dtype), mode="drop")
    else:  # the stacked cache written, then this layer read
        kv = (
            k_cache.at[layer, rows, cols].set(k.astype(k_cache.dtype), mode="drop"),
            v_cache.at[layer, rows, cols].set(v.astype(v_cache.dtype), mode="drop"),
        )
        if s == 1 or append:
            k_layer, v_layer = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in kv)
    if s == 1:  # decode: every filled slot (including the one just written) in the window, none of the empty ones
        slots, last = jnp.arange(t)[None, :], lengths[:, None]  # [1, T], [B, 1]
        if ring:  # slot j holds position last - back, the newest one that is j modulo T (if any)
            back = (last - slots) % t
            seen = (back <= last) & (back < window)
        else:  # no wrap; in a cache shorter than the window no filled slot is out of it
            seen = slots <= last
        kv_ids = seen.astype(jnp.int32)  # [B, T]
        q_ids = jnp.ones((b, 1), jnp.int32)
        o = dot_product_attention(q, k_layer.astype(q.dtype), v_layer.astype(q.dtype), segment_ids=(q_ids, kv_ids))
    elif append:  # the layer's slots in position order, newest last: causal and window align bottom-right
        check_append(s, t, window)
        at = (lengths[:, None] + s + jnp.arange(t)[None, :]) % t  # [B, T]: the slot of position lengths + s - T + j
        kv_ids = (lengths[:, None] + s - t + jnp.arange(t)[None, :] >= 0).astype(jnp.int32)  # [B, T]: filled
        k_layer, v_layer = (jnp.take_along_axis(c, at[:, :, None, None], 1) for c in (k_layer, v_layer))  # [B,T,Hkv,D]
        ids = (jnp.ones((b, s), jnp.int32), kv_ids)
        o = dot_product_attention(
            q, k_layer.astype(q.dtype), v_layer.astype(q.dtype), causal=True, segment_ids=ids, window=contract_window
        )
    else:  # prefill of an empty cache: causal among the new tokens
        o = dot_product_attention(q, k, v, causal=True, window=contract_window)
    return o, kv
