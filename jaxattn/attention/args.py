"""Arguments of one attention call: :class:`AttnArgs`, :func:`normalize` (the contract check) and :func:`mask`.

``normalize`` checks a call to :func:`jaxattn.attention.dot_product_attention` once, with the contract shared
with torchref (:func:`twincore.attention.check_call`: same rules, same messages), and returns an
:class:`AttnArgs` with every default filled in, so each backend only reads checked values.  ``mask`` is the
single jnp definition of which key a query may see (design §4): bottom-right causal, sliding window,
segment ids.  It is hand-written because no library function implements this exact contract
(``jax.nn.dot_product_attention`` has top-left causal in some versions, no softcap and no (left, right) window)::

    args = normalize(q, k, v, causal=True, window=(128, None))   # AttnArgs(causal=True, window=(128, 0), ...)
    vis = mask(q.shape[1], k.shape[1], args)                      # [Sq, Sk] bool
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from twincore.attention import MAX_HEAD_DIM, SUPPORTED_DTYPES, check_call, visible_bounds

__all__ = ["AttnArgs", "normalize", "mask", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]

Window = tuple[int | None, int | None] | None


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
    softcap: float | None = None

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
def _describe(x):
    """``(shape, dtype name)`` of anything with ``.shape`` and ``.dtype`` (jax/numpy arrays, tracers,
    ShapeDtypeStructs), else None."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return None
    try:
        name = jnp.dtype(x.dtype).name
    except Exception:  # pragma: no cover - exotic dtype objects
        name = str(x.dtype)
    return tuple(x.shape), name


def normalize(q, k, v, *, causal=False, segment_ids=None, scale=None, window=None, softcap=None) -> AttnArgs:
    """Validate one attention call and return its :class:`AttnArgs`.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; q, k, v share one dtype in float32/bfloat16/float16;
    ``Hq % Hkv == 0``; ``1 <= D <= 256``.  ``segment_ids`` is ``None``, an int ``[B, S]`` array
    (self-attention, needs ``Sq == Sk``) or a pair ``(q_ids [B, Sq], kv_ids [B, Sk])``.
    Raises ``TypeError`` / ``ValueError`` naming the argument, the value and what is accepted.
    """
    c = check_call(
        q,
        k,
        v,
        causal=causal,
        segment_ids=segment_ids,
        scale=scale,
        window=window,
        softcap=softcap,
        layout="bshd",
        describe=_describe,
    )
    return AttnArgs(
        causal=c.causal,
        q_segment_ids=c.q_ids,
        kv_segment_ids=c.kv_ids,
        scale=c.scale,
        window=c.window,
        softcap=c.softcap,
    )


# ----------------------------------------------------------------------------------------------- mask
def mask(q_len: int, kv_len: int, args: AttnArgs, q_ids=None, kv_ids=None, *, q_pos=None, kv_pos=None):
    """Boolean visibility ``[..., Sq, Sk]``: True where query i may attend to key j.

    ``q_len``/``kv_len`` are the FULL sequence lengths (they fix the bottom-right causal shift
    ``kv_len - q_len``).  By default every query ``0..q_len-1`` and key ``0..kv_len-1`` is covered; pass
    ``q_pos``/``kv_pos`` (int index vectors, may be traced) to build the mask for one block of a blockwise
    kernel — positions ``>= q_len`` / ``>= kv_len`` (padding) are masked out.  ``q_ids [..., len(q_pos)]``
    and ``kv_ids [..., len(kv_pos)]`` are the segment ids of those positions (default: ``args``' ids, which
    must then match the default positions); the result broadcasts over their leading dims.

    Rule (design §4): with ``i_abs = i + kv_len - q_len``, key j is visible iff
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
    left, right = visible_bounds(args.causal, args.window)
    if left is not None:
        m = m & (j >= i_abs - left)
    if right is not None:
        m = m & (j <= i_abs + right)
    if q_ids is not None:
        m = m & (jnp.asarray(q_ids)[..., :, None] == jnp.asarray(kv_ids)[..., None, :])
    return m
