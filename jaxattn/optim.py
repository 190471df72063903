"""Optimizers for the training CLI's ``--optimizer`` choices as optax transformations (twin of ``torchref.optim``).

    tx = build("adamw", 3e-4, weight_decay=0.1, schedule="cosine", warmup=100, steps=10_000)
    graphdef, state = jaxattn.train.TrainState.create(model, tx)   # or nnx.Optimizer(model, tx, wrt=nnx.Param)

Names, defaults, schedules and the weight-decay rule (by NAME: no decay for norms and biases) are
``twincore.optim``'s, shared with torch. The learning rate is ``lr * lr_factor(count)`` with optax's
``count`` of APPLIED updates (a skipped fp16 step keeps the old state, so the schedule does not advance).

* ``adamw`` / ``adamw_fused``: ``optax.adamw`` (= torch ``AdamW``; under ``jit`` XLA fuses the update itself,
  see ``benchmarks/NOTES.md``).
* ``adafactor``: torch's ``Adafactor`` as an optax chain around :func:`scale_by_adafactor`, written here
  because optax's pieces are another variant (which leaves they factor, where epsilon goes, per-leaf RMS over a
  whole stack of layers where torch has one param per layer).
* ``adamw8bit``: block-wise 8-bit AdamW (Dettmers et al. 2022), written here because no JAX library has one
  (:func:`scale_by_adam_8bit`).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from twincore import optim as spec
from twincore.optim import ADAFACTOR_DEFAULTS, BLOCK_SIZE, MIN_8BIT_SIZE, OPTIMIZER_NAMES, SCHEDULE_NAMES

__all__ = [
    "build",
    "lr_schedule",
    "decay_mask",
    "param_name",
    "scale_by_adam_8bit",
    "adamw8bit",
    "adafactor",
    "scale_by_adafactor",
    "ScaleByAdafactorState",
    "layer_axes",
    "ScaleByAdam8bitState",
    "state_bytes",
    "OPTIMIZER_NAMES",
    "SCHEDULE_NAMES",
]

LearningRate = float | Callable[[jax.Array], jax.Array]


# ----------------------------------------------------------------------------------------------------------------
# Names, mask, schedule
# ----------------------------------------------------------------------------------------------------------------


def param_name(path: tuple) -> str:
    """Dotted name of a pytree path (``nnx.State``'s ``('layers', 'wq', .value)`` -> ``layers.wq``)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(p for p in parts if p != "value")


def decay_mask(params: Any) -> Any:
    """The params tree with a bool per leaf: ``True`` where weight decay applies (``twincore.optim.decays``)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: spec.decays(param_name(path)), params)


def layer_axes(params: Any) -> Any:
    """The params tree with an int per leaf: 1 where the leaf stacks one tensor per layer on its leading axis (the
    model's ``layers.*``, a list of per-layer params in torch), else 0."""
    return jax.tree_util.tree_map_with_path(lambda path, _: int(param_name(path).startswith("layers.")), params)


def lr_schedule(
    lr: float, *, schedule: str = "constant", warmup: int = 0, steps: int | None = None, min_lr_ratio: float = 0.0
) -> Callable[[jax.Array], jax.Array]:
    """``count -> lr * lr_factor(count)`` in float32 (the neutral definition through ``jnp``)."""
    spec.check_hparams("adamw", lr, 0.0, schedule=schedule, warmup=warmup, steps=steps, min_lr_ratio=min_lr_ratio)
    kw = dict(
        schedule=schedule,
        warmup=int(warmup),
        steps=None if steps is None else int(steps),
        min_lr_ratio=float(min_lr_ratio),
    )
    return lambda count: jnp.float32(lr) * spec.lr_factor(count, xp=jnp, **kw).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# 8-bit AdamW
# ----------------------------------------------------------------------------------------------------------------


# Into how many contiguous shares the devices split a stacked leaf's layer axis (pipeline stages): the 8-bit update
# walks the layers of every share at once, so that no device reads another's layers. jaxattn.sharding sets it while
# a step with a stage axis traces; the optimizer itself knows nothing of meshes.
LAYER_SHARDS: contextvars.ContextVar[int] = contextvars.ContextVar("LAYER_SHARDS", default=1)


class ScaleByAdam8bitState(NamedTuple):
    """Every moment tree has the params' structure with one array per leaf (optax's convention, so
    ``nnx.Optimizer`` and sharding rules see ordinary leaves). A quantised param's moment is its codes, uint8
    ``[n_blocks, block_size]`` (indices into the map, the tail padded), with ``*_absmax`` float32 ``[n_blocks]``;
    dequantised value = ``map[codes] * absmax``. Where the param's last dim is a whole number of blocks they are
    held by row, ``[*shape[:-1], last / block_size, block_size]`` and ``[*shape[:-1], last / block_size]`` (the
    same blocks; ``jaxattn.sharding`` splits them like the param). A small param's moment is float32 in the param's
    shape, and its ``*_absmax`` is empty (``n_blocks`` = 0). A stacked leaf (one param per layer) has the layer
    axis first in all of these."""

    count: jax.Array  # int32, applied updates
    mu: Any  # signed map
    mu_absmax: Any
    nu: Any  # unsigned map
    nu_absmax: Any


def _increment(count: jax.Array) -> jax.Array:
    """optax's saturating step counter (renamed between optax versions)."""
    return optax.safe_increment(count) if hasattr(optax, "safe_increment") else optax.safe_int32_increment(count)


def _rows(shape: tuple[int, ...], b: int, block_size: int) -> bool:
    """Whether a param of ``shape`` (``b`` leading layer axes) keeps its moments in blocks by row: its last dim is a
    whole number of blocks, so no block crosses a row and the codes are ``[*shape[:-1], last / block_size,
    block_size]``, the same blocks as the flat layout ``[*lead, n_blocks, block_size]`` reshaped. Sharded like
    the param (``jaxattn.sharding``), each device then holds the blocks of its own elements."""
    return len(shape) > b and shape[-1] % block_size == 0


def _quantize(x: jax.Array, code: jax.Array, block_size: int, b: int = 0) -> tuple[jax.Array, jax.Array]:
    """``twincore.optim.quantize_blockwise`` in jnp: nearest map entry to ``x / absmax``, ties to the lower index;
    per param of a stack of ``b`` leading (layer) axes: codes ``[*lead, n_blocks, block_size]``, absmax
    ``[*lead, n_blocks]``, or by row (:func:`_rows`) ``[*x.shape[:-1], x.shape[-1] / block_size, block_size]``."""
    if _rows(x.shape, b, block_size):
        blocks = x.reshape(*x.shape[:-1], -1, block_size)  # [..., last / block, block]
    else:
        lead = x.shape[:b]
        flat = x.reshape(*lead, -1)
        n_blocks = -(-flat.shape[-1] // block_size)
        pad = [(0, 0)] * b + [(0, n_blocks * block_size - flat.shape[-1])]
        blocks = jnp.pad(flat, pad).reshape(*lead, n_blocks, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    nonzero = (absmax > 0)[..., None]
    normed = jnp.where(nonzero, blocks / jnp.where(nonzero, absmax[..., None], 1.0), 0.0)
    # unrolled: the default's loop holds int32 arrays the moment's size between its steps (on an H100 the update of
    # a stacked [16, 256, 8192] leaf took 32 bytes of temporaries per element, 6 unrolled)
    idx = jnp.searchsorted(code, normed, side="right", method="scan_unrolled")
    idx = jnp.clip(idx - 1, 0, code.shape[0] - 2)
    right_closer = jnp.abs(normed - code[idx + 1]) < jnp.abs(normed - code[idx])
    return (idx + right_closer).astype(jnp.uint8), absmax


def _dequantize(codes: jax.Array, absmax: jax.Array, code: jax.Array, shape: tuple[int, ...], b: int = 0) -> jax.Array:
    values = code[codes.astype(jnp.int32)] * absmax[..., None]
    if codes.ndim == len(shape) + 1:  # by row
        return values.reshape(shape)
    size = int(np.prod(shape[b:]))
    return values.reshape(*shape[:b], -1)[..., :size].reshape(shape)  # [*lead, padded] cut to the param


def scale_by_adam_8bit(
    b1: float = spec.ADAMW_DEFAULTS["b1"],
    b2: float = spec.ADAMW_DEFAULTS["b2"],
    eps: float = spec.ADAMW_DEFAULTS["eps"],
    *,
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
    stacked: Any = layer_axes,
) -> optax.GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` with the moments stored in 8 bits between steps.

    Per param with at least ``min_8bit_size`` elements: dequantise m and v, update them in float32
    (``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``), compute the direction from these float32 values, then
    quantise them back, block-wise (``block_size`` consecutive elements of the C-order flattened param share an
    absmax), m with the signed and v with the unsigned dynamic map (``twincore.optim.quantization_map``), rounding
    to the nearest map entry (ties to the lower index). Smaller params keep float32 moments. A param is a leaf, or
    one layer of a leaf that ``stacked`` (a tree of 0/1, or a function of the tree giving it) says stacks its
    layers on axis 0, as torch holds one param per layer: its size and its blocks are per layer. A linear weight is
    ``[in, out]`` here and ``[out, in]`` in torch, so its blocks group other elements than torch's: the same
    algorithm, quantisation errors that differ (the twins' CLI runs agree within §7; a transpose per step would
    buy equal codes at the cost of the update's memory traffic). This is
    bitsandbytes' ``optimizer_update_8bit_blockwise`` ("adam") with ``percentile_clipping=100``, no max_unorm.
    State: 2 bytes + 8 bytes per block per element of a quantised param (2.03 bytes at block 256); held by row
    where the last dim is a whole number of blocks (:class:`ScaleByAdam8bitState`), so that under FSDP / tensor
    parallelism each device quantises its own rows and columns.
    """
    for arg, val in (("block_size", block_size), ("min_8bit_size", min_8bit_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{arg}={val!r} must be a positive int")
    code_m = jnp.asarray(spec.quantization_map(signed=True))
    code_v = jnp.asarray(spec.quantization_map(signed=False))

    def init_fn(params):
        def blocks(p, b):  # [*lead, n_blocks], or by row [*p.shape[:-1], last / block]; None: float32 moments
            n = math.prod(p.shape[b:])
            if n < min_8bit_size:
                return None
            if _rows(p.shape, b, block_size):
                return (*p.shape[:-1], p.shape[-1] // block_size)
            return (*p.shape[:b], -(-n // block_size))

        def moment(p, b):  # absmax 0: every code dequantises to 0
            grid = blocks(p, b)
            return jnp.zeros(p.shape, jnp.float32) if grid is None else jnp.zeros((*grid, block_size), jnp.uint8)

        def absmax(p, b):
            grid = blocks(p, b)
            return jnp.zeros((*p.shape[:b], 0) if grid is None else grid, jnp.float32)

        axes = stacked(params) if callable(stacked) else stacked
        # four separate trees: a train step donates the state, and a buffer may be donated only once
        return ScaleByAdam8bitState(
            jnp.zeros([], jnp.int32), *(jax.tree.map(f, params, axes) for f in (moment, absmax, moment, absmax))
        )

    def update_fn(updates, state, params=None):
        del params
        count = _increment(state.count)
        t = count.astype(jnp.float32)
        c1 = 1.0 - jnp.float32(b1) ** t
        c2 = jnp.sqrt(1.0 - jnp.float32(b2) ** t)
        axes = stacked(updates) if callable(stacked) else stacked
        leaves, treedef = jax.tree.flatten(updates)
        per_leaf = zip(leaves, *(treedef.flatten_up_to(x) for x in (*state[1:], axes)))

        def one(g, m, m_amax, v, v_amax, b=0):
            q = m.dtype == jnp.uint8
            if q:
                m, v = _dequantize(m, m_amax, code_m, g.shape, b), _dequantize(v, v_amax, code_v, g.shape, b)
            g32 = g.astype(jnp.float32)
            m = b1 * m + (1.0 - b1) * g32
            v = b2 * v + (1.0 - b2) * (g32 * g32)
            u = ((m / (jnp.sqrt(v) / c2 + eps)) / c1).astype(g.dtype)
            if q:
                (m, m_amax), (v, v_amax) = _quantize(m, code_m, block_size, b), _quantize(v, code_v, block_size, b)
            return u, m, m_amax, v, v_amax

        def by_layer(leaf):  # one layer of each share at a time, in place (the update over the gradient)
            n = LAYER_SHARDS.get()
            n = n if leaf[0].shape[0] % n == 0 else 1
            shares = tuple(x.reshape(n, -1, *x.shape[1:]) for x in leaf)  # [shares, layers per share, ...]

            def body(i, st):
                return tuple(x.at[:, i].set(y) for x, y in zip(st, jax.vmap(one)(*(x[:, i] for x in st))))

            out = jax.lax.fori_loop(0, shares[0].shape[1], body, shares)
            return tuple(x.reshape(y.shape) for x, y in zip(out, leaf))

        out = []
        for g, m, m_amax, v, v_amax, b in per_leaf:
            if b and m.dtype == jnp.uint8:  # one layer's float32 moments live at a time, not the stack's
                out.append(by_layer((g, m, m_amax, v, v_amax)))
            else:
                out.append(one(g, m, m_amax, v, v_amax, b))
        trees = [treedef.unflatten(list(col)) for col in zip(*out)] if out else [updates] * 5
        return trees[0], ScaleByAdam8bitState(count, *trees[1:])

    return optax.GradientTransformation(init_fn, update_fn)


def adamw8bit(
    learning_rate: LearningRate,
    b1: float = spec.ADAMW_DEFAULTS["b1"],
    b2: float = spec.ADAMW_DEFAULTS["b2"],
    eps: float = spec.ADAMW_DEFAULTS["eps"],
    weight_decay: float = spec.WEIGHT_DECAY_DEFAULT,
    mask: Any = decay_mask,
    **kwargs,
) -> optax.GradientTransformation:
    """``optax.adamw``'s chain with the 8-bit moments: direction, ``+ wd * p`` (masked), ``* -lr``."""
    return optax.chain(
        scale_by_adam_8bit(b1, b2, eps, **kwargs),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------------------------------------------
# Adafactor
# ----------------------------------------------------------------------------------------------------------------


class ScaleByAdafactorState(NamedTuple):
    """torch ``Adafactor``'s second moments, one leaf per param (optax's ``FactoredState`` layout): a leaf that is
    a matrix or more per layer keeps ``v_row`` ``[..., R]`` and ``v_col`` ``[..., C]`` (the means of g**2 over its
    last and second-to-last dim, batched over the leading dims) and an empty ``v``; a vector (per layer) keeps
    ``v`` in its shape and empty ``v_row``/``v_col``. All float32."""

    count: jax.Array  # int32, applied updates
    v_row: Any
    v_col: Any
    v: Any


def _rms(x: jax.Array, b: int) -> jax.Array:
    """RMS per param: over every axis but the first ``b`` (a stack's layer axis), kept for broadcasting."""
    return jnp.sqrt(jnp.mean(x * x, axis=tuple(range(b, x.ndim)), keepdims=True))


def scale_by_adafactor(
    decay_rate: float = ADAFACTOR_DEFAULTS["decay_rate"],
    clipping_threshold: float = ADAFACTOR_DEFAULTS["clipping_threshold"],
    min_param_scale: float = ADAFACTOR_DEFAULTS["min_param_scale"],
    stacked: Any = layer_axes,
) -> optax.GradientTransformation:
    """torch ``Adafactor``'s step before the learning rate: ``max(min_param_scale, RMS(p)) U / max(1, RMS(U) / d)``
    with ``U = g / sqrt(max(V, eps**2))``, eps = the leaf dtype's eps (``eps1=None``), ``d = clipping_threshold``.

    V is factored for every param of two or more dims, over its last two (``row_var @ col_var / max(mean(row_var),
    eps)``), and is ``v`` itself for a vector; each moment moves by ``lerp(v, g**2, t**-decay_rate)``. RMS(p) and
    RMS(U) are per param: per layer for a leaf that ``stacked`` (a tree of 0/1, or a function of the params giving
    it) says stacks its layers on axis 0. Written here because optax's pieces are another variant:
    ``scale_by_factored_rms`` factors only where two dims are >= 128 (the two largest), adds epsilon to g**2
    instead of clamping V, and does not clamp the mean row variance (torch's clamp at eps, which sets the step of a
    matrix whose gradient RMS is under 3.5e-4); its block RMS are per leaf, whole stacks of layers at once.
    """

    def moment_shapes(shape, b):  # v_row, v_col, v
        return (shape[:-1], shape[:-2] + shape[-1:], (0,)) if len(shape) - b > 1 else ((0,), (0,), shape)

    def init_fn(params):
        axes = stacked(params) if callable(stacked) else stacked
        # separate trees per moment: a train step donates the state, and a buffer may be donated only once
        return ScaleByAdafactorState(
            jnp.zeros([], jnp.int32),
            *(
                jax.tree.map(lambda p, b, i=i: jnp.zeros(moment_shapes(p.shape, b)[i], jnp.float32), params, axes)
                for i in range(3)
            ),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_adafactor needs the params (RMS(p) scales the step); pass them to update")
        count = _increment(state.count)
        w = count.astype(jnp.float32) ** -decay_rate  # torch's one_minus_beta2_t
        axes = stacked(params) if callable(stacked) else stacked
        leaves, treedef = jax.tree.flatten(updates)
        rest = (treedef.flatten_up_to(x) for x in (*state[1:], params, axes))
        out = []
        for g, v_row, v_col, v, p, b in zip(leaves, *rest):
            eps = float(jnp.finfo(g.dtype).eps)
            g32 = g.astype(jnp.float32)
            g2 = g32 * g32
            if g.ndim - b > 1:
                v_row = v_row + w * (g2.mean(-1) - v_row)
                v_col = v_col + w * (g2.mean(-2) - v_col)
                row_mean = jnp.maximum(v_row.mean(-1), eps)[..., None, None]
                var = v_row[..., :, None] * v_col[..., None, :] / row_mean  # [..., R, C]
            else:
                v = var = v + w * (g2 - v)
            u = g32 * jax.lax.rsqrt(jnp.maximum(var, eps * eps))
            u = u / jnp.maximum(1.0, _rms(u, b) / clipping_threshold)
            u = u * jnp.maximum(min_param_scale, _rms(p.astype(jnp.float32), b))
            out.append((u.astype(g.dtype), v_row, v_col, v))
        trees = [treedef.unflatten(list(col)) for col in zip(*out)] if out else [updates] * 4
        return trees[0], ScaleByAdafactorState(count, *trees[1:])

    return optax.GradientTransformation(init_fn, update_fn)


def adafactor(
    learning_rate: LearningRate, weight_decay: float = 0.0, mask: Any = decay_mask, stacked: Any = layer_axes
) -> optax.GradientTransformation:
    """torch.optim.Adafactor (``eps1=None``, ``eps2=1e-3``, ``d=1``, ``beta2_decay=-0.8``) as an optax chain.

    torch: ``p <- p (1 - lr wd) - min(lr, 1/sqrt(t)) A``, A from :func:`scale_by_adafactor`. Here:
    ``-lr * (r_t * A + wd p)`` with ``r_t = min(1, 1 / (lr sqrt(t)))``: the same step (``optax.adafactor`` applies
    weight decay without the lr).
    """
    lr_fn = learning_rate if callable(learning_rate) else (lambda count: jnp.float32(learning_rate))
    rel = lambda count: jnp.minimum(1.0, 1.0 / (lr_fn(count) * jnp.sqrt(count + 1.0)))  # noqa: E731
    return optax.chain(
        scale_by_adafactor(stacked=stacked),
        optax.scale_by_schedule(rel),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------------------------


def build(
    name: str,
    learning_rate: LearningRate,
    weight_decay: float = spec.WEIGHT_DECAY_DEFAULT,
    *,
    schedule: str = "constant",
    warmup: int = 0,
    steps: int | None = None,
    min_lr_ratio: float = 0.0,
    b1: float | None = None,
    b2: float | None = None,
    eps: float | None = None,
) -> optax.GradientTransformation:
    """The optax transformation for ``--optimizer name`` (one of ``OPTIMIZER_NAMES``).

    ``learning_rate``: the peak lr (a float, shaped by ``schedule``/``warmup``/``steps``/``min_lr_ratio``) or
    an optax schedule ``count -> lr``. ``b1``/``b2``/``eps`` default to ``twincore.optim.ADAMW_DEFAULTS`` and are
    refused for adafactor. Bad values raise a ValueError naming the argument.
    """
    hp = spec.check_hparams(
        name,
        learning_rate,
        weight_decay,
        schedule=schedule,
        warmup=warmup,
        steps=steps,
        min_lr_ratio=min_lr_ratio,
        b1=b1,
        b2=b2,
        eps=eps,
    )
    lr = (
        learning_rate
        if callable(learning_rate)
        else lr_schedule(float(learning_rate), schedule=schedule, warmup=warmup, steps=steps, min_lr_ratio=min_lr_ratio)
    )
    wd = float(weight_decay)
    if name in ("adamw", "adamw_fused"):
        return optax.adamw(lr, b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], eps_root=0.0, weight_decay=wd, mask=decay_mask)
    if name == "adamw8bit":
        return adamw8bit(lr, hp["b1"], hp["b2"], hp["eps"], weight_decay=wd)
    return adafactor(lr, weight_decay=wd)


def state_bytes(opt_state: Any) -> int:
    """Bytes held by an optimizer state (every array leaf, counts included)."""
    return int(
        sum(
            np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
            for x in jax.tree.leaves(opt_state)
            if hasattr(x, "dtype")
        )
    )
