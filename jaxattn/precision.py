"""Mixed precision for the JAX side: dtype policies, matmul-precision flags and dynamic loss scaling.

Three ideas, each the twin of a ``torchref.precision`` / PyTorch feature:

``Policy(param_dtype, compute_dtype, output_dtype)``
    A jmp-style policy applied to the model from OUTSIDE the layer code. Parameters stay in ``param_dtype``
    (float32 masters); the train step casts the parameter state to ``compute_dtype`` inside the differentiated
    function before ``nnx.merge``, so the model (which computes in the dtype of its parameters) runs in low
    precision and the gradients come back in ``param_dtype``. Presets (same names as ``torchref.precision``):

    ============  =========  ==========  ========  ============================================================
    preset        params     compute     output    torch twin
    ============  =========  ==========  ========  ============================================================
    ``fp32``      float32    float32     float32   no autocast
    ``bf16``      float32    bfloat16    float32   ``torch.autocast(dtype=torch.bfloat16)``, fp32 params
    ``fp16``      float32    float16     float32   ``torch.autocast(dtype=torch.float16)`` + ``GradScaler``
    ``bf16-pure`` bfloat16   bfloat16    float32   params (and AdamW state) in bf16, no autocast (torchtitan's
                                                   ``training.dtype = bfloat16``)
    ============  =========  ==========  ========  ============================================================

    The two packages do not round identically: autocast decides per op (matmuls in low precision, reductions
    and softmax in fp32, a float32 residual stream), the JAX policy casts the parameters so every op of the
    model runs in ``compute_dtype`` except where the model itself asks for float32 (RMSNorm statistics,
    softmax, logits). Parity between them is therefore measured by the CONVENTIONS §7 low-precision rules
    (2x a naive implementation's error; whole-model KL), not bit-for-bit.

``set_matmul_precision(name, ...)``
    Process-wide float32 matmul precision, mirroring ``torch.set_float32_matmul_precision``; see its docstring
    for the mapping table and where JAX has no exact twin.

``DynamicLossScale`` / ``NoOpLossScale``
    ``torch.amp.GradScaler``'s dynamic loss scaling as a pytree usable inside ``jit``. Hand-written rather than
    taken from ``jmp`` / ``optax.apply_if_finite`` because neither follows GradScaler's rule (jmp grows after
    ``period`` finite steps counting differently and keeps its own state layout; ``optax.apply_if_finite``
    never scales), and the state must move to and from ``GradScaler.state_dict()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
    "PRESETS", "Policy", "get_policy",
    "MATMUL_PRECISIONS", "MatmulSettings", "get_matmul_settings", "set_matmul_precision", "matmul_precision",
    "DynamicLossScale", "NoOpLossScale", "LossScale", "all_finite", "select_tree",
]

# --------------------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------------------

PRESETS: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16-pure")

_PRESET_DTYPES: dict[str, tuple[str, str, str]] = {
    "fp32": ("float32", "float32", "float32"),
    "bf16": ("float32", "bfloat16", "float32"),
    "fp16": ("float32", "float16", "float32"),
    "bf16-pure": ("bfloat16", "bfloat16", "float32"),
}

_FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _as_float_dtype(value: Any, arg: str) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError as e:
        raise TypeError(f"Policy.{arg} must be a floating dtype (one of float16, bfloat16, float32, float64), "
                        f"got {value!r}") from e
    if dt not in _FLOAT_DTYPES:
        raise TypeError(f"Policy.{arg} must be a floating dtype (one of float16, bfloat16, float32, float64), "
                        f"got {dt}")
    return dt


def _is_float_array(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _cast_floating(tree: Any, dtype: np.dtype) -> Any:
    """Casts the floating-point leaves of ``tree`` to ``dtype``; integer, bool and non-array leaves pass through."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float_array(x) and x.dtype != dtype else x, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Mixed-precision policy: storage dtype of the parameters, dtype of the computation, dtype of the outputs.

    Frozen and hashable, so it can be a static argument of ``jax.jit``. Only floating leaves are cast.
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, _as_float_dtype(getattr(self, f), f))

    @classmethod
    def preset(cls, name: str) -> "Policy":
        """The policy named ``name``, one of ``PRESETS`` (the same names as ``torchref.precision``)."""
        if not isinstance(name, str) or name not in _PRESET_DTYPES:
            raise ValueError(f"unknown precision preset name={name!r}; valid names: {', '.join(PRESETS)}")
        return cls(*_PRESET_DTYPES[name])

    @property
    def name(self) -> Optional[str]:
        """The preset this policy equals, or ``None`` for a custom combination."""
        for n, dts in _PRESET_DTYPES.items():
            if (str(self.param_dtype), str(self.compute_dtype), str(self.output_dtype)) == dts:
                return n
        return None

    @property
    def uses_loss_scaling(self) -> bool:
        """float16 compute needs dynamic loss scaling (its 5-bit exponent underflows small gradients)."""
        return self.compute_dtype == np.dtype(jnp.float16)

    def cast_to_compute(self, tree: Any) -> Any:
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        return _cast_floating(tree, self.param_dtype)

    def cast_to_output(self, x: Any) -> Any:
        return _cast_floating(x, self.output_dtype)

    def make_loss_scale(self, **kwargs: Any) -> "LossScale":
        """A fresh ``DynamicLossScale(**kwargs)`` for float16 compute, else ``NoOpLossScale()``."""
        if self.uses_loss_scaling:
            return DynamicLossScale.create(**kwargs)
        if kwargs:
            raise ValueError(f"loss-scale options {sorted(kwargs)} only apply to float16 compute; this policy "
                             f"computes in {self.compute_dtype}")
        return NoOpLossScale()

    def __repr__(self) -> str:
        tag = f" ({self.name})" if self.name else ""
        return (f"Policy(param_dtype={self.param_dtype}, compute_dtype={self.compute_dtype}, "
                f"output_dtype={self.output_dtype}){tag}")


