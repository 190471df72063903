"""Preallocated (static) KV cache for ``torchref.model.LlamaForCausalLM`` decoding (twin of ``jaxattn/kv_cache.py``).

    cache = KVCache(model.config, batch=2, max_len=64)
    logits = model(prompt_ids, cache=cache)          # prefill (right-padded prompts); cache.lengths += S
    cache.set_lengths(prompt_lengths)                 # the valid length of each row
    logits = model(next_ids[:, None], cache=cache)   # one decode step, Sq = 1

Fixed-shape tensors ``k``/``v`` ``[n_layers, B, Hkv, max_len, D]`` (the torch layout) and ``lengths [B]`` int64,
updated IN PLACE (``index_put_`` / slice assignment), so ``torch.compile`` captures the decode step with static
shapes (the JAX twin returns a new cache instead). Same rules as the JAX cache: rows are right-padded, a call with
``S`` tokens writes slots ``lengths[b] .. lengths[b] + S - 1``; ``S = 1`` attends over the slots
``slot <= lengths[b]`` (segment ids ``(1, slot <= lengths[b])``' mask, built once per step for every layer), ``S > 1``
is a prefill of an empty cache (causal among the new tokens, in the model's window). A windowed model's cache of
``max_len >= w`` slots is a ring, as in the JAX twin: position p in slot ``p % max_len``, a step sees positions
``lengths[b] - w < p <= lengths[b]``, decoding runs past ``max_len`` (``max_len = w``: a step reads w slots, not the
length). A longer prompt than the ring is prefilled into a plain cache, and :meth:`KVCache.ring_into` keeps its
window. ``append=True``: a call of ``S > 1`` tokens appends to what the cache holds (a chunked prefill, a second
turn), attending over the layer's slots in position order, as in the JAX twin (a ring takes ``S <= max_len - w + 1``,
``twincore.batch.check_append``; a plain cache drops the writes past its end).
"""

from __future__ import annotations

import torch

from twincore.batch import check_append, is_ring

from .attention import dot_product_attention, masked_attention


class KVCache:
    def __init__(self, config, batch: int, max_len: int, dtype=torch.float32, device=None, append: bool = False):
        for name, val in (("batch", batch), ("max_len", max_len)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"KVCache: {name} must be an int >= 1, got {val!r}")
        if not isinstance(append, bool):
            raise ValueError(f"KVCache: append must be a bool, got {append!r}")
        self.append = append
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.resolved_head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.window = config.sliding_window  # a token sees itself and the window - 1 before it (None: all)
        self.rows = torch.arange(batch, device=device)
        self.ring = is_ring(max_len, self.window)

    def mark_static(self) -> KVCache:
        """Marks the cache's tensors as static inputs of a ``torch.compile``d step (``torch._dynamo
        .mark_static_address``), so a CUDA-graph mode (``mode="reduce-overhead"``) records the step with its
        in-place cache writes at fixed addresses instead of skipping the graph for its mutated inputs (Hugging Face's
        static cache does the same)."""
        for t in (self.k, self.v, self.lengths, self.slots, self.rows):
            torch._dynamo.mark_static_address(t)
        return self

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def set_lengths(self, lengths) -> KVCache:
        self.lengths.copy_(torch.as_tensor(lengths, dtype=torch.long).reshape(self.lengths.shape))
        return self

    def ring_into(self, ring: KVCache) -> KVCache:
        """Fills ``ring``, a cache of fewer slots (at least the model's ``sliding_window``), with each row's last
        ``ring.max_len`` positions, position p in slot ``p % ring.max_len``, and this cache's lengths, in place
        (its tensors keep their addresses: a CUDA graph's cache); returns it. ``generate`` prefills a prompt longer
        than its ring into this plain cache and keeps the window."""
        same = lambda c: (*c.k.shape[:3], c.k.shape[4])  # noqa: E731  [n_layers, B, Hkv, D]
        if not isinstance(ring, KVCache) or same(ring) != same(self):
            got = f"a KVCache of [n_layers, B, Hkv, D] = {list(same(ring))}" if isinstance(ring, KVCache) else ring
            raise ValueError(
                f"KVCache.ring_into: ring must be a KVCache of this one's [n_layers, B, Hkv, D] = {list(same(self))}, "
                f"got {got!r}"
            )
        slots = ring.max_len
        j = torch.arange(slots, device=self.lengths.device)[None, :]  # [1, slots]
        last = self.lengths[:, None] - 1  # [B, 1]
        at = torch.clamp(last - (last - j) % slots, min=0)  # [B, slots]: the position each slot holds (0: none yet)
        index = at[None, :, None, :, None].expand(self.k.shape[0], -1, self.k.shape[2], -1, self.k.shape[4])
        ring.k.copy_(torch.gather(self.k, 3, index))
        ring.v.copy_(torch.gather(self.v, 3, index))
        ring.lengths.copy_(self.lengths)
        return ring

    def positions(self, s: int) -> torch.Tensor:
        """RoPE positions ``[B, s]`` of the next ``s`` tokens of each row."""
        return self.lengths[:, None] + torch.arange(s, device=self.lengths.device)[None, :]

    def check_call(self, shape) -> None:
        b, s = shape
        if b != self.batch:
            raise ValueError(f"cache: input_ids batch {b} != the cache's batch {self.batch}")
        if s > self.max_len:
            raise ValueError(f"cache: {s} tokens do not fit a cache of max_len {self.max_len}")
        if self.append:
            check_append(s, self.max_len, self.window)
        elif s > 1 and not torch.compiler.is_compiling() and int(self.lengths.max()) > 0:
            raise ValueError(
                f"cache: a call with {s} > 1 tokens is a prefill and needs an empty cache, got "
                f"lengths {self.lengths.tolist()}; decode one token per call"
            )

    def layers(self, s: int) -> list[LayerKV]:
        """Each layer's view for one call of ``s`` tokens. A decode step (``s == 1``) builds its mask and write slots
        here, once: the slots ``<= lengths[b]`` of row b (the filled ones and the one this step writes) are visible
        (in a ring, those holding positions in the window). Built per layer, the mask was about a fifth of an eager
        step's dispatched ops (benchmarks/NOTES.md)."""
        visible, at = None, self.lengths
        if s == 1:
            slots, last = self.slots[None, :], self.lengths[:, None]  # [1, T], [B, 1]
            if self.ring:  # slot j holds position last - back, the newest one that is j modulo T (if any)
                at = self.lengths % self.max_len
                back = (last - slots) % self.max_len
                visible = (back <= last) & (back < self.window)
            else:  # no wrap; in a cache shorter than the window no filled slot is out of it
                visible = slots <= last
            visible = visible[:, None, None, :]  # [B, 1, 1, T]
        elif self.append:  # the written slots; the slots in position order (newest last) and which are filled
            t, pos = self.max_len, self.lengths[:, None] + torch.arange(s, device=self.slots.device)[None, :]
            # [B, S]: a ring keeps every write; a plain cache drops those past its end
            kept = torch.ones_like(pos, dtype=torch.bool) if self.ring else pos < t
            at = (pos % t, kept)
            order = self.lengths[:, None] + s - t + self.slots[None, :]  # [B, T]: position lengths + s - T + j
            visible = (order % t, (order >= 0).long())
        return [LayerKV(self, i, visible, at) for i in range(self.k.shape[0])]


