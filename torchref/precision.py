"""Mixed precision for the PyTorch side: dtype policies over ``torch.autocast``, and matmul-precision flags (twin
of ``jaxattn.precision``, same preset names).

    with Policy.preset("bf16").autocast("cpu"): logits = model(tokens)

``fp32``: no autocast; ``bf16`` / ``fp16``: ``torch.autocast`` with float32 parameters (fp16 paired with
``torch.amp.GradScaler``: ``Policy.make_grad_scaler``); ``bf16-pure``: parameters cast to bfloat16
(``Policy.cast_model``; buffers such as RoPE's ``inv_freq`` stay float32), no autocast. ``set_matmul_precision``
sets ``torch.set_float32_matmul_precision``, ``cudnn.allow_tf32`` and the ``allow_*_reduced_precision_reduction``
flags and returns the previous settings (also a context manager).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from twincore.dtypes import POLICY_DTYPES, PRECISION_PRESETS, PolicyPresets

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

PRESETS: tuple[str, ...] = tuple(PRECISION_PRESETS)

_DTYPE_NAMES = {name: getattr(torch, name) for name in POLICY_DTYPES}
_FLOAT_DTYPES = tuple(_DTYPE_NAMES.values())


def _as_float_dtype(value: Any, arg: str) -> torch.dtype:
    if isinstance(value, str) and value in _DTYPE_NAMES:
        value = _DTYPE_NAMES[value]
    if value not in _FLOAT_DTYPES:
        raise TypeError(
            f"Policy.{arg} must be a floating torch dtype (float16, bfloat16, float32, float64), got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True, repr=False)
class Policy(PolicyPresets):
    """Mixed-precision policy (same fields and presets as ``jaxattn.precision.Policy``).

    ``compute_dtype != param_dtype`` means autocast to ``compute_dtype``; ``param_dtype`` below float32 means the
    model's parameters are cast (``cast_model``), the "pure" low-precision mode.
    """

    param_dtype: Any = torch.float32
    compute_dtype: Any = torch.float32
    output_dtype: Any = torch.float32

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, _as_float_dtype(getattr(self, f), f))

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or ``None`` when the model runs in its parameters' dtype."""
        return None if self.compute_dtype == self.param_dtype else self.compute_dtype

    @property
    def uses_loss_scaling(self) -> bool:
        return self.compute_dtype == torch.float16

    def autocast(self, device_type: str | torch.device = "cuda") -> contextlib.AbstractContextManager:
        """``torch.autocast(device_type, dtype=compute_dtype)``, or a null context when no autocast is needed."""
        if isinstance(device_type, torch.device):
            device_type = device_type.type
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def cast_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Casts floating PARAMETERS (not buffers: RoPE tables stay float32) to ``param_dtype``, in place."""
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != self.param_dtype:
                    p.data = p.data.to(self.param_dtype)
        return model

    def cast_to_output(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.output_dtype) if x.is_floating_point() else x

    def make_grad_scaler(self, device: str | torch.device = "cuda", **kwargs: Any) -> torch.amp.GradScaler:
        """``torch.amp.GradScaler(device, enabled=<float16 compute>, **kwargs)``."""
        if isinstance(device, torch.device):
            device = device.type
        return torch.amp.GradScaler(device, enabled=self.uses_loss_scaling, **kwargs)


def get_policy(name: str | Policy) -> Policy:
    """``Policy.preset(name)``; a ``Policy`` passes through unchanged."""
    return Policy.get(name)


# --------------------------------------------------------------------------------------------------------------
# Matmul precision flags
# --------------------------------------------------------------------------------------------------------------

MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")


def _matmul_fp32_state() -> tuple[str | None, str | None]:
    """(float32 matmul precision name or None, new-API cuda.matmul.fp32_precision or None)."""
    try:
        name = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 refuses when legacy and new APIs were mixed
        name = None
    new = getattr(torch.backends.cuda.matmul, "fp32_precision", None) if name is None else None
    return name, new


@dataclasses.dataclass(frozen=True)
class MatmulSettings:
    """Snapshot of torch's process-wide matmul flags; ``restore()`` (or leaving a ``with``) puts them back."""

    float32_matmul_precision: str | None
    cuda_matmul_fp32_precision: str | None  # only used when the legacy name could not be read
    cudnn_allow_tf32: bool
    allow_fp16_reduced_precision_reduction: bool
    allow_bf16_reduced_precision_reduction: bool

    def restore(self) -> None:
        m = torch.backends.cuda.matmul
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        m.allow_fp16_reduced_precision_reduction = self.allow_fp16_reduced_precision_reduction
        m.allow_bf16_reduced_precision_reduction = self.allow_bf16_reduced_precision_reduction
        if self.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        elif self.cuda_matmul_fp32_precision is not None:
            m.fp32_precision = self.cuda_matmul_fp32_precision

    def __enter__(self) -> MatmulSettings:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def get_matmul_settings() -> MatmulSettings:
    m = torch.backends.cuda.matmul
    name, new = _matmul_fp32_state()
    return MatmulSettings(
        float32_matmul_precision=name,
        cuda_matmul_fp32_precision=new,
        cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
        allow_fp16_reduced_precision_reduction=bool(m.allow_fp16_reduced_precision_reduction),
        allow_bf16_reduced_precision_reduction=bool(m.allow_bf16_reduced_precision_reduction),
    )


