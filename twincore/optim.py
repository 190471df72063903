"""Optimizer names, defaults, the weight-decay rule, learning-rate schedules and the 8-bit quantisation maps,
shared by ``jaxattn.optim`` and ``torchref.optim`` (numpy only).

    lr_factor(50, schedule="cosine", warmup=10, steps=100)   # 0.5 * (1 + cos(pi * 40 / 90))

* Schedules (Hugging Face's ``get_*_schedule_with_warmup`` with a floor ``min_lr_ratio``): ``step`` counts updates
  already applied; linear warmup from 0, then constant / linear / cosine decay to the floor. ``xp`` is the array
  module (numpy, or ``jax.numpy`` inside a jitted step).
* Weight decay (:func:`decays`) by NAME: none for norm weights (a name component ending in ``norm``) and biases —
  an ``ndim == 1`` rule would miss the JAX model's stacked ``[n_layers, dim]`` norms.
* 8-bit maps (:func:`quantization_map`): bitsandbytes' dynamic maps; :func:`quantize_blockwise` is the numpy
  reference of the rounding both frameworks use.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np

OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "adamw_fused", "adafactor", "adamw8bit")
SCHEDULE_NAMES: tuple[str, ...] = ("constant", "linear", "cosine")

# AdamW defaults, passed explicitly on both sides (torch's and optax's own defaults differ): Llama's pretraining
# betas (0.9, 0.95) and weight decay 0.1; eps 1e-8 (torch's default; Llama 2 used 1e-5).
ADAMW_DEFAULTS: dict[str, float] = {"b1": 0.9, "b2": 0.95, "eps": 1e-8}
WEIGHT_DECAY_DEFAULT = 0.1
# Adafactor (torch.optim.Adafactor's defaults): second-moment decay 1 - t**-0.8, update clipping at RMS 1,
# parameter scale floor 1e-3 (torch eps2, optax scale_by_param_block_rms' min_scale).
ADAFACTOR_DEFAULTS: dict[str, float] = {"decay_rate": 0.8, "clipping_threshold": 1.0, "min_param_scale": 1e-3}

# bitsandbytes' 8-bit optimizers: 256-element blocks, tensors under 4096 elements keep float32 state.
BLOCK_SIZE = 256
MIN_8BIT_SIZE = 4096


# ----------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def check_name(name: object) -> str:
    if not isinstance(name, str) or name not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer name={name!r} is not known; valid names: {', '.join(OPTIMIZER_NAMES)}")
    return name


def check_schedule(schedule: object, warmup: object, steps: object, min_lr_ratio: object = 0.0) -> None:
    """ValueError naming the argument unless ``schedule`` is known, ``0 <= warmup <= steps`` are ints,
    ``steps >= 1`` (``None`` is allowed for ``constant`` only) and ``0 <= min_lr_ratio <= 1``."""
    if not isinstance(schedule, str) or schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule={schedule!r} is not known; valid names: {', '.join(SCHEDULE_NAMES)}")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0 (number of warmup steps)")
    if steps is None:
        if schedule != "constant":
            raise ValueError(f"steps=None: the {schedule!r} schedule needs steps, an int >= 1 (total updates)")
    elif isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1 (total number of optimizer updates)")
    elif warmup > steps:
        raise ValueError(f"warmup={warmup} must not exceed steps={steps}")
    if not _is_number(min_lr_ratio) or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must be a float in [0, 1] (final lr / peak lr)")


def check_hparams(
    name: object,
    lr: object,
    weight_decay: object,
    *,
    schedule: object = "constant",
    warmup: object = 0,
    steps: object = None,
    min_lr_ratio: object = 0.0,
    b1: float | None = None,
    b2: float | None = None,
    eps: float | None = None,
) -> dict:
    """Checks everything ``build`` takes (``lr`` may be a callable schedule); returns the Adam hyper-parameters
    ``{"b1", "b2", "eps"}`` with the defaults filled in (adafactor: an empty dict; it takes no betas/eps)."""
    check_name(name)
    if callable(lr):
        if (schedule, warmup, steps, min_lr_ratio) != ("constant", 0, None, 0.0):
            raise ValueError("lr is a callable schedule: leave schedule/warmup/steps/min_lr_ratio at their defaults")
    elif not _is_number(lr) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr={lr!r} must be a positive finite float or a callable schedule step -> lr")
    else:
        check_schedule(schedule, warmup, steps, min_lr_ratio)
    if not _is_number(weight_decay) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be a finite float >= 0")
    given = {"b1": b1, "b2": b2, "eps": eps}
    if name == "adafactor":
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise ValueError(
                f"adafactor takes no {'/'.join(extra)} (it keeps no first moment and uses "
                f"torch.optim.Adafactor's eps); pass them only to adamw, adamw_fused or adamw8bit"
            )
        return {}
    out = {k: ADAMW_DEFAULTS[k] if v is None else v for k, v in given.items()}
    for k in ("b1", "b2"):
        if not _is_number(out[k]) or not 0.0 <= out[k] < 1.0:
            raise ValueError(f"{k}={out[k]!r} must be a float in [0, 1)")
    if not _is_number(out["eps"]) or not out["eps"] > 0:
        raise ValueError(f"eps={out['eps']!r} must be a float > 0")
    return {k: float(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------------
# Weight-decay rule and schedules
# ----------------------------------------------------------------------------------------------------------------


def decays(name: str) -> bool:
    """Whether the parameter called ``name`` (dotted, e.g. ``model.layers.0.input_layernorm.weight`` or
    ``layers.attn_norm``) gets weight decay: not for norm weights and biases, yes for everything else."""
    parts = [p for p in name.split(".") if p not in ("weight", "value")]
    return not (any(p.endswith("norm") for p in parts) or (parts and parts[-1].split("_")[-1] == "bias"))


def lr_factor(
    step: Any, *, schedule: str, warmup: int, steps: int | None, min_lr_ratio: float = 0.0, xp: Any = np
) -> Any:
    """The multiplier of the peak learning rate after ``step`` applied updates (see the module docstring).
    Arguments are assumed checked (:func:`check_schedule`); ``xp`` is ``numpy`` or ``jax.numpy``."""
    s = xp.asarray(step) * 1.0
    ramp = s / warmup if warmup > 0 else xp.ones_like(s)
    if schedule == "constant":
        value = xp.ones_like(s)
    else:
        span = steps - warmup
        progress = xp.clip((s - warmup) / span, 0.0, 1.0) if span > 0 else xp.ones_like(s)
        decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + xp.cos(math.pi * progress))
        value = min_lr_ratio + (1.0 - min_lr_ratio) * decay
    return xp.where(s < warmup, ramp, value)


# ----------------------------------------------------------------------------------------------------------------
# 8-bit block-wise quantisation (bitsandbytes' dynamic maps)
# ----------------------------------------------------------------------------------------------------------------


def dynamic_map(signed: bool = True) -> np.ndarray:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: 256 sorted float32
    values, dense near 0 (a decimal exponent 10**-6..10**0 and a linear fraction whose bits shrink as the
    exponent grows), so small moments keep relative precision inside a block scaled by its absmax. Computed
    in float64 and rounded once; bitsandbytes builds it with float32 torch ops, so a few entries differ by 1 ulp."""
    data: list[float] = []
    for i in range(7):
        n = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = np.linspace(0.1, 1.0, n)
        scaled = 10.0 ** (-6 + i) * (bounds[:-1] + bounds[1:]) / 2.0
        data += scaled.tolist()
        if signed:
            data += (-scaled).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return np.asarray(sorted(data), np.float64).astype(np.float32)


