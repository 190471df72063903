"""What the deviceless compile targets: the GPU descriptions in ``benchmarks/targets/``, the dtypes by name and
the attention shape of the kernel compiles and the block search.

    devs = gpu_target.devices(target_config("h100"))   # one deviceless "NVIDIA H100 80GB HBM3"
    q, k, v = BENCH_SHAPE.structs(128, DTYPES["bf16"])  # ShapeDtypeStructs of one attention call
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin starts without a CUDA runtime

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

TARGETS_DIR = Path(__file__).resolve().parent.parent / "targets"
TARGETS = ("h100", "h200")
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def target_config(name: str) -> str:
    """Text of ``benchmarks/targets/<name>.txtpb`` (name in :data:`TARGETS`)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {TARGETS}")
    return (TARGETS_DIR / f"{name}.txtpb").read_text()


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """The attention call a kernel is compiled (and, on a GPU, timed) for: q ``[b, s, hq, D]``, k/v
    ``[b, s, hkv, D]``."""

    b: int = 1
    s: int = 4096
    hq: int = 16
    hkv: int = 16
    causal: bool = True

    def structs(self, d: int, dtype):
        """``(q, k, v)``: the ShapeDtypeStructs of this call at head dim ``d`` (unplaced)."""
        q = jax.ShapeDtypeStruct((self.b, self.s, self.hq, d), dtype)
        k = jax.ShapeDtypeStruct((self.b, self.s, self.hkv, d), dtype)
        return q, k, k


BENCH_SHAPE = AttnShape()  # the shape of the notes' peer comparison
GATE_SHAPE = AttnShape(b=1, s=256, hq=4, hkv=2)  # small: the CI gate (block sizes are capped by S)