def get_policy(name: Union[str, Policy]) -> Policy:
    """``Policy.preset(name)``; a ``Policy`` passes through unchanged."""
    if isinstance(name, Policy):
        return name
    return Policy.preset(name)


# --------------------------------------------------------------------------------------------------------------
# Matmul precision flags
# --------------------------------------------------------------------------------------------------------------

MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

# torch name -> jax_default_matmul_precision value.
_JAX_MATMUL = {"highest": "highest", "high": "high", "medium": "default"}


@dataclasses.dataclass(frozen=True)
class MatmulSettings:
    """A snapshot of the process-wide matmul flags JAX has; ``restore()`` (or leaving a ``with``) puts it back.

    ``set_matmul_precision`` returns the snapshot taken BEFORE it changed anything, so both
    ``prev = set_matmul_precision("high"); ...; prev.restore()`` and ``with set_matmul_precision("high"): ...``
    work.
    """

    jax_default_matmul_precision: Optional[str]

    def restore(self) -> None:
        jax.config.update("jax_default_matmul_precision", self.jax_default_matmul_precision)

    def __enter__(self) -> "MatmulSettings":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _global_matmul_precision() -> Optional[str]:
    """The process-wide value (not a thread-local ``with jax.default_matmul_precision(...)`` override)."""
    getter = getattr(getattr(jax, "default_matmul_precision", None), "get_global", None)
    if callable(getter):
        return getter()
    return jax.config.jax_default_matmul_precision


def get_matmul_settings() -> MatmulSettings:
    return MatmulSettings(jax_default_matmul_precision=_global_matmul_precision())


def _check_reduction_flag(value: Optional[bool], arg: str) -> None:
    if value is None or value is False:
        return
    if value is True:
        raise ValueError(
            f"{arg}=True has no JAX equivalent: XLA has no process-wide switch for reduced-precision split-K "
            f"reductions in float16/bfloat16 GEMMs (the old xla_gpu_triton_gemm_disable_reduced_precision_reduction "
            f"flag was removed from XLA; jaxlib lists it as reserved). XLA reduces in the accumulator type, which "
            f"is torch's {arg}=False. For low-precision accumulation in one matmul, pass "
            f"precision=jax.lax.DotAlgorithmPreset.F16_F16_F16 (or BF16_BF16_BF16) to that dot. Accepted: None "
            f"(leave as is) or False.")
    raise TypeError(f"{arg} must be None or a bool, got {value!r}")


