"""Mixed precision for the JAX side: dtype policies and matmul-precision flags (twin of ``torchref.precision``).

    policy = Policy.preset("bf16")                  # fp32 masters, bf16 compute, fp32 outputs
    with matmul_precision("high"): ...              # torch.set_float32_matmul_precision("high")

``Policy(param_dtype, compute_dtype, output_dtype)`` is applied from OUTSIDE the model: the train step casts the
float32 master parameters to ``compute_dtype`` inside the differentiated function, so the model runs in low
precision and the gradients come back in ``param_dtype``. Presets ``fp32``, ``bf16``, ``fp16`` (with a
``DynamicLossScale``: :meth:`Policy.make_loss_scale`) and ``bf16-pure`` (bf16 parameters and optimizer state) have
torch's names; torch's autocast decides per op while this casts the parameters, so the twins are compared by
design §7's low-precision rules, not bit for bit. ``set_matmul_precision`` mirrors
``torch.set_float32_matmul_precision`` (its docstring maps the names and says where JAX has no twin).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from twincore.dtypes import POLICY_DTYPES, PRECISION_PRESETS, PolicyPresets

from .loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from .loss_scale import is_float_array as _is_float_array

__all__ = [
    "PRESETS",
    "Policy",
    "get_policy",
    "MATMUL_PRECISIONS",
    "MatmulSettings",
    "get_matmul_settings",
    "set_matmul_precision",
    "matmul_precision",
]

# --------------------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------------------

PRESETS: tuple[str, ...] = tuple(PRECISION_PRESETS)

_FLOAT_DTYPES = tuple(np.dtype(jnp.dtype(d)) for d in POLICY_DTYPES)


def _as_float_dtype(value: Any, arg: str) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError as e:
        raise TypeError(
            f"Policy.{arg} must be a floating dtype (one of float16, bfloat16, float32, float64), got {value!r}"
        ) from e
    if dt not in _FLOAT_DTYPES:
        raise TypeError(f"Policy.{arg} must be a floating dtype (one of float16, bfloat16, float32, float64), got {dt}")
    return dt


def _cast_floating(tree: Any, dtype: np.dtype) -> Any:
    """Casts the floating-point leaves of ``tree`` to ``dtype``; integer, bool and non-array leaves pass through."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float_array(x) and x.dtype != dtype else x, tree)


@dataclasses.dataclass(frozen=True, repr=False)
class Policy(PolicyPresets):
    """Mixed-precision policy: storage dtype of the parameters, dtype of the computation, dtype of the outputs.

    Frozen and hashable, so it can be a static argument of ``jax.jit``. Only floating leaves are cast.
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, _as_float_dtype(getattr(self, f), f))

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

    def make_loss_scale(self, **kwargs: Any) -> LossScale:
        """A fresh ``DynamicLossScale(**kwargs)`` for float16 compute, else ``NoOpLossScale()``."""
        if self.uses_loss_scaling:
            return DynamicLossScale.create(**kwargs)
        if kwargs:
            raise ValueError(
                f"loss-scale options {sorted(kwargs)} only apply to float16 compute; this policy "
                f"computes in {self.compute_dtype}"
            )
        return NoOpLossScale()


def get_policy(name: str | Policy) -> Policy:
    """``Policy.preset(name)``; a ``Policy`` passes through unchanged."""
    return Policy.get(name)


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

    jax_default_matmul_precision: str | None

    def restore(self) -> None:
        jax.config.update("jax_default_matmul_precision", self.jax_default_matmul_precision)

    def __enter__(self) -> MatmulSettings:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _global_matmul_precision() -> str | None:
    """The process-wide value (not a thread-local ``with jax.default_matmul_precision(...)`` override)."""
    getter = getattr(getattr(jax, "default_matmul_precision", None), "get_global", None)
    if callable(getter):
        return getter()
    return jax.config.jax_default_matmul_precision


def get_matmul_settings() -> MatmulSettings:
    return MatmulSettings(jax_default_matmul_precision=_global_matmul_precision())


def _check_reduction_flag(value: bool | None, arg: str) -> None:
    if value is None or value is False:
        return
    if value is True:
        raise ValueError(
            f"{arg}=True has no JAX equivalent: XLA has no process-wide switch for reduced-precision split-K "
            f"reductions in float16/bfloat16 GEMMs (the old xla_gpu_triton_gemm_disable_reduced_precision_reduction "
            f"flag was removed from XLA; jaxlib lists it as reserved). XLA reduces in the accumulator type, which "
            f"is torch's {arg}=False. For low-precision accumulation in one matmul, pass "
            f"precision=jax.lax.DotAlgorithmPreset.F16_F16_F16 (or BF16_BF16_BF16) to that dot. Accepted: None "
            f"(leave as is) or False."
        )
    raise TypeError(f"{arg} must be None or a bool, got {value!r}")


def set_matmul_precision(
    name: str,
    *,
    allow_fp16_reduced_precision_reduction: bool | None = None,
    allow_bf16_reduced_precision_reduction: bool | None = None,
) -> MatmulSettings:
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
def matmul_precision(name: str, **flags: bool | None) -> Iterator[MatmulSettings]:
    """``with matmul_precision("high"): ...`` sets the flags and restores the previous ones on exit."""
    previous = set_matmul_precision(name, **flags)
    try:
        yield previous
    finally:
        previous.restore()
