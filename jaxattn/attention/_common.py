"""Argument checking and the visibility rule shared by every attention backend.

``normalize`` validates a call to :func:`jaxattn.attention.dot_product_attention` once, in one place, and
returns an :class:`AttnArgs` with every default filled in, so each backend (xla, chunked, flash, mosaic,
cudnn) only reads already-checked values.  ``mask`` is the single definition of which key a query may see
(CONVENTIONS §4): bottom-right causal, sliding window, segment ids.  It is hand-written because no library
function implements this exact contract (``jax.nn.dot_product_attention`` has top-left causal in some
versions, no softcap and no (left, right) window).

``current_target`` / ``platform_of`` / ``gpu_compute_capability`` say where a traced call will run, so the
dispatcher and every backend's ``supports()`` decide for the target, not for the host: an explicit
``target_platform("gpu", compute_capability=(9, 0))`` block (compiling for an H100 on a CPU host), else the
array's devices or sharding, else the mesh in context, else jax's default backend.

Error messages name the argument, the value received and what is accepted (CONVENTIONS §10).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
from typing import Any, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AttnArgs", "normalize", "mask", "platform_of", "gpu_compute_capability", "MAX_HEAD_DIM",
           "SUPPORTED_DTYPES", "Target", "current_target", "target_platform"]

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
        if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in segment_ids):
            raise TypeError(f"segment_ids must be an integer array [B, S] or a pair (q_ids [B, Sq], "
                            f"kv_ids [B, Sk]) of them, got a {type(segment_ids).__name__} of "
                            f"{sorted({type(x).__name__ for x in segment_ids})}")
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
# The target of a trace: where the traced computation will run.  Read, in order, from
#   1. an explicit ``target_platform(...)`` block (the only way to say "compile for an H100" when nothing in the
#      trace names a device, e.g. ``jit(f).lower(lowering_platforms=("cuda",))`` on a CPU host: jax 0.10/0.11
#      pass ``lowering_platforms`` to the lowering, after tracing, so a trace cannot read them);
#   2. the array itself: a committed array's devices, or the sharding jax records on its type
#      (``jax.typeof(x).sharding.mesh.abstract_device``: a ShapeDtypeStruct or array sharded over GPU devices,
#      including a deviceless H100 topology's, carries the platform and device kind into the trace);
#   3. the mesh set by ``jax.sharding.use_mesh`` / ``jax.set_mesh`` (its abstract device);
#   4. jax's default backend.
@dataclasses.dataclass(frozen=True)
class Target:
    """Where a trace will run: ``platform`` ("cpu", "gpu", "tpu"), the GPU's ``compute_capability``
    ``(major, minor)`` (None when unknown or not a GPU) and the ``device_kind`` string when known."""

    platform: str
    compute_capability: Optional[Tuple[int, int]] = None
    device_kind: Optional[str] = None


_TARGET: contextvars.ContextVar = contextvars.ContextVar("jaxattn_attention_target", default=None)
_PLATFORMS = ("cpu", "gpu", "tpu")
# device_kind -> compute capability, for the trace-time case where only jax's AbstractDevice (platform and
# device kind, no compute capability) is known.  First matching substring wins.
_KIND_CC = (("H100", (9, 0)), ("H200", (9, 0)), ("H800", (9, 0)), ("H20", (9, 0)), ("GH200", (9, 0)),
            ("B200", (10, 0)), ("B300", (10, 3)), ("GB200", (10, 0)), ("A100", (8, 0)), ("A800", (8, 0)),
            ("A10", (8, 6)), ("A40", (8, 6)), ("A6000", (8, 6)), ("L40", (8, 9)), ("L4", (8, 9)),
            ("RTX 6000 Ada", (8, 9)), ("V100", (7, 0)), ("T4", (7, 5)))


def _canonical_platform(plat: str) -> str:
    plat = str(plat).lower()
    return "gpu" if plat in ("gpu", "cuda", "rocm") else plat


def _parse_cc(cc) -> Optional[Tuple[int, int]]:
    if cc is None:
        return None
    if isinstance(cc, str):
        parts = cc.replace("sm_", "").rstrip("a").split(".")
        if len(parts) == 1 and parts[0].isdigit() and len(parts[0]) >= 2:  # "90" / "sm_90a"
            parts = [parts[0][:-1], parts[0][-1]]
        cc = tuple(parts)
    try:
        major, minor = (int(t) for t in tuple(cc)[:2])
    except (TypeError, ValueError):
        raise ValueError(f"compute_capability must be (major, minor) ints, 'major.minor' or 'sm_XY', "
                         f"got {cc!r}") from None
    return major, minor


def _cc_from_kind(kind: Optional[str]) -> Optional[Tuple[int, int]]:
    if not kind:
        return None
    for key, cc in _KIND_CC:
        if key in kind:
            return cc
    return None


@contextlib.contextmanager
def target_platform(platform: str, *, compute_capability=None, device_kind: Optional[str] = None
                    ) -> Iterator[Target]:
    """Within the block, every trace of an attention call targets ``platform`` ("cpu", "gpu"/"cuda",
    "tpu"), whatever jax's default backend is: the dispatcher's default order, each backend's
    ``supports()`` and the Pallas kernels' ``interpret=None`` follow it.  For compiling a GPU program on a
    CPU host ("deviceless", ahead of time)::

        with target_platform("gpu", compute_capability=(9, 0)):
            lowered = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))

    ``compute_capability``: ``(9, 0)``, ``"9.0"`` or ``"sm_90a"``; default: from ``device_kind`` when it
    names a known GPU, else unknown (backends that need it decline).  A ``contextvars.ContextVar``: per
    thread / asyncio task; nested blocks replace the outer target."""
    if not isinstance(platform, str) or _canonical_platform(platform) not in _PLATFORMS:
        raise ValueError(f"target_platform: platform must be one of {_PLATFORMS} (or 'cuda'), got {platform!r}")
    plat = _canonical_platform(platform)
    cc = _parse_cc(compute_capability)
    if plat != "gpu" and cc is not None:
        raise ValueError(f"target_platform: compute_capability is for platform 'gpu', got platform {platform!r}")
    if plat == "gpu" and cc is None:
        cc = _cc_from_kind(device_kind)
    token = _TARGET.set(Target(plat, cc, device_kind))
    try:
        yield _TARGET.get()
    finally:
        _TARGET.reset(token)


def _device_target(dev) -> Target:
    plat = _canonical_platform(dev.platform)
    kind = getattr(dev, "device_kind", None)
    cc = None
    if plat == "gpu":
        try:
            cc = _parse_cc(getattr(dev, "compute_capability", None))
        except ValueError:
            cc = None
        cc = cc or _cc_from_kind(kind)
    return Target(plat, cc, kind)


def _abstract_device_target(mesh) -> Optional[Target]:
    ad = getattr(mesh, "abstract_device", None)
    if ad is None:
        return None
    plat = _canonical_platform(ad.platform)
    kind = getattr(ad, "device_kind", None)
    return Target(plat, _cc_from_kind(kind) if plat == "gpu" else None, kind)


def _array_target(x) -> Optional[Target]:
    try:  # a committed jax array; a tracer raises
        return _device_target(next(iter(x.devices())))
    except Exception:
        pass
    sharding = getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer) else None
    if sharding is not None:  # a ShapeDtypeStruct with a concrete sharding
        try:
            return _device_target(next(iter(sharding.device_set)))
        except Exception:
            pass
    try:  # inside a trace: the sharding recorded on the type (abstract mesh with an abstract device)
        typeof = getattr(jax, "typeof", None)
        aval = typeof(x) if typeof is not None else x.aval
        return _abstract_device_target(aval.sharding.mesh)
    except Exception:
        return None


def current_target(x=None) -> Target:
    """The :class:`Target` of a trace involving ``x`` (see the rule above this function)."""
    target = _TARGET.get()
    if target is not None:
        return target
    if x is not None:
        target = _array_target(x)
        if target is not None:
            return target
    try:
        target = _abstract_device_target(jax.sharding.get_abstract_mesh())
    except Exception:  # pragma: no cover - an older jax without get_abstract_mesh
        target = None
    if target is not None:
        return target
    plat = _canonical_platform(jax.default_backend())
    if plat != "gpu":
        return Target(plat)
    try:
        return _device_target(jax.devices()[0])
    except Exception:  # pragma: no cover
        return Target(plat)


def platform_of(x=None) -> str:
    """Platform ("cpu", "gpu", "tpu") the computation on ``x`` targets: an active :func:`target_platform`
    block, else ``x``'s devices or sharding, else the mesh in context, else jax's default backend.
    CUDA/ROCm are reported as "gpu"."""
    return current_target(x).platform


def gpu_compute_capability(x=None) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of the GPU the computation on ``x`` targets (same rule as :func:`platform_of`),
    or None when the target is not a GPU or its compute capability is unknown."""
    target = current_target(x)
    return target.compute_capability if target.platform == "gpu" else None
