"""Argument checking and the visibility rule shared by every attention backend.

``normalize`` validates a call to :func:`jaxattn.attention.dot_product_attention` once, in one place, and
returns an :class:`AttnArgs` with every default filled in, so each backend (xla, chunked, flash, mosaic,
cudnn) only reads already-checked values.  ``mask`` is the single definition of which key a query may see
(CONVENTIONS §4): bottom-right causal, sliding window, segment ids.  It is hand-written because no library
function implements this exact contract (``jax.nn.dot_product_attention`` has top-left causal in some
versions, no softcap and no (left, right) window).

Error messages name the argument, the value received and what is accepted (CONVENTIONS §10).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AttnArgs", "normalize", "mask", "platform_of", "gpu_compute_capability", "MAX_HEAD_DIM",
           "SUPPORTED_DTYPES"]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

Window = Optional[Tuple[Optional[int], Optional[int]]]


@dataclasses.dataclass(frozen=True)
class AttnArgs:
    """Validated attention options, defaults filled.

    * ``causal``: bottom-right aligned causal mask (query i sees keys ``j <= i + Sk - Sq``).
    * ``q_segment_ids`` ``[B, Sq]`` / ``kv_segment_ids`` ``[B, Sk]``: integer arrays or both ``None``.
      Self-attention ids ``[B, S]`` are stored in both fields.
    * ``scale``: the float multiplying ``q @ k^T`` (default ``1/sqrt(D)``).
    * ``window``: ``(left, right)`` with ``None`` = unbounded on that side, or ``None`` for no window.
      With ``causal=True`` the right side is ``0``.  A window that restricts nothing (``(None, None)``,
      or ``(None, 0)`` together with ``causal``) is stored as ``None``.
    * ``softcap``: ``c`` in ``c * tanh(s / c)``, or ``None``.

    Registered as a pytree (segment ids are the leaves, the rest is static), so an ``AttnArgs`` can be
    passed through ``jax.jit`` / ``jax.vmap`` as an ordinary argument.  ``static`` gives the hashable part.
    """

    causal: bool = False
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    scale: float = 1.0
    window: Window = None
    softcap: Optional[float] = None

    @property
    def has_segment_ids(self) -> bool:
        return self.q_segment_ids is not None

    @property
    def static(self) -> tuple:
        """Hashable ``(causal, scale, window, softcap)``, e.g. for ``nondiff_argnums`` / jit static args."""
        return (self.causal, self.scale, self.window, self.softcap)


def _attn_flatten(a: AttnArgs):
    return (a.q_segment_ids, a.kv_segment_ids), (a.causal, a.scale, a.window, a.softcap)


def _attn_unflatten(aux, children):
    causal, scale, window, softcap = aux
    return AttnArgs(causal, children[0], children[1], scale, window, softcap)


jax.tree_util.register_pytree_node(AttnArgs, _attn_flatten, _attn_unflatten)


# ----------------------------------------------------------------------------------------------- checks
def _dtype_name(x) -> str:
    try:
        return jnp.dtype(x.dtype).name
    except Exception:  # pragma: no cover - exotic dtype objects
        return str(getattr(x, "dtype", type(x).__name__))


def _shape(name: str, x) -> tuple:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array with .shape and .dtype, got {type(x).__name__}")
    return tuple(x.shape)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _positive_float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive finite Python/NumPy number or None, got {value!r} "
                        f"of type {type(value).__name__} (a traced value is not accepted: it must be static)")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return value


def _check_segment_ids(name: str, ids, batch: int, length: int, length_name: str):
    shape = _shape(name, ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {_dtype_name(ids)} "
                        f"(accepted: any signed/unsigned integer dtype)")
    if shape != (batch, length):
        raise ValueError(f"{name} must have shape (B, {length_name}) = {(batch, length)}, got {shape}")
    return ids


def _normalize_window(window, causal: bool) -> Window:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a (left, right) pair of non-negative ints or None, "
                         f"got {window!r}")
    sides = []
    for side_name, w in zip(("left", "right"), window):
        if w is None:
            sides.append(None)
            continue
        if not _is_int(w):
            raise TypeError(f"window {side_name} side must be a non-negative int or None, got {w!r} "
                            f"of type {type(w).__name__} (window={window!r})")
        if w < 0:
            raise ValueError(f"window {side_name} side must be >= 0 or None, got {w} (window={window!r})")
        sides.append(int(w))
    left, right = sides
    if causal:
        right = 0
    if left is None and (right is None or causal):
        return None  # restricts nothing beyond what `causal` already does
    return (left, right)


def normalize(q, k, v, *, causal=False, segment_ids=None, scale=None, window=None, softcap=None) -> AttnArgs:
    """Validate one attention call and return its :class:`AttnArgs`.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; q, k, v share one dtype in float32/bfloat16/float16;
    ``Hq % Hkv == 0``; ``1 <= D <= 256``.  ``segment_ids`` is ``None``, an int ``[B, S]`` array
    (self-attention, needs ``Sq == Sk``) or a pair ``(q_ids [B, Sq], kv_ids [B, Sk])``.
    Raises ``TypeError`` / ``ValueError`` naming the argument, the value and what is accepted.
    """
    qs, ks, vs = _shape("q", q), _shape("k", k), _shape("v", v)
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) != 4:
            want = "[B, Sq, Hq, D]" if name == "q" else "[B, Sk, Hkv, D]"
            raise ValueError(f"{name} must have rank 4 {want} (the JAX layout), got shape {s} (rank {len(s)})")
    dts = {n: _dtype_name(x) for n, x in (("q", q), ("k", k), ("v", v))}
    for n, d in dts.items():
        if d not in SUPPORTED_DTYPES:
            raise TypeError(f"{n} dtype must be one of {SUPPORTED_DTYPES}, got {d}")
    if len(set(dts.values())) != 1:
        raise TypeError(f"q, k, v must share one dtype, got q={dts['q']}, k={dts['k']}, v={dts['v']} "
                        f"(cast them to a common dtype in {SUPPORTED_DTYPES})")
    if ks != vs:
        raise ValueError(f"k and v must have the same shape [B, Sk, Hkv, D], got k {ks} and v {vs}")
    b, sq, hq, d = qs
    bk, sk, hkv, dk = ks
    if bk != b:
        raise ValueError(f"batch size of k/v ({bk}, shape {ks}) must equal batch size of q ({b}, shape {qs})")
    if dk != d:
        raise ValueError(f"head_dim of k/v ({dk}, shape {ks}) must equal head_dim of q ({d}, shape {qs})")
    for n, val in (("batch size B", b), ("query length Sq", sq), ("key length Sk", sk),
                   ("query heads Hq", hq), ("kv heads Hkv", hkv), ("head_dim D", d)):
        if val < 1:
            raise ValueError(f"{n} must be >= 1, got {val} (q shape {qs}, k shape {ks})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim D={d} is too large: accepted 1 <= D <= {MAX_HEAD_DIM} (q shape {qs})")
    if hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv} (GQA/MQA); "
                         f"q shape {qs}, k shape {ks}")

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")
    causal = bool(causal)

    if segment_ids is None:
        q_ids = kv_ids = None
    elif isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids as a sequence must be a pair (q_ids [B, Sq], kv_ids [B, Sk]), "
                             f"got {len(segment_ids)} elements")
        q_ids = _check_segment_ids("segment_ids[0] (q_ids)", segment_ids[0], b, sq, "Sq")
        kv_ids = _check_segment_ids("segment_ids[1] (kv_ids)", segment_ids[1], b, sk, "Sk")
    else:
        if sq != sk:
            raise ValueError(f"segment_ids as one [B, S] array needs Sq == Sk (self-attention), got Sq={sq}, "
                             f"Sk={sk}; pass a pair (q_ids [B, Sq], kv_ids [B, Sk]) instead")
        q_ids = kv_ids = _check_segment_ids("segment_ids", segment_ids, b, sq, "S")

    scale = 1.0 / math.sqrt(d) if scale is None else _positive_float("scale", scale)
    softcap = None if softcap is None else _positive_float("softcap", softcap)
    window = _normalize_window(window, causal)
    return AttnArgs(causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids, scale=scale,
                    window=window, softcap=softcap)


# ----------------------------------------------------------------------------------------------- mask
def mask(q_len: int, kv_len: int, args: AttnArgs, q_ids=None, kv_ids=None, *, q_pos=None, kv_pos=None):
    """Boolean visibility ``[..., Sq, Sk]``: True where query i may attend to key j.

    ``q_len``/``kv_len`` are the FULL sequence lengths (they fix the bottom-right causal shift
    ``kv_len - q_len``).  By default every query ``0..q_len-1`` and key ``0..kv_len-1`` is covered; pass
    ``q_pos``/``kv_pos`` (int index vectors, may be traced) to build the mask for one block of a blockwise
    kernel — positions ``>= q_len`` / ``>= kv_len`` (padding) are masked out.  ``q_ids [..., len(q_pos)]``
    and ``kv_ids [..., len(kv_pos)]`` are the segment ids of those positions (default: ``args``' ids, which
    must then match the default positions); the result broadcasts over their leading dims.

    Rule (CONVENTIONS §4): with ``i_abs = i + kv_len - q_len``, key j is visible iff
    ``causal -> j <= i_abs``; ``window (l, r) -> i_abs - l <= j <= i_abs + r``; ``q_ids[i] == kv_ids[j]``.
    """
    if q_pos is None:
        q_pos = jnp.arange(q_len, dtype=jnp.int32)
    if kv_pos is None:
        kv_pos = jnp.arange(kv_len, dtype=jnp.int32)
    if q_ids is None and kv_ids is None and args.q_segment_ids is not None:
        q_ids, kv_ids = args.q_segment_ids, args.kv_segment_ids
    if (q_ids is None) != (kv_ids is None):
        raise ValueError("mask: pass both q_ids and kv_ids, or neither")
    i = jnp.asarray(q_pos, jnp.int32)[:, None]
    j = jnp.asarray(kv_pos, jnp.int32)[None, :]
    i_abs = i + (kv_len - q_len)
    m = (i < q_len) & (j < kv_len) & (j >= 0) & (i >= 0)
    if args.causal:
        m = m & (j <= i_abs)
    if args.window is not None:
        left, right = args.window
        if left is not None:
            m = m & (j >= i_abs - left)
        if right is not None:
            m = m & (j <= i_abs + right)
    if q_ids is not None:
        m = m & (jnp.asarray(q_ids)[..., :, None] == jnp.asarray(kv_ids)[..., None, :])
    return m


# ----------------------------------------------------------------------------------------------- platform
def platform_of(x=None) -> str:
    """Platform ("cpu", "gpu", "tpu") the array ``x`` lives on, or jax's default backend when ``x`` is a
    tracer / not a committed jax array (under ``jit`` the computation runs on the default backend unless
    placed otherwise).  CUDA/ROCm platforms are reported as "gpu"."""
    plat = None
    if x is not None:
        try:  # a tracer raises here
            plat = next(iter(x.devices())).platform
        except Exception:
            plat = None
    if plat is None:
        plat = jax.default_backend()
    return "gpu" if plat in ("gpu", "cuda", "rocm") else plat


def gpu_compute_capability(x=None):
    """``(major, minor)`` of the first GPU device (of ``x`` when given), or None when there is no GPU."""
    try:
        dev = None
        if x is not None:
            try:  # a tracer raises here
                dev = next(iter(x.devices()))
            except Exception:
                dev = None
        if dev is None:
            dev = jax.devices()[0]
        cc = getattr(dev, "compute_capability", None)
        if dev.platform not in ("gpu", "cuda") or cc is None:
            return None
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # pragma: no cover
        return None
