"""Attention for torchref: ``torch.nn.functional.scaled_dot_product_attention`` under the jaxattn contract.

    out = dot_product_attention(q, k, v, causal=True, window=(128, 0), backend="xla")   # q [B, Hq, Sq, D]

Same keywords and checks as ``jaxattn.attention.dot_product_attention`` (design §4, :func:`check_call` of
``twincore.attention``), in torch's layout. ``backend`` names map onto ``SDPBackend`` by the backend table's
torch-twin column and run under ``sdpa_kernel``; None leaves the choice to SDPA; ``flex`` is torch's FlexAttention
(``torchref.flex_attention``: the mask and softcap in the kernel). Hand-written, and why: the mask
(SDPA has no bottom-right window or segment ids; the parity tests pin it to JAX's), zeros for a row that sees no
key (SDPA could give NaN, and NaN in its backward), a plain-math path for ``softcap`` (SDPA cannot express it;
only ``xla``/MATH serves it), and kv heads expanded for EFFICIENT/CUDNN (``enable_gqa`` is FLASH/MATH only).
NaN inputs are outside the contract: torch's CPU flash kernel zeroes a row holding a NaN.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from twincore import attention as _spec

__all__ = [
    "BACKENDS",
    "SDPA_BACKENDS",
    "dot_product_attention",
    "masked_attention",
    "attention_backend",
    "build_mask",
    "math_attention",
]

# The backend table's torch-twin column: backend name -> SDPBackend (backends without a twin are absent, and `flex`,
# torch's FlexAttention, is served by torchref.flex_attention instead of SDPA).
SDPA_BACKENDS: dict[str, SDPBackend] = {
    b.name: getattr(SDPBackend, b.torch_twin) for b in _spec.BACKENDS if b.torch_twin not in (None, _spec.FLEX)
}
FLEX = next(b.name for b in _spec.BACKENDS if b.torch_twin == _spec.FLEX)
BACKENDS: tuple[str, ...] = _spec.torch_backend_names()
# the innermost attention_backend's names: process-wide, as sdpa_kernel's flags are, and a plain global so that dynamo
# traces a call through it (a ContextVar read is a graph break in every layer of a compiled model)
_ACTIVE: tuple[str, ...] | None = None
_GQA_NATIVE = {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION}
MAX_HEAD_DIM = _spec.MAX_HEAD_DIM


# --------------------------------------------------------------------------------------------- checks
def _backend_names(backend, argname: str = "backend") -> tuple[str, ...]:
    """The backend-name check of the shared table (a name without a torch twin is refused as such)."""
    return _spec.check_backend_names(backend, argname, "torch")


@contextlib.contextmanager
def attention_backend(*names):
    """Twin of ``jaxattn.attention.attention_backend``: within the block ``dot_product_attention(backend=None)``
    tries ``names`` in order, and raw SDPA calls run under ``sdpa_kernel`` with the SDPA ones
    (``set_priority=True`` where this torch supports it); ``flex`` is torch's FlexAttention."""
    if len(names) == 1 and not isinstance(names[0], str):
        names = tuple(names[0])
    names = _backend_names(names, "attention_backend")  # an AttentionChoice: checked when it was made
    global _ACTIVE
    sdp = [SDPA_BACKENDS[n] for n in names if n != FLEX]
    before, _ACTIVE = _ACTIVE, names
    try:
        with _kernel_ctx(sdp) if sdp else contextlib.nullcontext():
            yield names
    finally:
        _ACTIVE = before


def _describe(x):
    """``(shape, dtype name)`` of a torch.Tensor (``torch.float32`` -> "float32"), None for anything else."""
    if not isinstance(x, torch.Tensor):
        return None
    return tuple(x.shape), str(x.dtype).rpartition(".")[2]


def _validate(q, k, v, causal, segment_ids, scale, window, softcap):
    c = _spec.check_call(
        q,
        k,
        v,
        causal=causal,
        segment_ids=segment_ids,
        scale=scale,
        window=window,
        softcap=softcap,
        layout="bhsd",
        describe=_describe,
    )
    ids = None if c.segments == "none" else (c.q_ids, c.kv_ids)
    return c.causal, ids, c.scale, c.window, c.softcap


# --------------------------------------------------------------------------------------------- mask
def build_mask(sq: int, sk: int, *, causal: bool, window=None, segment_ids=None, device=None):
    """Boolean ``[B|1, 1, Sq, Sk]`` mask, True = may attend (SDPA's convention), or None if nothing is masked.

    Same rule as ``jaxattn.attention.mask``: with ``i_abs = i + Sk - Sq``, key j is visible iff
    ``i_abs - left <= j <= i_abs + right`` (``twincore.attention.visible_bounds``: the window's sides,
    the right one cut to 0 by ``causal``) and the segment ids match.
    ``segment_ids`` is None or a ``(q_ids [B, Sq], kv_ids [B, Sk])`` pair."""
    if not causal and window is None and segment_ids is None:
        return None
    i_abs = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    left, right = _spec.visible_bounds(causal, window)
    if left is not None:
        m &= j >= i_abs - left
    if right is not None:
        m &= j <= i_abs + right
    m = m[None, None]
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids
        m = m & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    return m