def quantization_map(signed: bool) -> np.ndarray:
    """The map the 8-bit optimizers round to: :func:`dynamic_map` with entry 0 (-0.993 signed, 0 unsigned) set
    to -1.0. The signed map then spans [-1, 1] (the block's most negative value is exact, like its most positive);
    the unsigned map has no exact 0, so a small second moment never rounds down to 0 (which would turn
    ``m / (sqrt(v) + eps)`` into ``m / eps``): it rounds to at least 3.25e-7 * absmax."""
    code = dynamic_map(signed)
    code[0] = -1.0
    return code


def quantize_blockwise(x: np.ndarray, code: np.ndarray, block_size: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of the rounding rule: flatten (C order), split into ``block_size`` blocks (the last one
    shorter), ``absmax`` = max |x| per block, ``x / absmax`` (a division, float32) rounded to the NEAREST map
    entry, ties to the lower index (bitsandbytes ``quantize_block``). A block of zeros stores absmax 0.
    Returns ``(codes uint8 [n_blocks, block_size], absmax float32 [n_blocks])``, the tail padded with zeros."""
    flat = np.asarray(x, np.float32).reshape(-1)
    n_blocks = -(-flat.size // block_size)
    blocks = np.zeros(n_blocks * block_size, np.float32)
    blocks[: flat.size] = flat
    blocks = blocks.reshape(n_blocks, block_size)
    absmax = np.abs(blocks).max(axis=1)
    safe = np.where(absmax > 0, absmax, np.float32(1.0))[:, None]
    normed = np.where(absmax[:, None] > 0, blocks / safe, np.float32(0.0)).astype(np.float32)
    idx = np.clip(np.searchsorted(code, normed, side="right") - 1, 0, code.size - 2)
    right_closer = np.abs(normed - code[idx + 1]) < np.abs(normed - code[idx])
    return (idx + right_closer).astype(np.uint8), absmax.astype(np.float32)


def dequantize_blockwise(codes: np.ndarray, absmax: np.ndarray, code: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`quantize_blockwise`: ``code[codes] * absmax`` per block, cut back to ``shape``."""
    size = int(np.prod(shape))
    return (code[codes] * absmax[:, None]).reshape(-1)[:size].reshape(shape)
