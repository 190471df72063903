"""Llama-style decoder in Flax NNX, the twin of ``torchref/model.py``.

    model = Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))     # also named LlamaForCausalLM
    logits = model(jnp.asarray([[1, 2, 3]]))        # float32 [1, 3, vocab]
    last = model(jnp.asarray([[1, 2, 3]]), logits_at=jnp.asarray([[2]]))  # [1, 1, vocab]: position 2's only
    hidden = model.features(jnp.asarray([[1, 2, 3]]))  # [1, 3, dim]: final-norm hidden states

Embedding -> n_layers x [RMSNorm -> GQA attention with RoPE, RMSNorm -> SwiGLU MLP] -> RMSNorm -> LM head, with
the layers stacked and run under ``lax.scan`` (compile time does not grow with depth); weights ``[in, out]``, the
parameters those of the table ``twincore.params``. Mixtral / Qwen3-MoE configs (``cfg.n_experts > 0``) swap the
MLP for ``jaxattn.moe.moe_block`` (Qwen3 also normalises each query / key head); ``model(tokens, moe_stats=True)``
then also returns the router's losses and loads (``jaxattn.moe.moe_losses``); a ``sliding_window`` (Mistral) reaches
the attention call as its ``window``. The model computes in its parameters'
dtype (a precision policy casts the state from outside); norm statistics, softmax, router and logits are float32.

Seams for outside code, nothing more: logical axis names on every ``nnx.Param``; ``checkpoint_name`` tags
(:data:`REMAT_NAMES`) and a remat policy NAME (``Llama.remat``, set by ``jaxattn.remat.apply``); :func:`constrain`
on hidden states and logits and :func:`per_shard` around attention, no-ops unless
``jaxattn.sharding.activation_sharding`` is active while a step traces.

Token ids: an eager call raises ValueError naming the first id outside ``[0, vocab)``; under ``jit`` an
out-of-range id embeds to zeros (never NaN) and gets no gradient (``make_train_step(..., check_ids="jit")``
checks inside jit).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from twincore import params
from twincore.batch import (
    cache_positions,
    check_logits_at,
    check_logits_at_values,
    check_model_inputs,
    check_moe_args,
    check_token_ids,
)
from twincore.tensors import REMAT_TAGS

from . import kv_cache
from .attention import dot_product_attention
from .config import ModelConfig
from .kv_cache import KVCache, cached_attention
from .moe import moe_block, moe_losses
from .quant import QArray, matmul
from .remat import wrap_layer

# Every parameter's logical axis names, from the parameter table (``twincore.params``):
# the fused heads*head_dim axis of wq/wo is "heads", of wk/wv "kv_heads".
PARAM_AXES: dict[str, tuple[str, ...]] = {r.name: r.jax_axes for r in params.ROWS}

# Logical axis names of the activations the model constrains (see ``constrain``).
ACT_AXES: tuple[str, ...] = ("batch", "seq", "embed")
LOGITS_AXES: tuple[str, ...] = ("batch", "seq", "vocab")
Q_AXES: tuple[str, ...] = ("batch", "seq", "heads", "head_dim")  # q and the attention output [B, S, Hq, D]
KV_AXES: tuple[str, ...] = ("batch", "seq", "kv_heads", "head_dim")  # k, v [B, S, Hkv, D]
SEGMENT_AXES: tuple[str, ...] = ("batch", "seq")

# checkpoint_name tags on the values a remat policy may keep: twincore.tensors, the one vocabulary (HF module names).
REMAT_NAMES: tuple[str, ...] = REMAT_TAGS


# Activation sharding seam (MaxText / torchtitan style, no mesh here): ``None`` (a no-op) unless
# ``jaxattn.sharding.activation_sharding(mesh)`` sets a ``(x, logical_axes) -> x`` that applies the constraint.
ACTIVATION_CONSTRAINT: contextvars.ContextVar = contextvars.ContextVar("jaxattn_activation_constraint", default=None)


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
    """``x`` with a sharding constraint for its logical axis names (``("batch", "seq", "embed")``, ...) when
    ``jaxattn.sharding`` activates its rules while the step is traced; else ``x`` unchanged."""
    fn = ACTIVATION_CONSTRAINT.get()
    return x if fn is None else fn(x, logical_axes)


# Per-shard seam: ``None`` (call ``fn`` on the whole arrays) unless ``jaxattn.sharding.activation_sharding(mesh)``
# sets a ``(fn, args, in_axes, out_axes) -> out`` that runs ``fn`` on each device's block (``shard_map``): for
# kernels XLA's partitioner cannot split (a Pallas / Mosaic / cuDNN custom call would otherwise be gathered whole).
PER_SHARD: contextvars.ContextVar = contextvars.ContextVar("jaxattn_per_shard", default=None)


def per_shard(fn, args: tuple, in_axes: tuple, out_axes: tuple):
    """``fn(*args)``; when ``jaxattn.sharding`` is active, run per device block of the logical axes ``in_axes``
    (one tuple of names per arg, ``None`` for an arg that is ``None``) giving an output with ``out_axes``."""
    hook = PER_SHARD.get()
    return fn(*args) if hook is None else hook(fn, args, in_axes, out_axes)


# Layer-stack seam: ``None`` (``lax.scan`` over the stacked layers) unless ``jaxattn.pipeline.pipelining(mesh, m)``
# sets a ``(layer, x, stacked, side, stats=False) -> x`` that runs the stack as pipeline stages; ``side`` holds the
# per-row inputs every layer reads (RoPE tables, segment ids), so a pipeline can split them into micro-batches with
# their rows; with ``stats`` it returns ``(x, stats [microbatches, n_layers, ...])``, each micro-batch's own.
LAYER_STACK: contextvars.ContextVar = contextvars.ContextVar("jaxattn_layer_stack", default=None)


def run_layers(layer, x: jax.Array, stacked: dict, side, stats: bool = False):
    """``layer(h, p, side)`` applied over the stacked layers (leaves ``[n_layers, ...]``), in order. ``stats``: the
    layer returns ``(h, per-layer stats)`` (an MoE's router sums) and this returns ``(h, stats stacked)`` (under a
    pipeline, with a leading micro-batch axis)."""
    hook = LAYER_STACK.get()
    if hook is not None:
        return hook(layer, x, stacked, side, stats=True) if stats else hook(layer, x, stacked, side)
    if stats:
        return jax.lax.scan(lambda h, p: layer(h, p, side), x, stacked)
    return jax.lax.scan(lambda h, p: (layer(h, p, side), None), x, stacked)[0]


try:  # an abstract value under jit / grad / vmap: its ids cannot be read
    from jax.core import Tracer as _Tracer
except ImportError:  # pragma: no cover - a jax that no longer re-exports it
    from jax._src.core import Tracer as _Tracer


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


def _self_attention(q, k, v, segment_ids, window=None):
    return dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids, window=window)


def attention_block(x, p, cos, sin, cfg: ModelConfig, segment_ids=None, kv=None):
    """Self-attention sub-block for one layer: x [B, S, dim] -> [B, S, dim] (no residual, no norm).

    ``kv = (k_cache, v_cache, layer, lengths, append)``: the stacked KV cache and this layer's index in it, or
    this layer's slots and None, then the cache's lengths and ``append``; returns ``(out, kv)`` with
    ``jaxattn.kv_cache.cached_attention``'s ``kv``. Matmuls go through
    ``quant.matmul`` (float or int8 weights)."""
    b, s, _ = x.shape
    d = cfg.resolved_head_dim
    q = checkpoint_name(linear(x, p["wq"], p.get("q_bias")), "q_proj").reshape(b, s, cfg.n_heads, d)  # [B, S, Hq, D]
    k = checkpoint_name(linear(x, p["wk"], p.get("k_bias")), "k_proj").reshape(b, s, cfg.n_kv_heads, d)  # [B,S,Hkv,D]
    v = checkpoint_name(linear(x, p["wv"], p.get("v_bias")), "v_proj").reshape(b, s, cfg.n_kv_heads, d)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's dim, before RoPE
        q = rms_norm(q, p["q_norm"], cfg.norm_eps).astype(q.dtype)  # a float32 norm weight: keep q's dtype
        k = rms_norm(k, p["k_norm"], cfg.norm_eps).astype(k.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kv is None:
        o = per_shard(
            functools.partial(_self_attention, window=cfg.attention_window),
            (q, k, v, segment_ids),  # [B, S, Hq, D]
            (Q_AXES, KV_AXES, KV_AXES, SEGMENT_AXES),
            Q_AXES,
        )
    else:
        *cache, append = kv
        o, kv = cached_attention(q, k, v, *cache, window=cfg.sliding_window, append=append)
    o = checkpoint_name(o.reshape(b, s, cfg.n_heads * d), "attn_output")  # [B, S, Hq*D]
    o = checkpoint_name(matmul(o, p["wo"]), "o_proj")  # [B, S, dim]
    return o if kv is None else (o, kv)


def linear(x, w, bias=None):
    """``x @ w`` (float or int8 ``w``, ``quant.matmul``) plus ``bias`` when there is one (Qwen2's q / k / v)."""
    y = matmul(x, w)
    return y if bias is None else y + bias.astype(y.dtype)


def mlp_block(x, p):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = checkpoint_name(matmul(x, p["w_gate"]), "gate_proj")
    up = checkpoint_name(matmul(x, p["w_up"]), "up_proj")
    return matmul(checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden"), p["w_down"])


def decoder_layer(x, p, cos, sin, cfg: ModelConfig, segment_ids=None, kv=None, moe_mask=None):
    """One pre-norm decoder layer; ``p`` holds this layer's (unstacked) parameters. With ``kv`` (this layer's
    cache, see ``attention_block``) returns ``(x, kv)``; else an MoE layer returns ``(x, stats)``
    (``jaxattn.moe.moe_block``'s router sums over the tokens ``moe_mask`` keeps) and a dense one ``x``."""
    a = attention_block(rms_norm(x, p["attn_norm"], cfg.norm_eps), p, cos, sin, cfg, segment_ids, kv)
    if kv is not None:
        a, kv = a
    x = checkpoint_name(x + a, "attention_residual")
    h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    stats = None
    if cfg.is_moe:
        h, stats = moe_block(h, p, cfg, moe_mask)
    else:
        h = mlp_block(h, p)
    x = checkpoint_name(x + h, "decoder_layer_output")
    if kv is not None:
        return x, kv
    return x if stats is None else (x, stats)


def set_value(variable: nnx.Variable, value) -> None:
    """Assign a Variable's value on any flax 0.12+ (``set_value`` where it exists, ``.value =`` before)."""
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:  # pragma: no cover - older flax
        variable.value = value


def param(row: params.ParamRow, cfg: ModelConfig, rngs: nnx.Rngs, dtype) -> nnx.Param:
    """The ``nnx.Param`` of a parameter-table row: its shape, ``normal(0.02)`` (norms: ones), and its logical axis
    names as sharding metadata.

    ``nnx.with_partitioning`` stores them under the key the installed flax reads (``out_sharding`` on flax
    0.12.3+, ``sharding_names``/``sharding`` before), so ``nnx.get_partition_spec`` finds them on each;
    ``eager_sharding=False``: the model never shards itself (no mesh inside), ``jaxattn.sharding`` does it.
    """
    init = {"norm": nnx.initializers.ones, "bias": nnx.initializers.zeros}.get(row.kind, nnx.initializers.normal(0.02))
    return nnx.Param(
        nnx.with_partitioning(init, row.jax_axes, eager_sharding=False)(rngs.params(), row.jax_shape(cfg), dtype)
    )


class Layers(nnx.Module):
    """All decoder layers' parameters, stacked: each leaf has a leading ``n_layers`` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        for row in params.layer_rows(cfg):
            setattr(self, row.name, param(row, cfg, rngs, param_dtype))


class Llama(nnx.Module):
    """Llama-style causal LM. ``model(tokens, positions=None, segment_ids=None)`` -> float32 logits [B, S, V];
    ``model(tokens, cache=kv_cache)`` -> ``(logits, kv_cache')`` (``jaxattn.kv_cache``: positions default to the
    cache's per-row lengths; inference only, no remat).

    ``logits_at``: None (every position, the default) or int indices ``[B, K]`` into the sequence axis, per row:
    then only those positions' hidden states reach the LM head and the logits are ``[B, K, V]`` (Hugging Face's
    ``logits_to_keep``, per row: a prefill of right-padded rows passes ``lengths - 1`` and never computes
    ``[B, S, V]``). Eager calls raise ValueError for an index outside ``[0, S)``; under jit it is not checked.

    ``model.features(...)`` takes the same arguments and returns the final-norm hidden states ``[B, S, dim]`` (in
    the parameters' dtype; ``(hidden, kv_cache')`` with a cache) that the LM head reads: the input of any other
    head (a classifier, an embedding pooler). It is a method, not a submodule, so the parameter tree stays the
    parameter table's; torch's twin is ``LlamaForCausalLM.model(...)`` (HF's ``LlamaModel``), also reachable as
    ``LlamaForCausalLM.features``.

    ``tokens``, ``positions``, ``segment_ids``: integer arrays ``[B, S]`` (B, S >= 1) of a dtype in
    ``twincore.dtypes.ID_DTYPES`` (bool refused). ``remat``: one of ``REMAT_POLICIES``, set from outside.
    """

    remat: str = "none"

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.config = config
        self.embed = param(params.row("embed"), config, rngs, param_dtype)  # keys drawn in the table's order
        self.layers = Layers(config, rngs=rngs, param_dtype=param_dtype)
        for row in params.global_rows(config)[1:]:  # norm, and lm_head when untied
            setattr(self, row.name, param(row, config, rngs, param_dtype))
        self.inv_freq = nnx.Variable(jnp.asarray(config.rope_inv_freq()))  # constant, not a trained Param
        self.remat = "none"

    def features(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        *,
        moe_stats: bool = False,
        moe_mask: jax.Array | None = None,
    ):
        """Final-norm hidden states ``[B, S, dim]`` (``(hidden, kv_cache')`` with a cache, ``(hidden, moe)`` with
        ``moe_stats``); see the class doc."""
        cfg = self.config
        check_model_inputs(tokens, positions, segment_ids, arg="tokens")
        check_moe_args(cfg, tokens.shape, cache, moe_stats, moe_mask)
        if not isinstance(tokens, _Tracer):  # eager: the ids are concrete and can be checked
            check_token_ids(tokens, cfg.vocab_size, arg="tokens")
        b, s = tokens.shape
        positions = cache_positions(cache, positions, segment_ids, (b, s))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        cos, sin = rope_cos_sin(self.inv_freq[...], jnp.asarray(positions))  # [B, S, 1, head_dim]
        seg = None if segment_ids is None else jnp.asarray(segment_ids)

        def layer(x, p, side):
            cos, sin, seg, mask = side
            return decoder_layer(x, p, cos, sin, cfg, seg, moe_mask=mask)

        layer = wrap_layer(layer, self.remat, "Llama.remat")  # jax.checkpoint with the named policy (jaxattn.remat)
        stacked = {r.name: getattr(self.layers, r.name)[...] for r in params.layer_rows(cfg)}  # [n_layers, ...]
        table = constrain(self.embed[...], PARAM_AXES["embed"])  # sharded runs: gathered over embed (FSDP-style)
        x = jnp.take(table, jnp.asarray(tokens), axis=0, mode="fill", fill_value=0)  # [B, S, dim]
        x = constrain(x, ACT_AXES)
        mask = None if moe_mask is None else jnp.asarray(moe_mask, bool)
        stats = None
        if cache is None and cfg.is_moe:
            x, stats = run_layers(
                lambda h, p, side: _constrain_first(layer(h, p, side)), x, stacked, (cos, sin, seg, mask), stats=True
            )
        elif cache is None:
            x = run_layers(lambda h, p, side: constrain(layer(h, p, side), ACT_AXES), x, stacked, (cos, sin, seg, mask))
        else:  # each layer writes its keys and reads its slots of the cache (two ways: kv_cache.cached_attention)
            lengths, append = cache.lengths, cache.append

            def carried(x, k_all, v_all):  # the stacked cache carried through the scan, written in place per layer
                def cached_layer(carry, xs):
                    h, k, v = carry
                    p, i = xs
                    h, (k, v) = decoder_layer(h, p, cos, sin, cfg, None, (k, v, i, lengths, append))
                    return (h, k, v), None

                return jax.lax.scan(cached_layer, (x, k_all, v_all), (stacked, jnp.arange(cfg.n_layers)))[0]

            def written_after(x, k_all, v_all):  # XLA:CPU: each layer's slots read, every layer's keys written after
                def cached_layer(h, xs):
                    p, k_layer, v_layer = xs  # [B, T, Hkv, D]: the layer's slots before this call
                    return decoder_layer(h, p, cos, sin, cfg, None, (k_layer, v_layer, None, lengths, append))

                x, (k, v) = jax.lax.scan(cached_layer, x, (stacked, k_all, v_all))  # k, v: [n_layers, B, S, Hkv, D]
                cache_after = cache.written(k, v, cfg.sliding_window)
                return x, cache_after.k, cache_after.v

            cpu = written_after if kv_cache.WRITE_AFTER_THE_SCAN_ON_CPU else carried
            x, k, v = jax.lax.platform_dependent(x, cache.k, cache.v, cpu=cpu, default=carried)
            cache = dataclasses.replace(cache, k=k, v=v, lengths=lengths + s)
        x = rms_norm(x, self.norm[...], cfg.norm_eps)  # [B, S, dim]
        if cache is not None:
            return x, cache
        return (x, moe_losses(stats, cfg)) if moe_stats else x

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        logits_at: jax.Array | None = None,
        *,
        moe_stats: bool = False,
        moe_mask: jax.Array | None = None,
    ):
        if logits_at is not None:  # checked first, as in torch's twin (whose cache is written in place)
            check_model_inputs(tokens, positions, segment_ids, arg="tokens")
            check_logits_at(logits_at, tokens.shape)
            if not isinstance(logits_at, _Tracer):
                check_logits_at_values(logits_at, tokens.shape[-1])
        x = self.features(tokens, positions, segment_ids, cache, moe_stats=moe_stats, moe_mask=moe_mask)  # [B, S, dim]
        if cache is not None:
            x, cache = x
        elif moe_stats:
            x, moe = x
        if logits_at is not None:  # only the kept positions reach the head
            x = jnp.take_along_axis(x, jnp.asarray(logits_at)[:, :, None], axis=1)  # [B, K, dim]
        if self.config.tie_embeddings:
            logits = jnp.dot(x, self.embed[...].T.astype(x.dtype), preferred_element_type=jnp.float32)
        elif isinstance(self.lm_head[...], QArray):  # int8 weight-only head (jaxattn.quant)
            logits = matmul(x, self.lm_head[...]).astype(jnp.float32)
        else:
            logits = jnp.dot(x, self.lm_head[...].astype(x.dtype), preferred_element_type=jnp.float32)
        logits = constrain(logits, LOGITS_AXES)  # [B, S or K, vocab]
        if cache is not None:
            return logits, cache
        return (logits, moe) if moe_stats else logits


# Hugging Face's (and torchref's) class name; both names work in both packages.
LlamaForCausalLM = Llama


def _constrain_first(out):
    x, stats = out
    return constrain(x, ACT_AXES), stats
