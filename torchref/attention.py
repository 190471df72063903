"""Attention for torchref: ``torch.nn.functional.scaled_dot_product_attention`` under the jaxattn contract.

Torch layout: q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``.  Same keywords as
``jaxattn.attention.dot_product_attention`` (CONVENTIONS §4): ``causal`` is bottom-right aligned when
``Sq != Sk`` (torch's ``is_causal`` is top-left there, so we pass ``causal_lower_right`` or a boolean
mask instead), ``window=(left, right)``, ``softcap`` (Gemma-2), ``segment_ids`` ``[B, S]`` or
``(q_ids, kv_ids)``; a query row that sees no key returns zeros (SDPA can return NaN for such rows, and NaN
in its backward would poison dk/dv, so those rows are given a harmless dummy key and their output zeroed).

``backend`` names map onto ``SDPBackend`` and the call runs under ``torch.nn.attention.sdpa_kernel``:
``xla``→MATH, ``flash``→FLASH_ATTENTION, ``chunked``→EFFICIENT_ATTENTION, ``cudnn``→CUDNN_ATTENTION
(``mosaic`` has no torch twin).  ``backend=None`` leaves the choice to SDPA (and to any ``sdpa_kernel`` or
:func:`attention_backend` block the caller opened).

Hand-written parts, and why: the mask rule (SDPA has no bottom-right window or segment ids; this file must
not import jax, so the rule is restated here and the parity tests pin the two copies to each other), and a
plain-math path for ``softcap`` (SDPA cannot express a score modification; ``flex_attention`` could on GPU
but is not used here), which only the MATH backend (``xla``) may serve — other backends raise a clear error.
GQA: SDPA's ``enable_gqa`` works only with the FLASH and MATH backends, so for EFFICIENT/CUDNN the kv heads
are expanded (a copy) before the call.

NaN inputs are not part of the contract: jaxattn propagates NaN from q/k/v, but torch's CPU SDPA flash kernel
(what ``backend=None`` picks on CPU) returns zeros for a query row that holds a NaN (``backend="xla"``, MATH,
propagates it), so the two packages may differ there and no parity test feeds NaN.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["BACKENDS", "SDPA_BACKENDS", "dot_product_attention", "attention_backend", "build_mask",
           "math_attention"]

SDPA_BACKENDS: Dict[str, SDPBackend] = {
    "xla": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "chunked": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
BACKENDS: Tuple[str, ...] = tuple(SDPA_BACKENDS)
_GQA_NATIVE = {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------- checks
def _backend_names(backend, argname: str = "backend") -> Tuple[str, ...]:
    """Same rules and messages as ``jaxattn.attention._check_names``."""
    names = (backend,) if isinstance(backend, str) else backend
    try:
        names = tuple(names)
    except TypeError:
        raise TypeError(f"{argname} must be a backend name or a sequence of names from {BACKENDS}, "
                        f"got {backend!r} of type {type(backend).__name__}") from None
    if not names:
        raise ValueError(f"{argname} must name at least one backend from {BACKENDS}, got an empty list")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{argname}: backend names must be strings from {BACKENDS}, got {n!r} "
                            f"of type {type(n).__name__}")
        if n == "mosaic":
            raise ValueError(f"{argname}: 'mosaic' (Pallas Mosaic GPU) has no torch twin; "
                             f"torch backends are {BACKENDS}")
        if n not in SDPA_BACKENDS:
            raise ValueError(f"{argname}: unknown attention backend {n!r}; valid backends are {BACKENDS}")
    if len(set(names)) != len(names):
        raise ValueError(f"{argname}: backend names must not repeat, got {names}")
    return names


@contextlib.contextmanager
def attention_backend(*names):
    """Twin of ``jaxattn.attention.attention_backend``: ``sdpa_kernel`` with jaxattn backend names, in order
    of preference (``sdpa_kernel(..., set_priority=True)`` where this torch supports it)."""
    if len(names) == 1 and not isinstance(names[0], str):
        names = tuple(names[0])
    sdp = [SDPA_BACKENDS[n] for n in _backend_names(names, "attention_backend")]
    try:
        ctx = sdpa_kernel(sdp, set_priority=True)
    except TypeError:  # older torch without set_priority
        ctx = sdpa_kernel(sdp)
    with ctx:
        yield tuple(names)


def _positive(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive finite number or None, got {value!r} "
                        f"of type {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return value


def _check_ids(name, ids, b, s, sname):
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
    if tuple(ids.shape) != (b, s):
        raise ValueError(f"{name} must have shape (B, {sname}) = {(b, s)}, got {tuple(ids.shape)}")
    return ids


def _check_window(window, causal):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a (left, right) pair of non-negative ints or None, "
                         f"got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window {side} side must be a non-negative int or None, got {w!r} "
                            f"of type {type(w).__name__} (window={window!r})")
        if w < 0:
            raise ValueError(f"window {side} side must be >= 0 or None, got {w} (window={window!r})")
        out.append(int(w))
    left, right = out
    if causal:
        right = 0
    if left is None and (right is None or causal):
        return None
    return (left, right)


def _validate(q, k, v, causal, segment_ids, scale, window, softcap):
    for n, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            want = "[B, Hq, Sq, D]" if n == "q" else "[B, Hkv, Sk, D]"
            raise ValueError(f"{n} must have rank 4 {want} (the torch layout), got shape {tuple(x.shape)} "
                             f"(rank {x.dim()})")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{n} dtype must be one of {_DTYPES}, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, Hkv, Sk, D], got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    b, hq, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch size of k/v ({bk}) must equal batch size of q ({b})")
    if dk != d:
        raise ValueError(f"head_dim of k/v ({dk}) must equal head_dim of q ({d})")
    for n, val in (("batch size B", b), ("query length Sq", sq), ("key length Sk", sk),
                   ("query heads Hq", hq), ("kv heads Hkv", hkv), ("head_dim D", d)):
        if val < 1:
            raise ValueError(f"{n} must be >= 1, got {val} (q shape {tuple(q.shape)}, k shape {tuple(k.shape)})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim D={d} is too large: accepted 1 <= D <= {MAX_HEAD_DIM}")
    if hq % hkv:
        raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv} (GQA/MQA)")
    if not isinstance(causal, (bool, np.bool_)):  # np.bool_ as in jaxattn; ints are refused in both
        raise TypeError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")
    causal = bool(causal)
    if segment_ids is None:
        ids = None
    elif isinstance(segment_ids, (tuple, list)):
        if not all(isinstance(x, torch.Tensor) for x in segment_ids):
            raise TypeError(f"segment_ids must be an integer torch.Tensor [B, S] or a pair (q_ids [B, Sq], "
                            f"kv_ids [B, Sk]) of them, got a {type(segment_ids).__name__} of "
                            f"{sorted({type(x).__name__ for x in segment_ids})}")
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids as a sequence must be a pair (q_ids [B, Sq], kv_ids [B, Sk]), "
                             f"got {len(segment_ids)} elements")
        ids = (_check_ids("segment_ids[0] (q_ids)", segment_ids[0], b, sq, "Sq"),
               _check_ids("segment_ids[1] (kv_ids)", segment_ids[1], b, sk, "Sk"))
    else:
        if sq != sk:
            raise ValueError(f"segment_ids as one [B, S] array needs Sq == Sk (self-attention), got Sq={sq}, "
                             f"Sk={sk}; pass a pair (q_ids [B, Sq], kv_ids [B, Sk]) instead")
        ids = (_check_ids("segment_ids", segment_ids, b, sq, "S"),) * 2
    scale = 1.0 / math.sqrt(d) if scale is None else _positive("scale", scale)
    softcap = None if softcap is None else _positive("softcap", softcap)
    return ids, scale, _check_window(window, causal), softcap


# --------------------------------------------------------------------------------------------- mask
def build_mask(sq: int, sk: int, *, causal: bool, window=None, segment_ids=None, device=None):
    """Boolean ``[B|1, 1, Sq, Sk]`` mask, True = may attend (SDPA's convention), or None if nothing is masked.

    Same rule as ``jaxattn.attention._common.mask``: with ``i_abs = i + Sk - Sq``, key j is visible iff
    ``causal -> j <= i_abs``, ``window (l, r) -> i_abs - l <= j <= i_abs + r``, and the segment ids match.
    ``segment_ids`` is None or a ``(q_ids [B, Sq], kv_ids [B, Sk])`` pair."""
    if not causal and window is None and segment_ids is None:
        return None
    i_abs = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        m &= j <= i_abs
    if window is not None:
        left, right = window
        if left is not None:
            m &= j >= i_abs - left
        if right is not None:
            m &= j <= i_abs + right
    m = m[None, None]
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids
        m = m & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    return m


def math_attention(q, k, v, *, mask=None, scale: float, softcap: Optional[float] = None):
    """Attention written out in torch ops, scores and softmax in float32 (GQA by reshaping q, no K/V
    repeat).  Used for ``softcap`` (which SDPA cannot express); rows with no visible key give zeros."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.float().reshape(b, hkv, g, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qf, k.float()) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        m = mask[:, :, None]  # [B|1, 1, 1, Sq, Sk]
        s = s.masked_fill(~m, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.float())
    return out.reshape(b, hq, sq, d).to(q.dtype)


# --------------------------------------------------------------------------------------------- public op
def dot_product_attention(q, k, v, *, causal: bool = False, segment_ids=None, scale: Optional[float] = None,
                          window=None, softcap: Optional[float] = None, backend=None):
    """``softmax(mask(softcap(scale * q k^T))) v`` in torch layout; see the module docstring.

    q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``, ``Hq % Hkv == 0``; returns ``[B, Hq, Sq, D]``.
    ``backend``: None (SDPA decides, within any active ``sdpa_kernel``), a name from :data:`BACKENDS`
    or an ordered sequence of names."""
    ids, scale, window, softcap = _validate(q, k, v, causal, segment_ids, scale, window, softcap)
    causal = bool(causal)
    names = None if backend is None else _backend_names(backend)
    sdp = None if names is None else [SDPA_BACKENDS[n] for n in names]
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]

    if softcap is not None:
        math_ok = ("xla" in names) if names is not None else torch.backends.cuda.math_sdp_enabled()
        if not math_ok:
            raise ValueError(f"softcap={softcap} needs the 'xla' (MATH) backend: SDPA's fused kernels cannot "
                             f"apply a score cap; got backend={backend!r}"
                             + ("" if names is not None else " (MATH disabled by an active sdpa_kernel)"))
        m = build_mask(sq, sk, causal=causal, window=window, segment_ids=ids, device=q.device)
        return math_attention(q, k, v, mask=m, scale=scale, softcap=softcap)

    kwargs = dict(scale=scale)
    attn_mask = None
    dead_rows = None
    if causal and window is None and ids is None and sq <= sk:
        if sq == sk:
            kwargs["is_causal"] = True
        elif sq > 1:  # sq == 1 bottom-right sees every key: no mask at all
            attn_mask = build_mask(sq, sk, causal=True, device=q.device)
    else:
        attn_mask = build_mask(sq, sk, causal=causal, window=window, segment_ids=ids, device=q.device)
        if attn_mask is not None:  # unconditional (no data-dependent branch: torch.compile-friendly)
            dead_rows = ~attn_mask.any(dim=-1, keepdim=True)
            attn_mask = attn_mask | dead_rows  # finite softmax for rows with no key; output zeroed below
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask

    if hq != hkv:
        if sdp is None or all(s in _GQA_NATIVE for s in sdp):
            kwargs["enable_gqa"] = True
        else:  # EFFICIENT / CUDNN do not take enable_gqa: expand kv heads (a copy)
            g = hq // hkv
            k = k[:, :, None].expand(b, hkv, g, sk, d).reshape(b, hq, sk, d)
            v = v[:, :, None].expand(b, hkv, g, sk, d).reshape(b, hq, sk, d)

    ctx = contextlib.nullcontext() if sdp is None else _kernel_ctx(sdp)
    try:
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    except RuntimeError as e:
        if sdp is None or "backend" not in str(e).lower() and "kernel" not in str(e).lower():
            raise
        raise RuntimeError(f"torch SDPA backend(s) {list(names)} cannot serve this call on {q.device.type} "
                           f"(dtype {q.dtype}, q {tuple(q.shape)}, k {tuple(k.shape)}, mask "
                           f"{'yes' if attn_mask is not None else 'no'}): {str(e).splitlines()[0]}") from e
    if dead_rows is not None:
        out = out.masked_fill(dead_rows, 0.0)
    return out


def _kernel_ctx(sdp):
    try:
        return sdpa_kernel(sdp, set_priority=True)
    except TypeError:
        return sdpa_kernel(sdp)
