"""Tile arithmetic shared by the Pallas kernels (``flash``, ``flash_decode``, ``mosaic``).

Block-size helpers (:func:`cdiv`, :func:`next_pow2`, :func:`is_pow2`, :data:`MIN_BLOCK`), the online-softmax
constants (:data:`NEG`, :data:`LOG2E`, :data:`LN2`), the tile's scores (:func:`scores`: fp32 tensor-core
:func:`dot`, fp32 operands as three TF32 passes, then scale and softcap) and visibility (:func:`tile_mask`),
and the Triton launch plumbing (:func:`triton_call`, :func:`triton_compiler_params`, :func:`resolve_interpret`,
:func:`unpack_refs`)::

    s, t = scores(q_tile, k_tile, scale, softcap)             # [bq, bk] fp32, tanh(s/c) or None
    m = tile_mask(q_pos[:, None], k_pos[None, :], shift=sk - sq, left=None, right=0)   # causal
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .target import platform_of

try:  # the Triton-specific Pallas module; its compiler-params class was renamed across jax versions
    from jax.experimental.pallas import triton as plt
except Exception:  # pragma: no cover - very old / stripped jax
    plt = None

__all__ = [
    "LN2",
    "LOG2E",
    "MIN_BLOCK",
    "NEG",
    "cdiv",
    "dot",
    "dot_tf32x3",
    "is_pow2",
    "next_pow2",
    "plt",
    "resolve_interpret",
    "scores",
    "split_tf32",
    "tile_mask",
    "to_tf32",
    "triton_call",
    "triton_compiler_params",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity" for the running max
MIN_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16


# ----------------------------------------------------------------------------------------- block sizes
def is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a, b: int):
    """``ceil(a / b)`` for a Python/NumPy int ``a`` (an int) or an integer array (``lax.div``, traced)."""
    if isinstance(a, (int, np.integer)):
        return -(-int(a) // b)
    a = jnp.asarray(a)
    return lax.div(a + jnp.asarray(b - 1, a.dtype), jnp.asarray(b, a.dtype))


# ----------------------------------------------------------------------------------------- scores
def dot(a, b, contract_a: int, contract_b: int):
    """fp32-accumulating 2-D matmul on the tensor cores; fp32 operands go through :func:`dot_tf32x3`."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    if a.dtype == jnp.float32:
        return dot_tf32x3(a, b, dims)
    return lax.dot_general(a, b, dims, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)


_TF32_MASK = np.int32(-(1 << 13))  # 0xFFFFE000: sign, exponent and the 10 mantissa bits TF32 keeps
_TF32_HALF = np.int32(1 << 12)  # half a TF32 unit in the last place: add, then mask = round to nearest


