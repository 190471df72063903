"""Dtype names shared by both twins: the floating dtypes a model, checkpoint or policy may use, the
precision presets, and the integer dtypes accepted for token ids.

    from jaxattn.spec.dtypes import PRECISION_PRESETS
    PRECISION_PRESETS["bf16"]  # ("float32", "bfloat16", "float32"): params, compute, output

Each framework maps these names to its own dtype objects (``jnp.dtype(name)`` / ``getattr(torch, name)``).
"""

from __future__ import annotations

# Floating dtypes a model, a checkpoint or a loader may be asked for.
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# Floating dtypes a precision Policy field may hold.
POLICY_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")

# Precision presets: name -> (param dtype, compute dtype, output dtype). Same names in both packages.
PRECISION_PRESETS: dict[str, tuple[str, str, str]] = {
    "fp32": ("float32", "float32", "float32"),
    "bf16": ("float32", "bfloat16", "float32"),
    "fp16": ("float32", "float16", "float32"),
    "bf16-pure": ("bfloat16", "bfloat16", "float32"),
}

# Integer dtypes accepted for token ids, positions and segment ids (bool is refused in both packages).
ID_DTYPES: tuple[str, ...] = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


def check_model_dtype(name: str, arg: str = "dtype") -> str:
    """``name`` if it is one of :data:`MODEL_DTYPES`, else a ValueError naming ``arg``."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"{arg}={name!r} is not supported; use one of {', '.join(MODEL_DTYPES)}")
    return name
