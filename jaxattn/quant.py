"""int8 weight-only quantization for ``jaxattn.model.Llama``, applied from outside (twin of ``torchref/quant.py``).

    qmodel = jaxattn.quant.quantize(model)        # a new Llama: int8 matmul weights + float32 scales

Rule (identical in both packages, so the int8 weights are bit-identical): per OUTPUT channel, symmetric,
``scale = max|w| / 127`` over the input axis (1.0 for an all-zero channel), ``q = clip(round(w / scale), -127,
127)`` with round-half-to-even, computed in float32. A quantized parameter holds a :class:`QArray` (``q`` int8 in
the model's ``[in, out]`` layout, ``scale`` float32 ``[1, out]``, both with the leading ``n_layers`` axis for the
stacked layers); the model's matmuls go through :func:`matmul`, which dequantizes the weight first, in ``x``'s
dtype, and then multiplies: ``x @ (q.astype(x.dtype) * scale.astype(x.dtype))``, as ``torchref.quant.Int8Linear``.
Why this order: ``x @ q`` sums ``|q|`` up to 127 over the input axis, so in float16 it overflows (> 65504 ->
inf, then NaN logits) wherever ``x @ w`` is merely in the tens; the dequantized weight is ``w`` to within half a
quantization step, so ``x @ (q * scale)`` is finite wherever the float model's ``x @ w`` is. Accumulating in float32
and scaling afterwards would also be safe, but torch has no float32-output fp16 matmul on every device; this
order is the same two operations in both twins (``q`` is exact in fp16 and bf16, and the products round alike).
Quantized: the parameter table's quantizable rows (``twincore.params``: every linear weight, so the seven per-layer
projections and an untied ``lm_head``); the embedding (and so a tied head) and the norms stay in float (torchao's
int8 weight-only does the same: it replaces ``nn.Linear`` only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """An int8 weight ``q [..., in, out]`` with per-output-channel float32 ``scale [..., 1, out]``."""

    q: jax.Array
    scale: jax.Array

    def __getitem__(self, key):  # ``param[...]`` and the scan's per-layer slices keep the pair together
        return QArray(self.q[key], self.scale[key])

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.size * self.q.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_array(w) -> QArray:
    """Per-output-channel (last axis) symmetric int8 of a concrete float weight ``[..., in, out]``.

    Computed on the host with numpy: XLA's CPU division is not correctly rounded (it multiplies by the divisor's
    reciprocal; 1 ulp off for many values), and on round-half-to-even ties 1 ulp flips the int8 value, so on a
    weight that sits on a grid (e.g. dequantized Q4_1) jnp would disagree with torch's IEEE division in a few
    hundred places. numpy divides exactly as torch does, so the twins' int8 weights are bit-identical."""
    try:
        w = np.asarray(jax.device_get(w))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise TypeError("quantize_array: w must be a concrete array (quantize outside jit; it runs once)") from None
    if w.ndim < 2 or not np.issubdtype(w.dtype, np.floating) and w.dtype != jnp.bfloat16:
        raise ValueError(f"quantize_array: w must be a float array [..., in, out], got {w.dtype}{list(w.shape)}")
    w = w.astype(np.float32)
    amax = np.max(np.abs(w), axis=-2, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return QArray(jnp.asarray(q), jnp.asarray(scale))


def matmul(x: jax.Array, w) -> jax.Array:
    """``x @ w`` for a float weight, ``x @ (q * scale)`` for a :class:`QArray`, the weight dequantized in ``x``'s
    dtype first (so float16 cannot overflow where the float model does not: see the module docstring)."""
    if isinstance(w, QArray):
        return x @ (w.q.astype(x.dtype) * w.scale.astype(x.dtype))
    return x @ w


def quantize(model):
    """A copy of ``model`` (a ``jaxattn.model.Llama``) with int8 weight-only :class:`QArray` parameters: the
    parameter table's quantizable rows (``twincore.params``: the linear weights, an untied head included)."""
    from flax import nnx

    from twincore import params
    from twincore.config import ModelConfig

    if not isinstance(model, nnx.Module) or not isinstance(getattr(model, "config", None), ModelConfig):
        raise TypeError(f"quantize: model must be a jaxattn.model.Llama, got {type(model).__name__}")
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # an independent copy (arrays are immutable)
    update: dict = {}
    for row in params.quantizable_rows(model.config):
        owner = out.layers if row.per_layer else out
        w = getattr(owner, row.name)[...]
        if isinstance(w, QArray):
            raise ValueError("quantize: model is already quantized")
        (update.setdefault("layers", {}) if row.per_layer else update)[row.name] = quantize_array(w)
    nnx.update(out, update)
    return out


def weight_bytes(model) -> int:
    """Bytes held by the model's ``nnx.Param`` leaves (int8 + scales for quantized ones)."""
    from flax import nnx

    return sum(int(a.size * a.dtype.itemsize) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