def to_tf32(x):
    """``x`` rounded to the nearest TF32 value (ties away from zero), kept in fp32; exact on the bits, so the
    GPU and the CPU interpreter agree.  Only |x| within 2^-11 of fp32's max rounds up to inf."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type((bits + _TF32_HALF) & _TF32_MASK, jnp.float32)


def split_tf32(x):
    """``(hi, lo)`` TF32 values with ``hi + lo = x`` to ~2^-22 relative (``lo`` = TF32 of the exact fp32
    remainder ``x - hi``), so every TF32 tensor-core product of the pieces is exact."""
    hi = to_tf32(x)
    return hi, to_tf32(x - hi)


def dot_tf32x3(a, b, dims):
    """fp32 matmul as three TF32 tensor-core passes (``hi*lo + lo*hi`` first, then ``hi*hi``: cuBLAS/Triton
    "tf32x3"); the dropped ``lo*lo`` and the roundings leave ~2^-21 relative per product, the order of fp32's
    own accumulation error (measured against fp64 in ``test_flash.py``).  Why not ``Precision.HIGHEST``:
    ``benchmarks/NOTES.md``, "attention kernels: history"."""
    (a_hi, a_lo), (b_hi, b_lo) = split_tf32(a), split_tf32(b)

    def mm(x, y):  # DEFAULT on fp32 = TF32 in the Triton lowering; exact here as x, y are TF32 values
        return lax.dot_general(x, y, dims, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)

    return (mm(a_hi, b_lo) + mm(a_lo, b_hi)) + mm(a_hi, b_hi)


def scores(q, k, scale: float, softcap: float | None):
    """``softcap(scale * q k^T)`` in fp32 and ``tanh`` (for the backward) or None."""
    s = dot(q, k, 1, 1) * scale
    if softcap is None:
        return s, None
    t = jnp.tanh(s / softcap)
    return softcap * t, t


def tile_mask(
    q_pos,
    k_pos,
    *,
    shift: int = 0,
    left: int | None = None,
    right: int | None = None,
    k_len: int | None = None,
    q_seg=None,
    k_seg=None,
):
    """Visibility of a score tile (design §4), or None when nothing can be masked.

    ``q_pos``/``k_pos``: query/key positions, already broadcast against each other (``[bq, 1]`` and
    ``[1, bk]``, or transposed); key j is visible to query i iff ``i + shift - left <= j <= i + shift + right``
    (``shift = Sk - Sq``: bottom-right; ``left``/``right`` from ``twincore.attention.visible_bounds``), ``j < k_len``
    (padded keys; None: no padding) and ``q_seg == k_seg`` (same broadcast; None: no segment ids)."""
    m = None

    def _and(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if k_len is not None:
        m = _and(m, k_pos < k_len)
    if right is not None:
        m = _and(m, k_pos <= q_pos + (shift + right))
    if left is not None:
        m = _and(m, k_pos >= q_pos + (shift - left))
    if q_seg is not None:
        m = _and(m, q_seg == k_seg)
    return m


# ----------------------------------------------------------------------------------------- launch
def unpack_refs(refs, n_in: int, has_seg: bool):
    """``(operand refs, qs_ref, ks_ref, output refs)`` of a kernel's ``refs``: its ``n_in`` operands, then the
    query and key segment ids (None, and absent from ``refs``, without segment ids), then its outputs."""
    if has_seg:
        return refs[:n_in], refs[n_in], refs[n_in + 1], refs[n_in + 2 :]
    return refs[:n_in], None, None, refs[n_in:]


def triton_call(
    kernel, *, name, grid, in_specs, out_specs, out_shapes, args, interpret, poison, num_warps, num_stages
) -> list:
    """``pl.pallas_call`` of ``kernel`` with the Triton params (lists of outputs in and out); with ``poison`` every
    output buffer is first filled with NaN (passed in and aliased to the output), so a block the kernel forgets to
    write shows up as NaN on a GPU too (interpret mode already starts outputs as NaN)."""
    in_specs, args, aliases, body = list(in_specs), list(args), {}, kernel
    if poison:
        n_in, n_out = len(args), len(out_shapes)
        for idx, (shape, spec) in enumerate(zip(out_shapes, out_specs)):
            aliases[n_in + idx] = idx
            args.append(jnp.full(shape.shape, jnp.nan, shape.dtype))
            in_specs.append(spec)

        def body(*refs):  # drop the poisoned input refs; the output refs alias them
            return kernel(*refs[:n_in], *refs[n_in + n_out :])

    return pl.pallas_call(
        body,
        grid=grid,
        in_specs=in_specs,
        out_specs=list(out_specs),
        out_shape=list(out_shapes),
        input_output_aliases=aliases,
        interpret=interpret,
        name=name,
        compiler_params=triton_compiler_params(num_warps, num_stages),
    )(*args)


def triton_compiler_params(num_warps: int, num_stages: int):
    """``CompilerParams`` for the Triton lowering: ``jax.experimental.pallas.triton.CompilerParams`` on
    jax >= 0.6 (0.10 and 0.11 included), ``TritonCompilerParams`` in older releases."""
    candidates = []
    if plt is not None:
        candidates += [getattr(plt, "CompilerParams", None), getattr(plt, "TritonCompilerParams", None)]
    candidates += [getattr(pl, "TritonCompilerParams", None), getattr(pl, "GPUCompilerParams", None)]
    for cls in candidates:
        if cls is not None:
            return cls(num_warps=num_warps, num_stages=num_stages)
    return None


def resolve_interpret(interpret, q=None) -> bool:
    """``interpret=None``: interpret unless the trace targets a GPU (``jaxattn.attention.target_platform``,
    q's devices or sharding, or jax's default backend), so a deviceless GPU compile gets the Triton kernel."""
    if interpret is None:
        return platform_of(q) != "gpu"
    if not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret must be None or a bool, got {interpret!r} of type {type(interpret).__name__}")
    return bool(interpret)