def _check_flag(value: bool | None, arg: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{arg} must be None or a bool, got {value!r}")


def set_matmul_precision(
    name: str,
    *,
    allow_fp16_reduced_precision_reduction: bool | None = None,
    allow_bf16_reduced_precision_reduction: bool | None = None,
) -> MatmulSettings:
    """Sets torch's float32 matmul precision and related flags; returns the previous settings.

    ============  ==========================================  ==================  =======================
    name          ``torch.set_float32_matmul_precision``      cuda.matmul         ``cudnn.allow_tf32``
                                                              ``.allow_tf32``
    ============  ==========================================  ==================  =======================
    ``highest``   "highest"                                   False               False
    ``high``      "high"                                      True                True
    ``medium``    "medium"                                    True                True
    ============  ==========================================  ==================  =======================

    ``cuda.matmul.allow_tf32`` is set THROUGH ``set_float32_matmul_precision`` (they are one flag): writing the
    legacy attribute afterwards makes torch >= 2.9 refuse ``get_float32_matmul_precision()`` ("mix of the legacy
    and new APIs"). ``allow_fp16/bf16_reduced_precision_reduction``: ``None`` leaves the flag as it is. The JAX
    twin (``jaxattn.precision.set_matmul_precision``) documents the mapping to ``jax_default_matmul_precision``.
    """
    if not isinstance(name, str) or name not in MATMUL_PRECISIONS:
        raise ValueError(f"unknown matmul precision name={name!r}; valid names: {', '.join(MATMUL_PRECISIONS)}")
    _check_flag(allow_fp16_reduced_precision_reduction, "allow_fp16_reduced_precision_reduction")
    _check_flag(allow_bf16_reduced_precision_reduction, "allow_bf16_reduced_precision_reduction")
    previous = get_matmul_settings()
    m = torch.backends.cuda.matmul
    torch.backends.cudnn.allow_tf32 = name != "highest"
    torch.set_float32_matmul_precision(name)
    if allow_fp16_reduced_precision_reduction is not None:
        m.allow_fp16_reduced_precision_reduction = allow_fp16_reduced_precision_reduction
    if allow_bf16_reduced_precision_reduction is not None:
        m.allow_bf16_reduced_precision_reduction = allow_bf16_reduced_precision_reduction
    return previous


@contextlib.contextmanager
def matmul_precision(name: str, **flags: bool | None) -> Iterator[MatmulSettings]:
    """``with matmul_precision("high"): ...`` sets the flags and restores the previous ones on exit."""
    previous = set_matmul_precision(name, **flags)
    try:
        yield previous
    finally:
        previous.restore()
