"""One training step for the Flax NNX Llama, the twin of ``torchref.train.train_step``.

The step is a PURE function of ``(graphdef, TrainState, batch)``, jitted with ``graphdef``, the optax
transformation, the precision policy and the clipping norm static (flax's performance guide): the model is split
ONCE outside (``TrainState.create``), and merged inside the traced function, so a step costs no per-call NNX
graph traversal in Python. What one step does, in the order ``torch.amp`` does it:

1. cast the float32 master params to the policy's compute dtype INSIDE the differentiated function and merge
   the model (so the gradients come back in the params' dtype, jmp-style);
2. loss = mean next-token cross-entropy in float32 over ``tokens[:, :-1] -> tokens[:, 1:]``, weighted by the
   loss mask and by segment boundaries (``loss_weights``);
3. gradients of ``loss * loss_scale``; non-finite check on the SCALED gradients; unscale (``scaler.unscale_``);
4. optional global-norm clipping AFTER the unscale, with ``torch.nn.utils.clip_grad_norm_``'s formula
   (``coef = max_norm / (norm + 1e-6)``, clamped to 1) — hand-written because ``optax.clip_by_global_norm``
   divides by the norm without the 1e-6 and so is not torch's rule;
5. the optimizer update (e.g. ``optax.adamw``), then, on a non-finite step, the OLD params and optimizer state
   are kept (GradScaler skipping ``optimizer.step()``) and the loss scale backs off.

AdamW equivalence (``optax.adamw(lr, b1, b2, eps, weight_decay=wd)`` vs ``torch.optim.AdamW(lr, (b1, b2), eps,
weight_decay=wd)``): torch computes ``p <- p*(1 - lr*wd)`` then ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)``;
optax computes ``u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd*p`` then ``p <- p - lr*u``. With
``eps_root=0`` (optax's default) these are the same update: eps outside the square root, after bias correction,
decoupled decay scaled by the (scheduled) learning rate, applied to every parameter (optax's ``mask=None`` =
torch's single param group). Only float rounding differs. Defaults differ (torch wd=0.01, optax wd=1e-4): pass
all hyper-parameters explicitly on both sides.

On a skipped step the optax step count (and so an optax schedule) does not advance, exactly like torch's
``optimizer.step`` being skipped; a torch ``LRScheduler.step()`` called unconditionally by a loop WOULD advance.
``TrainState.step`` counts calls, skipped or not.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from .precision import DynamicLossScale, LossScale, NoOpLossScale, Policy, get_policy

__all__ = ["TrainState", "train_step", "make_train_step", "loss_fn", "loss_weights", "cross_entropy",
           "clip_by_global_norm", "global_norm", "BATCH_KEYS"]

BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]

_FP16_NO_SCALE = ("fp16 training WITHOUT dynamic loss scaling: float16 gradients underflow to zero and "
                  "overflow to inf without it. Use Policy.preset('fp16').make_loss_scale() (a DynamicLossScale, "
                  "torch.amp.GradScaler's rule) as TrainState.loss_scale, or train in bf16.")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@struct.dataclass
class TrainState:
    """Everything a step reads and writes, as one pytree (the model's graphdef stays outside, static).

    ``params``: the trainable ``nnx.Param`` state in the policy's param dtype (float32 masters);
    ``rest``: the model's other variables (e.g. the RoPE ``inv_freq``), passed through unchanged;
    ``opt_state``: the optax state; ``loss_scale``: ``DynamicLossScale`` (fp16) or ``NoOpLossScale``;
    ``step``: int32 count of step calls.
    """

    step: jax.Array
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState
    loss_scale: Union[DynamicLossScale, NoOpLossScale]

    @classmethod
    def create(cls, model: nnx.Module, tx: optax.GradientTransformation, *,
               policy: Union[str, Policy] = "fp32",
               loss_scale: Optional[LossScale] = None) -> tuple[nnx.GraphDef, "TrainState"]:
        """Splits ``model`` once; returns ``(graphdef, state)``. Params are cast to ``policy.param_dtype``;
        ``loss_scale`` defaults to ``policy.make_loss_scale()`` (a DynamicLossScale for fp16)."""
        policy = get_policy(policy)
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = policy.cast_to_param(params)
        if loss_scale is None:
            loss_scale = policy.make_loss_scale()
        if not isinstance(loss_scale, (DynamicLossScale, NoOpLossScale)):
            raise TypeError(f"loss_scale must be a DynamicLossScale or NoOpLossScale, got {type(loss_scale).__name__}")
        if policy.uses_loss_scaling and isinstance(loss_scale, NoOpLossScale):
            _warn_once(_FP16_NO_SCALE)
        return graphdef, cls(step=jnp.asarray(0, jnp.int32), params=params, rest=rest,
                             opt_state=tx.init(params), loss_scale=loss_scale)

    def model(self, graphdef: nnx.GraphDef) -> nnx.Module:
        """The model with the current (master-dtype) parameters, e.g. for evaluation or checkpointing."""
        return nnx.merge(graphdef, self.params, self.rest)


# --------------------------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------------------------

def _check_batch(batch: Batch) -> None:
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping with keys {BATCH_KEYS} ('tokens' required), "
                        f"got {type(batch).__name__}")
    unknown = [k for k in batch if k not in BATCH_KEYS]
    if unknown or "tokens" not in batch:
        raise ValueError(f"batch keys must be 'tokens' plus optional {BATCH_KEYS[1:]}; got {sorted(batch)}")
    tokens = batch["tokens"]
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.shape[1] < 2:
        raise ValueError(f"batch['tokens'] must be an int array [batch, seq] with seq >= 2, "
                         f"got {tokens.dtype}{list(tokens.shape)}")
    for k in BATCH_KEYS[1:]:
        if batch.get(k) is not None and tuple(batch[k].shape) != tuple(tokens.shape):
            raise ValueError(f"batch[{k!r}] must have the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(batch[k].shape)}")


def loss_weights(batch: Batch) -> jax.Array:
    """float32 ``[B, S-1]`` weights of the targets ``tokens[:, 1:]``.

    ``loss_mask[b, t]`` (same shape as tokens) says whether token t counts as a TARGET; with ``segment_ids``,
    a target counts only when it is in the same segment as the token predicting it (no loss across document
    boundaries in packed sequences).
    """
    tokens = batch["tokens"]
    w = jnp.ones((tokens.shape[0], tokens.shape[1] - 1), jnp.float32)
    if batch.get("loss_mask") is not None:
        w = w * batch["loss_mask"][:, 1:].astype(jnp.float32)
    if batch.get("segment_ids") is not None:
        seg = batch["segment_ids"]
        w = w * (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
    return w


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted mean token cross-entropy in float32: ``sum(w * nll) / max(sum(w), 1)``."""
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def loss_fn(model: Callable[..., jax.Array], batch: Batch) -> jax.Array:
    """Next-token loss of ``model`` on ``batch`` (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``)."""
    tokens = batch["tokens"]
    pos, seg = batch.get("positions"), batch.get("segment_ids")
    logits = model(tokens[:, :-1], positions=None if pos is None else pos[:, :-1],
                   segment_ids=None if seg is None else seg[:, :-1])
    return cross_entropy(logits, tokens[:, 1:], loss_weights(batch))


# --------------------------------------------------------------------------------------------------------------
# Clipping
# --------------------------------------------------------------------------------------------------------------

def global_norm(tree: Any) -> jax.Array:
    """L2 norm over all leaves, accumulated in float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def clip_by_global_norm(grads: Any, max_norm: float, norm: Optional[jax.Array] = None) -> Any:
    """``torch.nn.utils.clip_grad_norm_``: ``g * min(max_norm / (norm + 1e-6), 1)``."""
    norm = global_norm(grads) if norm is None else norm
    coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(1e-6)), 1.0)
    return jax.tree.map(lambda g: (g.astype(jnp.float32) * coef).astype(g.dtype), grads)


# --------------------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------------------

def _train_step(graphdef: nnx.GraphDef, state: TrainState, batch: Batch, *, tx: optax.GradientTransformation,
                policy: Policy, max_grad_norm: Optional[float]) -> tuple[TrainState, Metrics]:
    _check_batch(batch)
    ls = state.loss_scale
    if policy.uses_loss_scaling and isinstance(ls, NoOpLossScale):
        _warn_once(_FP16_NO_SCALE)

    def scaled_loss(params):
        model = nnx.merge(graphdef, policy.cast_to_compute(params), state.rest)
        loss = loss_fn(model, batch)
        return ls.scale(loss), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(state.params)
    finite = ls.all_finite(grads)  # on the SCALED gradients, like GradScaler's kernel
    grads = ls.unscale(grads)
    grad_norm = global_norm(grads)
    if max_grad_norm is not None:
        grads = clip_by_global_norm(grads, max_grad_norm, grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    params, opt_state = ls.select(finite, (new_params, new_opt_state), (state.params, state.opt_state))
    skipped = jnp.logical_not(finite) if ls.skips_nonfinite else jnp.asarray(False)
    metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": ls.loss_scale.astype(jnp.float32),
               "skipped": skipped}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=ls.update(finite))
    return new_state, metrics


def _check_static(tx: Any, policy: Any, max_grad_norm: Any) -> Policy:
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be None or a positive float, got {max_grad_norm!r}")
    return get_policy(policy)


_jitted_step = jax.jit(_train_step, static_argnames=("graphdef", "tx", "policy", "max_grad_norm"))


def train_step(graphdef: nnx.GraphDef, state: TrainState, batch: Batch, *, tx: optax.GradientTransformation,
               policy: Union[str, Policy] = "fp32",
               max_grad_norm: Optional[float] = None) -> tuple[TrainState, Metrics]:
    """One jitted training step; returns ``(new_state, metrics)``.

    ``batch``: ``{"tokens": int [B, S+1], "loss_mask"?: [B, S+1], "segment_ids"?: [B, S+1], "positions"?: [B, S+1]}``
    (the model sees the first S tokens). ``metrics``: ``loss`` (float32, unscaled), ``grad_norm`` (global norm of
    the unscaled gradients BEFORE clipping, what ``clip_grad_norm_`` returns), ``loss_scale`` (the scale applied
    to THIS step's loss), ``skipped`` (bool: the update was dropped for non-finite gradients).

    ``state`` is not donated here (the old state stays valid); a training loop should use
    ``make_train_step(..., donate=True)``.
    """
    policy = _check_static(tx, policy, max_grad_norm)
    return _jitted_step(graphdef, state, batch, tx=tx, policy=policy,
                        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *,
                    policy: Union[str, Policy] = "fp32", max_grad_norm: Optional[float] = None,
                    donate: bool = True) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``step(state, batch) -> (state, metrics)``, jitted once with everything static bound, the state buffers
    donated (so params and optimizer state are updated in place on accelerators)."""
    policy = _check_static(tx, policy, max_grad_norm)
    fn = functools.partial(_train_step, graphdef, tx=tx, policy=policy,
                           max_grad_norm=None if max_grad_norm is None else float(max_grad_norm))
    return jax.jit(fn, donate_argnums=(0,) if donate else ())