def set_matmul_precision(name: str, *, allow_fp16_reduced_precision_reduction: Optional[bool] = None,
                         allow_bf16_reduced_precision_reduction: Optional[bool] = None) -> MatmulSettings:
    """Sets the float32 matmul precision process-wide, by torch's names; returns the previous settings.

    Mapping (``torchref.precision.set_matmul_precision`` sets the torch column)::

        name       torch                                          JAX (jax_default_matmul_precision)
        ---------  ---------------------------------------------  -------------------------------------------
        highest    set_float32_matmul_precision("highest")        "highest": true float32 on GPU (=F32_F32_F32),
                   (cuda.matmul.allow_tf32=False),                6 bf16 passes on TPU
                   cudnn.allow_tf32=False
        high       set_float32_matmul_precision("high")           "high": TF32 on Ampere+ GPUs, 3 bf16 passes
                   (allow_tf32=True), cudnn.allow_tf32=True       on TPU
        medium     set_float32_matmul_precision("medium")         "default" (alias "bfloat16"): TF32 on
                   (allow_tf32=True), cudnn.allow_tf32=True       Ampere+ GPUs, 1 bf16 pass on TPU

    Where the twins differ:

    * On NVIDIA GPUs torch's "medium" and "high" both run TF32 (cuBLAS has no single-pass bf16 kernel for
      float32 inputs), and so do JAX's "default" and "high". A genuine single bf16 pass is available in JAX only
      per dot (``precision="BF16_BF16_F32"``); torch has none for float32 inputs.
    * torch "high" may also mean bf16x3 on CPUs with oneDNN; JAX on CPU ignores the precision level (always
      float32).
    * ``allow_fp16/bf16_reduced_precision_reduction`` (torch defaults: True) let cuBLAS reduce split-K partial
      sums of half-precision GEMMs in half precision. XLA has no process-wide twin: it always reduces in the
      accumulator type (float32), i.e. torch's False. ``False``/``None`` are therefore accepted here and
      ``True`` raises (see ``_check_reduction_flag``). Per-op control exists through the dot algorithm
      (``precision=jax.lax.DotAlgorithmPreset.F16_F16_F16`` accumulates in float16) and
      ``preferred_element_type=jnp.float32`` (keeps a float32 result/accumulator for half inputs).
    * Elementwise bf16/fp16 work: XLA's ``xla_allow_excess_precision`` (default true, an ``XLA_FLAGS`` option
      read once at backend start) lets fused elementwise chains keep float32 intermediates instead of rounding
      after every op; eager torch rounds after every op. There is no torch flag for this.
    * Convolutions: torch has a separate ``cudnn.allow_tf32``; ``jax_default_matmul_precision`` covers both
      matmuls and convolutions.
    * JAX reads the flag when a function is TRACED: an already-jitted function keeps the precision it was
      compiled with until it is retraced (the flag is part of the jit cache key, so a new call after the change
      does retrace). A thread-local ``with jax.default_matmul_precision(...)`` block takes precedence over the
      process-wide value set here; an explicit ``precision=`` on a dot takes precedence over both.

    The ``gpu``-marked test in ``parity_tests/test_precision.py`` measures the error of each setting against
    float64 on the device, both frameworks side by side.
    """
    if not isinstance(name, str) or name not in _JAX_MATMUL:
        raise ValueError(f"unknown matmul precision name={name!r}; valid names: {', '.join(MATMUL_PRECISIONS)}")
    _check_reduction_flag(allow_fp16_reduced_precision_reduction, "allow_fp16_reduced_precision_reduction")
    _check_reduction_flag(allow_bf16_reduced_precision_reduction, "allow_bf16_reduced_precision_reduction")
    previous = get_matmul_settings()
    jax.config.update("jax_default_matmul_precision", _JAX_MATMUL[name])
    return previous


@contextlib.contextmanager
def matmul_precision(name: str, **flags: Optional[bool]) -> Iterator[MatmulSettings]:
    """``with matmul_precision("high"): ...`` sets the flags and restores the previous ones on exit."""
    previous = set_matmul_precision(name, **flags)
    try:
        yield previous
    finally:
        previous.restore()


# --------------------------------------------------------------------------------------------------------------
# Loss scaling
# --------------------------------------------------------------------------------------------------------------

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


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise TypeError(f"loss-scale state_dict[{key!r}] must be a float, got {value!r}")
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"loss-scale state_dict[{key!r}] must be a float, got {value!r}") from e


def _to_int(value: Any, key: str) -> int:
    v = value.item() if hasattr(value, "item") else value
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise TypeError(f"loss-scale state_dict[{key!r}] must be an int, got {value!r}")
    return int(v)


