"""Dynamic loss scaling for the JAX side: ``torch.amp.GradScaler``'s rule as a pytree usable inside ``jit``.

The twin of ``torch.amp.GradScaler`` (torchref uses torch's own class). Hand-written rather than taken from
``jmp`` / ``optax.apply_if_finite`` because neither follows GradScaler's rule (jmp counts its growth period
differently and keeps its own state layout; ``optax.apply_if_finite`` never scales), and the state must move
to and from ``GradScaler.state_dict()`` (``parity_tests/test_loss_scale.py`` checks it step for step).

    ls = DynamicLossScale.create()                  # init 2**16, growth 2.0, backoff 0.5, interval 2000
    grads = ls.unscale(jax.grad(lambda p: ls.scale(loss(p)))(params))
    finite = all_finite(grads); ls = ls.update(finite)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["DynamicLossScale", "NoOpLossScale", "LossScale", "all_finite", "select_tree", "is_float_array"]


def is_float_array(x: Any) -> bool:
    """True for an array (numpy, jax, tracer) with a floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


_is_float_array = is_float_array


def all_finite(tree: Any) -> jax.Array:
    """True when every element of every floating leaf of ``tree`` is finite (one bool scalar)."""
    leaves = [x for x in jax.tree.leaves(tree) if _is_float_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``jnp.where(pred, on_true, on_false)`` over two pytrees of the same structure.

    ``DynamicLossScale.select(finite, new, old)`` uses it to keep the params AND the optimizer state (including
    AdamW's step count) unchanged on a skipped step, exactly like ``GradScaler.step`` not calling
    ``optimizer.step()``.
    """
    pred = jnp.asarray(pred, dtype=bool)
    if pred.shape != ():
        raise ValueError(f"select_tree: pred must be a scalar bool, got shape {pred.shape}")
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _concrete(x: Any, what: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(f"{what} needs concrete values; call it outside jit (got a tracer)") from e


_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


def _python_number(value: Any, what: str) -> int | float:
    """The Python int/float held by ``value``: a Python or numpy number, or a 0-d (numpy, jax, torch) array.

    Bools (``True``, ``np.bool_``, bool arrays), strings, complex numbers and arrays with elements raise
    ``TypeError`` naming ``what``."""
    v = value
    if isinstance(v, np.generic):
        v = v.item()
    elif not isinstance(v, numbers.Number) and hasattr(v, "shape") and hasattr(v, "item"):
        shape = tuple(v.shape)
        if shape != ():
            raise TypeError(f"{what} must be a number or a 0-d array, got an array of shape {shape}")
        try:
            v = v.item()
        except _TRACER_ERRORS as e:
            raise TypeError(f"{what} needs a concrete value; call it outside jit (got a tracer)") from e
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(
            f"{what} must be a number (Python or numpy int/float, or a 0-d array), got {value!r} "
            f"of type {type(value).__name__}"
        )
    return v


def _float32(x: float) -> float:
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


def _check_float32(value: Any, what: str, ok, accepted: str) -> float:
    """``value`` as a float whose float32 rounding passes ``ok`` (a value that only fails after the rounding says
    so: 1e40 overflows float32 to inf, 1e-50 underflows to 0); else a ValueError naming ``what``."""
    x = float(_python_number(value, what))
    f = _float32(x)
    if not (math.isfinite(f) and ok(f)):
        rounded = math.isfinite(x) and ok(x)
        raise ValueError(f"{what} must be {accepted}, got {value!r}" + (f" (float32: {f})" if rounded else ""))
    return x


def _check_scale(value: Any, what: str) -> float:
    """A loss scale: finite and > 0 in float32."""
    return _check_float32(
        value, what, lambda v: v > 0, f"a finite float > 0 that float32 can hold (at most {_F32_MAX:.8g})"
    )


def _check_growth_factor(value: Any, what: str) -> float:
    return _check_float32(value, what, lambda v: v > 1.0, "a finite float > 1.0 (in float32)")


def _check_backoff_factor(value: Any, what: str) -> float:
    return _check_float32(value, what, lambda v: 0.0 < v < 1.0, "a float in (0, 1) (in float32)")


def _check_int(value: Any, what: str, lo: int, hi: int = _INT32_MAX, *, integral_float: bool = False) -> int:
    """An int in ``[lo, hi]``; ``integral_float`` also takes 3.0 (a state dict that went through a float)."""
    v = _python_number(value, what)
    if isinstance(v, float):
        if not (integral_float and v.is_integer()):
            raise TypeError(f"{what} must be an int, got {value!r} of type {type(value).__name__}")
        v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{what} must be an int in [{lo}, {hi}], got {value!r}")
    return int(v)


@struct.dataclass
class DynamicLossScale:
    """``torch.amp.GradScaler``'s dynamic loss scaling, as an immutable pytree usable inside ``jax.jit``.

    Dynamic leaves: ``loss_scale`` (float32 scalar, GradScaler's ``_scale``) and ``growth_tracker`` (int32
    scalar). Static (part of the tree structure): ``growth_factor``, ``backoff_factor``, ``growth_interval``.
    ``scale(loss)``, ``unscale(grads)``, ``update(finite)`` and ``select(finite, new, old)`` follow GradScaler
    step for step, bit-exact in float32; the derivation (torch's kernels, rounding) is in the docstrings of
    ``parity_tests/test_loss_scale.py``, which checks it against the real GradScaler.
    Numeric arguments take Python or numpy numbers and 0-d arrays (bools refused).
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)

    skips_nonfinite: ClassVar[bool] = True

    def __post_init__(self):
        gf = _check_growth_factor(self.growth_factor, "DynamicLossScale: growth_factor")
        bf = _check_backoff_factor(self.backoff_factor, "DynamicLossScale: backoff_factor")
        gi = _check_int(self.growth_interval, "DynamicLossScale: growth_interval", 1)
        object.__setattr__(self, "growth_factor", gf)
        object.__setattr__(self, "backoff_factor", bf)
        object.__setattr__(self, "growth_interval", gi)
        # Python numbers become strongly typed scalars, so the jit signature does not change after one update.
        if isinstance(self.loss_scale, (int, float, np.floating, np.integer)) and not isinstance(self.loss_scale, bool):
            object.__setattr__(self, "loss_scale", jnp.asarray(self.loss_scale, jnp.float32))
        if isinstance(self.growth_tracker, (int, np.integer)) and not isinstance(self.growth_tracker, bool):
            object.__setattr__(self, "growth_tracker", jnp.asarray(self.growth_tracker, jnp.int32))

    @classmethod
    def create(
        cls,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> DynamicLossScale:
        """GradScaler's constructor defaults: init 2**16, growth 2.0, backoff 0.5, interval 2000.

        ``init_scale`` must be finite and > 0 in float32; ``growth_factor`` > 1; ``backoff_factor`` in (0, 1);
        ``growth_interval`` a positive int. Python/numpy numbers and 0-d arrays are accepted, bools are not."""
        scale = _check_scale(init_scale, "DynamicLossScale: init_scale")
        return cls(
            loss_scale=jnp.asarray(scale, jnp.float32),
            growth_tracker=jnp.asarray(0, jnp.int32),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )

    # -- the four operations -----------------------------------------------------------------------------------
    def scale(self, loss: Any) -> Any:
        """``loss * loss_scale`` for each floating leaf of ``loss``."""
        return jax.tree.map(lambda x: x * self.loss_scale.astype(x.dtype) if _is_float_array(x) else x, loss)

    def unscale(self, grads: Any) -> Any:
        """``grads * (1/scale)``, computed in at least float32 and cast back to each leaf's dtype."""
        inv = jnp.float32(1.0) / self.loss_scale.astype(jnp.float32)

        def one(g):
            if not _is_float_array(g):
                return g
            opmath = jnp.promote_types(g.dtype, jnp.float32)
            return (g.astype(opmath) * inv.astype(opmath)).astype(g.dtype)

        return jax.tree.map(one, grads)

    all_finite = staticmethod(all_finite)

    def update(self, grads_finite: Any) -> DynamicLossScale:
        """The scale state after a step whose (scaled) gradients were finite or not (``_amp_update_scale_``)."""
        finite = jnp.asarray(grads_finite, dtype=bool)
        scale = self.loss_scale.astype(jnp.float32)
        tracker = self.growth_tracker.astype(jnp.int32)
        successful = tracker + 1
        grow = successful == self.growth_interval
        grown = scale * jnp.float32(self.growth_factor)
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), scale * jnp.float32(self.backoff_factor))
        new_tracker = jnp.where(finite, jnp.where(grow, 0, successful), 0).astype(jnp.int32)
        return self.replace(loss_scale=new_scale, growth_tracker=new_tracker)

    @staticmethod
    def select(grads_finite: Any, new: Any, old: Any) -> Any:
        """``new`` where the step's gradients were finite, else ``old`` (pytrees, e.g. ``(params, opt_state)``)."""
        return select_tree(grads_finite, new, old)

    # -- GradScaler-compatible state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys and Python types: ``scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker``. Call it outside ``jit`` (it reads the values)."""
        scale = _concrete(self.loss_scale, "DynamicLossScale.state_dict()")
        tracker = _concrete(self.growth_tracker, "DynamicLossScale.state_dict()")
        return {
            "scale": float(scale),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(tracker),
        }

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> DynamicLossScale:
        """A loss scale from a ``state_dict()`` of this class or of ``torch.amp.GradScaler``.

        Values are checked as ``create`` checks them (scale finite and > 0 in float32, ...), and
        ``0 <= _growth_tracker < growth_interval`` (the only states GradScaler reaches)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"loss-scale state_dict must be a mapping with keys {list(_STATE_KEYS)}, "
                f"got {type(state_dict).__name__}"
            )
        if len(state_dict) == 0:
            raise ValueError(
                "loss-scale state_dict is empty, possibly because it was saved from a disabled "
                "GradScaler or a NoOpLossScale; expected keys " + ", ".join(_STATE_KEYS)
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        unexpected = [k for k in state_dict if k not in _STATE_KEYS]
        if missing or unexpected:
            raise ValueError(
                f"loss-scale state_dict: missing keys {missing}, unexpected keys {unexpected}; "
                f"expected exactly {list(_STATE_KEYS)}"
            )
        what = "loss-scale state_dict[{!r}]".format
        scale = _check_scale(state_dict["scale"], what("scale"))
        growth_factor = _check_growth_factor(state_dict["growth_factor"], what("growth_factor"))
        backoff_factor = _check_backoff_factor(state_dict["backoff_factor"], what("backoff_factor"))
        interval = _check_int(state_dict["growth_interval"], what("growth_interval"), 1, integral_float=True)
        tracker = _check_int(
            state_dict["_growth_tracker"], what("_growth_tracker"), 0, interval - 1, integral_float=True
        )
        return cls(
            loss_scale=jnp.asarray(scale, jnp.float32),
            growth_tracker=jnp.asarray(tracker, jnp.int32),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=interval,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> DynamicLossScale:
        """Returns the loss scale described by ``state_dict`` (immutable: the receiver is unchanged). Like
        GradScaler.load_state_dict, every field (factors and interval included) comes from the dict."""
        return type(self).from_state_dict(state_dict)


@struct.dataclass
class NoOpLossScale:
    """Scale 1 that never skips a step: the loss scale for float32 and bfloat16 (GradScaler(enabled=False))."""

    skips_nonfinite: ClassVar[bool] = False

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.asarray(1.0, jnp.float32)

    def scale(self, loss: Any) -> Any:
        return loss

    def unscale(self, grads: Any) -> Any:
        return grads

    all_finite = staticmethod(all_finite)

    def update(self, grads_finite: Any) -> NoOpLossScale:
        return self

    @staticmethod
    def select(grads_finite: Any, new: Any, old: Any) -> Any:
        return new

    def state_dict(self) -> dict[str, Any]:
        return {}  # what a disabled GradScaler returns

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> NoOpLossScale:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if state_dict:
            raise ValueError(
                f"NoOpLossScale has no state but got keys {sorted(state_dict)}; use "
                f"DynamicLossScale.from_state_dict for a GradScaler state"
            )
        return self


LossScale = DynamicLossScale | NoOpLossScale