class LayerKV:
    """Layer ``i``'s view of a :class:`KVCache`: ``attend(q, k, v)`` writes k/v and runs attention."""

    def __init__(self, cache: KVCache, i: int, visible=None, at=None):
        # a decode step: at, each row's write slot [B]; visible, the mask [B, 1, 1, T]. An appending call: at, the
        # write slots [B, S] and which are kept; visible, the slots in position order [B, T] and the filled ones
        self.cache, self.i, self.visible, self.at = cache, i, visible, at

    def attend(self, q, k, v):
        """q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, Hq, S, D]``."""
        c, s = self.cache, q.shape[2]
        kc, vc = c.k[self.i], c.v[self.i]  # views [B, Hkv, T, D]
        if s == 1:  # decode: write slot lengths[b] of each row (modulo T in a ring), attend over the visible slots
            kc[c.rows, :, self.at] = k[:, :, 0].to(kc.dtype)
            vc[c.rows, :, self.at] = v[:, :, 0].to(vc.dtype)
            return masked_attention(q, kc.to(q.dtype), vc.to(q.dtype), self.visible)
        w = self.cache.window
        window = None if w is None else (w - 1, None)
        if c.append:  # write the tokens' slots, attend over the layer's slots in position order (causal bottom-right)
            (cols, kept), (order, kv_ids) = self.at, self.visible
            rows = c.rows[:, None].expand_as(cols)[kept]  # [N]: the kept writes
            kc[rows, :, cols[kept]] = k.transpose(1, 2)[kept].to(kc.dtype)  # [N, Hkv, D]
            vc[rows, :, cols[kept]] = v.transpose(1, 2)[kept].to(vc.dtype)
            index = order[:, None, :, None].expand(-1, kc.shape[1], -1, kc.shape[3])  # [B, Hkv, T, D]
            k_seq, v_seq = (torch.gather(x, 2, index).to(q.dtype) for x in (kc, vc))
            ids = (torch.ones(q.shape[0], s, dtype=torch.long, device=q.device), kv_ids)
            return dot_product_attention(q, k_seq, v_seq, causal=True, segment_ids=ids, window=window)
        kc[:, :, :s] = k.to(kc.dtype)  # prefill of an empty cache
        vc[:, :, :s] = v.to(vc.dtype)
        return dot_product_attention(q, k, v, causal=True, window=window)