@struct.dataclass
class DynamicLossScale:
    """``torch.amp.GradScaler``'s dynamic loss scaling, as an immutable pytree usable inside ``jax.jit``.

    Dynamic leaves: ``loss_scale`` (float32 scalar, GradScaler's ``_scale``) and ``growth_tracker`` (int32 scalar). Static (part of the tree
    structure): ``growth_factor``, ``backoff_factor``, ``growth_interval``.

    Semantics, step for step the same as GradScaler (``torch/amp/grad_scaler.py`` and the ``_amp_update_scale_``
    and ``_amp_foreach_non_finite_check_and_unscale_`` kernels):

    * ``scale(loss)`` multiplies by the scale (GradScaler.scale).
    * non-finite detection looks at the SCALED gradients (the kernel checks each value before unscaling);
      ``unscale(grads)`` multiplies by ``1/scale`` computed in float32 (torch computes the reciprocal in float64
      and rounds to float32; IEEE division makes the two identical, double rounding being innocuous for 53 >=
      2*24+2 bits), in float32 for half-precision gradients, like torch's opmath.
    * ``update(finite)``: on a non-finite step ``scale *= backoff_factor`` and the tracker resets to 0; otherwise
      the tracker is incremented and, when it reaches ``growth_interval``, ``scale *= growth_factor`` (only if
      the result is finite; torch never grows to inf) and the tracker resets to 0.
    * the caller skips the optimizer step on a non-finite step (``select``), leaving params and optimizer state
      untouched.

    Exactness note: torch multiplies the float32 scale by the factor in float64 and rounds to float32; here the
    factor is rounded to float32 first. The results are bit-identical whenever the factor is representable in
    float32 (the defaults 2.0 and 0.5, any power of two, most short decimals are NOT — e.g. 0.3 can differ by
    one float32 ulp of the scale).
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)

    skips_nonfinite: ClassVar[bool] = True

    def __post_init__(self):
        gf, bf, gi = self.growth_factor, self.backoff_factor, self.growth_interval
        if isinstance(gf, bool) or not isinstance(gf, (int, float)) or not gf > 1.0 or not math.isfinite(gf):
            raise ValueError(f"DynamicLossScale: growth_factor must be a finite float > 1.0, got {gf!r}")
        if isinstance(bf, bool) or not isinstance(bf, (int, float)) or not 0.0 < bf < 1.0:
            raise ValueError(f"DynamicLossScale: backoff_factor must be a float in (0, 1), got {bf!r}")
        if isinstance(gi, bool) or not isinstance(gi, (int, np.integer)) or gi < 1:
            raise ValueError(f"DynamicLossScale: growth_interval must be a positive int, got {gi!r}")
        object.__setattr__(self, "growth_factor", float(gf))
        object.__setattr__(self, "backoff_factor", float(bf))
        object.__setattr__(self, "growth_interval", int(gi))
        # Python numbers become strongly typed scalars, so the jit signature does not change after one update.
        if isinstance(self.loss_scale, (int, float, np.floating, np.integer)) and not isinstance(self.loss_scale, bool):
            object.__setattr__(self, "loss_scale", jnp.asarray(self.loss_scale, jnp.float32))
        if isinstance(self.growth_tracker, (int, np.integer)) and not isinstance(self.growth_tracker, bool):
            object.__setattr__(self, "growth_tracker", jnp.asarray(self.growth_tracker, jnp.int32))

    @classmethod
    def create(cls, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
               growth_interval: int = 2000) -> "DynamicLossScale":
        """GradScaler's constructor defaults: init 2**16, growth 2.0, backoff 0.5, interval 2000."""
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not init_scale > 0 \
                or not math.isfinite(init_scale):
            raise ValueError(f"DynamicLossScale: init_scale must be a finite float > 0, got {init_scale!r}")
        return cls(loss_scale=jnp.asarray(init_scale, jnp.float32), growth_tracker=jnp.asarray(0, jnp.int32),
                   growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)

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

    def update(self, grads_finite: Any) -> "DynamicLossScale":
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
        return {"scale": float(scale), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(tracker)}

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> "DynamicLossScale":
        """A loss scale from a ``state_dict()`` of this class or of ``torch.amp.GradScaler``."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"loss-scale state_dict must be a mapping with keys {list(_STATE_KEYS)}, "
                            f"got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise ValueError("loss-scale state_dict is empty, possibly because it was saved from a disabled "
                             "GradScaler or a NoOpLossScale; expected keys " + ", ".join(_STATE_KEYS))
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        unexpected = [k for k in state_dict if k not in _STATE_KEYS]
        if missing or unexpected:
            raise ValueError(f"loss-scale state_dict: missing keys {missing}, unexpected keys {unexpected}; "
                             f"expected exactly {list(_STATE_KEYS)}")
        scale = _to_float(state_dict["scale"], "scale")
        tracker = _to_int(state_dict["_growth_tracker"], "_growth_tracker")
        if tracker < 0:
            raise ValueError(f"loss-scale state_dict['_growth_tracker'] must be >= 0, got {tracker}")
        return cls(loss_scale=jnp.asarray(scale, jnp.float32), growth_tracker=jnp.asarray(tracker, jnp.int32),
                   growth_factor=_to_float(state_dict["growth_factor"], "growth_factor"),
                   backoff_factor=_to_float(state_dict["backoff_factor"], "backoff_factor"),
                   growth_interval=_to_int(state_dict["growth_interval"], "growth_interval"))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> "DynamicLossScale":
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

    def update(self, grads_finite: Any) -> "NoOpLossScale":
        return self

    @staticmethod
    def select(grads_finite: Any, new: Any, old: Any) -> Any:
        return new

    def state_dict(self) -> dict[str, Any]:
        return {}  # what a disabled GradScaler returns

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> "NoOpLossScale":
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if state_dict:
            raise ValueError(f"NoOpLossScale has no state but got keys {sorted(state_dict)}; use "
                             f"DynamicLossScale.from_state_dict for a GradScaler state")
        return self


LossScale = Union[DynamicLossScale, NoOpLossScale]

