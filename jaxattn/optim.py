"""Optimizers for the training CLI's ``--optimizer`` choices as optax transformations (twin of ``torchref.optim``).

    tx = build("adamw", 3e-4, weight_decay=0.1, schedule="cosine", warmup=100, steps=10_000)
    graphdef, state = jaxattn.train.TrainState.create(model, tx)   # or nnx.Optimizer(model, tx, wrt=nnx.Param)

Names, defaults, schedules and the weight-decay rule (by NAME: no decay for norms and biases) are
``twincore.optim``'s, shared with torch. The learning rate is ``lr * lr_factor(count)`` with optax's
``count`` of APPLIED updates (a skipped fp16 step keeps the old state, so the schedule does not advance).

* ``adamw`` / ``adamw_fused``: ``optax.adamw`` (= torch ``AdamW``; under ``jit`` XLA fuses the update itself,
  see ``benchmarks/NOTES.md``).
* ``adafactor``: torch's ``Adafactor`` algorithm from optax's building blocks (``optax.adafactor`` applies weight
  decay without the lr); where it still differs from torch is in ``parity_tests/test_optim.py``.
* ``adamw8bit``: block-wise 8-bit AdamW (Dettmers et al. 2022), written here because no JAX library has one
  (:func:`scale_by_adam_8bit`).
"""

from __future__ import annotations

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


class ScaleByAdam8bitState(NamedTuple):
    """Every moment tree has the params' structure with one array per leaf (optax's convention, so
    ``nnx.Optimizer`` and sharding rules see ordinary leaves). A quantised leaf's moment is its codes, uint8
    ``[n_blocks, block_size]`` (indices into the map, the tail padded), with ``*_absmax`` float32 ``[n_blocks]``;
    dequantised value = ``map[codes] * absmax``. A small leaf's moment is float32 in the param's shape, and its
    ``*_absmax`` leaf is empty (shape ``(0,)``)."""

    count: jax.Array  # int32, applied updates
    mu: Any  # signed map
    mu_absmax: Any
    nu: Any  # unsigned map
    nu_absmax: Any


