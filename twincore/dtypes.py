"""Dtype names shared by both twins: the floating dtypes a model, checkpoint or policy may use, the
precision presets, and the integer dtypes accepted for token ids.

    from twincore.dtypes import PRECISION_PRESETS, check_model_dtype
    PRECISION_PRESETS["bf16"]  # ("float32", "bfloat16", "float32"): params, compute, output
    check_model_dtype("bf16")  # "bfloat16": a loader's dtype= takes the short names too

Each framework maps these names to its own dtype objects (``jnp.dtype(name)`` / ``getattr(torch, name)``).
"""

from __future__ import annotations

# Floating dtypes a model, a checkpoint or a loader may be asked for.
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# Floating dtypes a precision Policy field may hold.
POLICY_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")

# Short names a loader's ``dtype=`` also takes (the spelling of ``--precision``): name -> the full dtype name. As a
# ``dtype=`` they name the WEIGHTS' dtype ("bf16" = bfloat16 weights); as a ``--precision`` preset, "bf16" keeps
# float32 weights and computes in bfloat16 (``bf16-pure`` is bfloat16 weights there).
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

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
    """The full name of ``name``, one of :data:`MODEL_DTYPES` or a short name of :data:`DTYPE_ALIASES`
    (``"bf16"`` -> ``"bfloat16"``); else a ValueError naming ``arg`` and every accepted name."""
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    if name not in MODEL_DTYPES:
        raise ValueError(
            f"{arg}={name!r} is not supported; use one of {', '.join(MODEL_DTYPES)} (or {', '.join(DTYPE_ALIASES)})"
        )
    return name


class PolicyPresets:
    """The preset half of both twins' ``Policy`` (a frozen dataclass of ``param_dtype``, ``compute_dtype``,
    ``output_dtype`` whose ``__post_init__`` turns a dtype NAME into its framework's dtype): a preset by name, the
    name back, the repr and the name-or-policy lookup, written once.

        Policy.preset("bf16").name  # "bf16";  Policy.get(policy) is policy
    """

    @classmethod
    def preset(cls, name: str):
        """The policy named ``name``, one of :data:`PRECISION_PRESETS` (the same names in both twins)."""
        if not isinstance(name, str) or name not in PRECISION_PRESETS:
            raise ValueError(f"unknown precision preset name={name!r}; valid names: {', '.join(PRECISION_PRESETS)}")
        return cls(*PRECISION_PRESETS[name])

    @classmethod
    def get(cls, name):
        """``preset(name)``; a policy of this class passes through unchanged."""
        return name if isinstance(name, cls) else cls.preset(name)

    @property
    def name(self) -> str | None:
        """The preset this policy equals, or ``None`` for a custom combination."""
        return next((n for n in PRECISION_PRESETS if type(self).preset(n) == self), None)

    def __repr__(self) -> str:
        tag = f" ({self.name})" if self.name else ""
        return (
            f"Policy(param_dtype={self.param_dtype}, compute_dtype={self.compute_dtype}, "
            f"output_dtype={self.output_dtype}){tag}"
        )
