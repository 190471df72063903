"""Llama-style decoder in Flax NNX, the twin of ``torchref/model.py``.

Embedding -> n_layers x [RMSNorm -> GQA attention with RoPE -> residual, RMSNorm -> SwiGLU MLP -> residual]
-> RMSNorm -> LM head. Layer parameters are stacked along a leading ``n_layers`` axis and the layers run under
``jax.lax.scan``, so compile time does not grow with depth. Weights are stored in the JAX ``[in, out]`` layout
(``jaxattn.hf`` transposes to and from Hugging Face's ``[out, in]``).

The model computes in the dtype of its parameters: a precision policy casts the parameter state from outside
(``jaxattn.precision``), the layer code stays dtype-agnostic. RMSNorm statistics, the softmax (inside the
attention backends) and the logits are float32. ``layer_wrapper`` (default ``None``) lets remat policies wrap
the per-layer function from outside without touching the layer code.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import dot_product_attention
from .config import ModelConfig

LAYER_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm", "mlp_norm")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: statistics in float32, scale applied after casting back to the input dtype."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


def rope_cos_sin(inv_freq: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[B, S, 1, head_dim]`` in float32 for integer ``positions [B, S]``."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF ``rotate_half`` convention: x * cos + rotate_half(x) * sin (computed in float32)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def attention_block(x, p, cos, sin, cfg: ModelConfig, segment_ids=None):
    """Self-attention sub-block for one layer: x [B, S, dim] -> [B, S, dim] (no residual, no norm)."""
    b, s, _ = x.shape
    d = cfg.resolved_head_dim
    q = (x @ p["wq"]).reshape(b, s, cfg.n_heads, d)
    k = (x @ p["wk"]).reshape(b, s, cfg.n_kv_heads, d)
    v = (x @ p["wv"]).reshape(b, s, cfg.n_kv_heads, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids)
    return o.reshape(b, s, cfg.n_heads * d) @ p["wo"]


def mlp_block(x, p):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def decoder_layer(x, p, cos, sin, cfg: ModelConfig, segment_ids=None):
    """One pre-norm decoder layer; ``p`` holds this layer's (unstacked) parameters."""
    x = x + attention_block(rms_norm(x, p["attn_norm"], cfg.norm_eps), p, cos, sin, cfg, segment_ids)
    return x + mlp_block(rms_norm(x, p["mlp_norm"], cfg.norm_eps), p)


def set_value(variable: nnx.Variable, value) -> None:
    """Assign a Variable's value on any flax 0.12+ (``set_value`` where it exists, ``.value =`` before)."""
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:  # pragma: no cover - older flax
        variable.value = value


class Layers(nnx.Module):
    """All decoder layers' parameters, stacked: each leaf has a leading ``n_layers`` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        n, dim, d, f = cfg.n_layers, cfg.dim, cfg.resolved_head_dim, cfg.ffn_dim
        init = nnx.initializers.normal(0.02)

        def w(*shape):
            return nnx.Param(init(rngs.params(), (n, *shape), param_dtype))

        self.wq, self.wk, self.wv = w(dim, cfg.n_heads * d), w(dim, cfg.n_kv_heads * d), w(dim, cfg.n_kv_heads * d)
        self.wo = w(cfg.n_heads * d, dim)
        self.w_gate, self.w_up, self.w_down = w(dim, f), w(dim, f), w(f, dim)
        self.attn_norm = nnx.Param(jnp.ones((n, dim), param_dtype))
        self.mlp_norm = nnx.Param(jnp.ones((n, dim), param_dtype))


class Llama(nnx.Module):
    """Llama-style causal LM. ``model(tokens, positions=None, segment_ids=None)`` -> float32 logits [B, S, V]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.config = config
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.dim),
                                                             param_dtype))
        self.layers = Layers(config, rngs=rngs, param_dtype=param_dtype)
        self.norm = nnx.Param(jnp.ones((config.dim,), param_dtype))
        if not config.tie_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (config.dim, config.vocab_size),
                                                                   param_dtype))
        self.inv_freq = nnx.Variable(jnp.asarray(config.rope_inv_freq()))  # constant, not a trained Param
        self.layer_wrapper: Optional[Callable] = None

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an int array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        elif positions.shape != tokens.shape:
            raise ValueError(f"positions must have the tokens' shape {tokens.shape}, got {positions.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids must have the tokens' shape {tokens.shape}, got {segment_ids.shape}")
        cos, sin = rope_cos_sin(self.inv_freq[...], positions)

        layer = lambda x, p: decoder_layer(x, p, cos, sin, cfg, segment_ids)  # noqa: E731
        if self.layer_wrapper is not None:
            layer = self.layer_wrapper(layer)
        stacked = {name: getattr(self.layers, name)[...] for name in LAYER_PARAMS}
        x = jnp.take(self.embed[...], tokens, axis=0)
        x, _ = jax.lax.scan(lambda h, p: (layer(h, p), None), x, stacked)
        x = rms_norm(x, self.norm[...], cfg.norm_eps)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        return jnp.dot(x, head.astype(x.dtype), preferred_element_type=jnp.float32)