def _quantize(x: jax.Array, code: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """``twincore.optim.quantize_blockwise`` in jnp: nearest map entry to ``x / absmax``, ties to the lower index."""
    flat = x.reshape(-1)
    n_blocks = -(-flat.size // block_size)
    blocks = jnp.pad(flat, (0, n_blocks * block_size - flat.size)).reshape(n_blocks, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    nonzero = (absmax > 0)[:, None]
    normed = jnp.where(nonzero, blocks / jnp.where(nonzero, absmax[:, None], 1.0), 0.0)
    idx = jnp.clip(jnp.searchsorted(code, normed, side="right") - 1, 0, code.shape[0] - 2)
    right_closer = jnp.abs(normed - code[idx + 1]) < jnp.abs(normed - code[idx])
    return (idx + right_closer).astype(jnp.uint8), absmax


def _dequantize(codes: jax.Array, absmax: jax.Array, code: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    size = int(np.prod(shape))
    return (code[codes.astype(jnp.int32)] * absmax[:, None]).reshape(-1)[:size].reshape(shape)


def scale_by_adam_8bit(
    b1: float = spec.ADAMW_DEFAULTS["b1"],
    b2: float = spec.ADAMW_DEFAULTS["b2"],
    eps: float = spec.ADAMW_DEFAULTS["eps"],
    *,
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> optax.GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` with the moments stored in 8 bits between steps.

    Per leaf with at least ``min_8bit_size`` elements: dequantise m and v, update them in float32
    (``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``), compute the direction from these float32 values, then
    quantise them back, block-wise (``block_size`` consecutive elements of the C-order flattened leaf share an
    absmax), m with the signed and v with the unsigned dynamic map (``twincore.optim.quantization_map``), rounding
    to the nearest map entry (ties to the lower index). Smaller leaves keep float32 moments. This is
    bitsandbytes' ``optimizer_update_8bit_blockwise`` ("adam") with ``percentile_clipping=100``, no max_unorm.
    State: 2 bytes + 8 bytes per block per element of a quantised leaf (2.03 bytes at block 256).
    """
    for arg, val in (("block_size", block_size), ("min_8bit_size", min_8bit_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{arg}={val!r} must be a positive int")
    code_m = jnp.asarray(spec.quantization_map(signed=True))
    code_v = jnp.asarray(spec.quantization_map(signed=False))

    def init_fn(params):
        def moment(p):  # absmax 0: every code dequantises to 0
            if p.size >= min_8bit_size:
                return jnp.zeros((-(-p.size // block_size), block_size), jnp.uint8)
            return jnp.zeros(p.shape, jnp.float32)

        def absmax(p):
            return jnp.zeros((-(-p.size // block_size) if p.size >= min_8bit_size else 0,), jnp.float32)

        # four separate trees: a train step donates the state, and a buffer may be donated only once
        return ScaleByAdam8bitState(
            jnp.zeros([], jnp.int32), *(jax.tree.map(f, params) for f in (moment, absmax, moment, absmax))
        )

    def update_fn(updates, state, params=None):
        del params
        count = (
            optax.safe_increment(state.count)
            if hasattr(optax, "safe_increment")
            else optax.safe_int32_increment(state.count)
        )
        t = count.astype(jnp.float32)
        c1 = 1.0 - jnp.float32(b1) ** t
        c2 = jnp.sqrt(1.0 - jnp.float32(b2) ** t)
        leaves, treedef = jax.tree.flatten(updates)
        per_leaf = zip(leaves, *(treedef.flatten_up_to(x) for x in state[1:]))
        out = []
        for g, m, m_amax, v, v_amax in per_leaf:
            q = m.dtype == jnp.uint8
            if q:
                m, v = _dequantize(m, m_amax, code_m, g.shape), _dequantize(v, v_amax, code_v, g.shape)
            g32 = g.astype(jnp.float32)
            m = b1 * m + (1.0 - b1) * g32
            v = b2 * v + (1.0 - b2) * (g32 * g32)
            u = ((m / (jnp.sqrt(v) / c2 + eps)) / c1).astype(g.dtype)
            if q:
                (m, m_amax), (v, v_amax) = _quantize(m, code_m, block_size), _quantize(v, code_v, block_size)
            out.append((u, m, m_amax, v, v_amax))
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


EPS32 = float(np.finfo(np.float32).eps)  # torch.optim.Adafactor's eps1=None for float32 parameters


def adafactor(
    learning_rate: LearningRate, weight_decay: float = 0.0, mask: Any = decay_mask, min_dim_size_to_factor: int = 128
) -> optax.GradientTransformation:
    """torch.optim.Adafactor's update from optax's pieces (see the module docstring for what still differs).

    torch: ``p <- p (1 - lr wd) - min(lr, 1/sqrt(t)) max(1e-3, RMS(p)) U / max(1, RMS(U))``, U = g / sqrt(V).
    Here: ``-lr * (r_t * max(1e-3, RMS(p)) * clip(U) + wd p)`` with ``r_t = min(1, 1 / (lr sqrt(t)))``.
    torch clamps V at eps32**2 (float32's eps); optax adds its epsilon to g**2, so it is eps32**2 here (not optax's
    1e-30): a gradient element far below eps32 gets U = g / eps32 on both sides, not sign(g). Still different: where
    g**2 is near eps32**2 (add vs clamp: U within sqrt(2)), and torch's clamp of a factored leaf's mean row
    variance at eps32 (a matrix whose gradient RMS is under 3.5e-4).
    """
    lr_fn = learning_rate if callable(learning_rate) else (lambda count: jnp.float32(learning_rate))
    rel = lambda count: jnp.minimum(1.0, 1.0 / (lr_fn(count) * jnp.sqrt(count + 1.0)))  # noqa: E731
    d = ADAFACTOR_DEFAULTS
    return optax.chain(
        optax.scale_by_factored_rms(
            decay_rate=d["decay_rate"], epsilon=EPS32**2, min_dim_size_to_factor=min_dim_size_to_factor
        ),
        optax.clip_by_block_rms(d["clipping_threshold"]),
        optax.scale_by_param_block_rms(d["min_param_scale"]),
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