def math_attention(q, k, v, *, mask=None, scale: float, softcap: float | None = None):
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
def dot_product_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    scale: float | None = None,
    window=None,
    softcap: float | None = None,
    backend=None,
):
    """``softmax(mask(softcap(scale * q k^T))) v`` in torch layout; see the module docstring.

    q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``, ``Hq % Hkv == 0``; returns ``[B, Hq, Sq, D]``.
    ``backend``: None (the active ``attention_backend``'s names, else SDPA decides within any active
    ``sdpa_kernel``), a name from :data:`BACKENDS` or an ordered sequence of names, tried in order."""
    causal, ids, scale, window, softcap = _validate(q, k, v, causal, segment_ids, scale, window, softcap)
    names = _ACTIVE if backend is None else _backend_names(backend)
    call = dict(causal=causal, segment_ids=ids, scale=scale, window=window, softcap=softcap)
    if names is None or FLEX not in names:
        return _sdpa_attention(q, k, v, call, names, backend)
    groups = _groups(names)  # flex alone, and each run of SDPA names between
    failed = {}
    for group in groups:
        try:
            if group == (FLEX,):
                from .flex_attention import flex_dot_product_attention

                return flex_dot_product_attention(q, k, v, **call)
            return _sdpa_attention(q, k, v, call, group, backend)
        except (RuntimeError, ValueError) as e:
            if len(groups) == 1:
                raise
            failed[",".join(group)] = str(e).splitlines()[0]
    raise RuntimeError(
        f"no torch attention backend in {list(names)} can serve this call on {q.device.type}; tried, in order: "
        + "; ".join(f"{g}: {why}" for g, why in failed.items())
    )


def _groups(names) -> list[tuple[str, ...]]:
    """``names`` cut into ``(flex,)`` and the runs of SDPA names around it, in order."""
    out: list[tuple[str, ...]] = []
    for n in names:
        if n == FLEX or not out or out[-1] == (FLEX,):
            out.append((n,))
        else:
            out[-1] += (n,)
    return out


def _sdpa_attention(q, k, v, call: dict, names, backend):
    """The call by SDPA (``names``: SDPA backend names, or None) or, for ``softcap``, by :func:`math_attention`."""
    causal, ids, scale, window, softcap = (call[n] for n in ("causal", "segment_ids", "scale", "window", "softcap"))
    sq, sk = q.shape[2], k.shape[2]

    if softcap is not None:
        math_ok = ("xla" in names) if names is not None else torch.backends.cuda.math_sdp_enabled()
        if not math_ok:
            raise ValueError(
                f"softcap={softcap} needs the 'xla' (MATH) or 'flex' backend: SDPA's fused kernels cannot "
                f"apply a score cap; got backend={backend!r}"
                + (" (MATH disabled by an active sdpa_kernel)" if names is None else "")
                + (f" under attention_backend{tuple(names)}" if names is not None and backend is None else "")
            )
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
    out = _sdpa(q, k, v, kwargs, names)
    if dead_rows is not None:
        out = out.masked_fill(dead_rows, 0.0)
    return out


def masked_attention(q, k, v, mask):
    """``dot_product_attention(q, k, v, segment_ids=ids)`` for a mask already built from ``ids`` (``build_mask``'s
    boolean ``[B|1, 1, Sq, Sk]``, True = may attend) in which every row sees a key: the KV cache's decode step,
    which builds its mask once per step instead of once per layer. Default scale, SDPA's own backend choice."""
    return _sdpa(q, k, v, {"scale": _spec.default_scale(q.shape[-1]), "attn_mask": mask}, None)


def _sdpa(q, k, v, kwargs: dict, names):
    """``F.scaled_dot_product_attention`` under ``names`` (None: SDPA's choice), GQA by ``enable_gqa`` or, for
    EFFICIENT / CUDNN, kv heads expanded (a copy); a backend that cannot serve the call is named in the error."""
    sdp = None if names is None else [SDPA_BACKENDS[n] for n in names]
    b, hq, _, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq != hkv:
        if sdp is None or all(s in _GQA_NATIVE for s in sdp):
            kwargs = {**kwargs, "enable_gqa": True}
        else:  # EFFICIENT / CUDNN do not take enable_gqa: expand kv heads (a copy)
            g = hq // hkv
            k = k[:, :, None].expand(b, hkv, g, sk, d).reshape(b, hq, sk, d)
            v = v[:, :, None].expand(b, hkv, g, sk, d).reshape(b, hq, sk, d)

    ctx = contextlib.nullcontext() if sdp is None else _kernel_ctx(sdp)
    try:
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    except RuntimeError as e:
        if sdp is None or "backend" not in str(e).lower() and "kernel" not in str(e).lower():
            raise
        raise RuntimeError(
            f"torch SDPA backend(s) {list(names)} cannot serve this call on {q.device.type} "
            f"(dtype {q.dtype}, q {tuple(q.shape)}, k {tuple(k.shape)}, mask "
            f"{'yes' if kwargs.get('attn_mask') is not None else 'no'}): {str(e).splitlines()[0]}"
        ) from e


def _kernel_ctx(sdp):
    try:
        return sdpa_kernel(sdp, set_priority=True)
    except TypeError:  # older torch without set_priority
        return sdpa_kernel(sdp)
