"""Attention for jaxattn: one public op, several backends, a dispatcher modelled on torch's ``sdpa_kernel``.

    out = dot_product_attention(q, k, v, causal=True)              # the default order's first taker
    with attention_backend("flash", "xla"):                          # ordered preference, like sdpa_kernel
        out = dot_product_attention(q, k, v, causal=True)
    out = dot_product_attention(q, k, v, backend="chunked")          # explicit (a name or a sequence)

q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; the contract is design §4. The backends and their torch twins are
the table :data:`twincore.attention.BACKENDS`; each backend module has ``supports(q, k, v, args)`` (None or a
one-line reason) and ``attention(q, k, v, args)`` and is imported lazily (a failed import only makes it decline).
When nothing serves a call, :class:`AttentionBackendError` lists every backend tried and why it declined.

The choice is made when the call is TRACED (a jitted function keeps its first choice: enter
``attention_backend`` before its first call), per thread (a ContextVar), and for the platform the trace targets
(:func:`current_target`, worked out once per call): on a CPU host compiling for an H100, say so::

    with target_platform("gpu", compute_capability=(9, 0)):
        lowered = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import warnings
from collections.abc import Iterator, Sequence

from twincore import attention as _spec

from .args import AttnArgs, mask, normalize
from .target import Target, current_target, platform_of, target_platform

__all__ = [
    "BACKENDS",
    "FORWARD_ONLY",
    "AttentionBackendError",
    "AttnArgs",
    "attention_backend",
    "available_backends",
    "current_backends",
    "current_target",
    "default_backends",
    "dot_product_attention",
    "get_backend",
    "mask",
    "normalize",
    "target_platform",
    "Target",
]

# All read from the one backend table, twincore.attention.BACKENDS (default ranks per platform included).
BACKENDS: tuple[str, ...] = _spec.backend_names()
FORWARD_ONLY: tuple[str, ...] = tuple(n for n in BACKENDS if _spec.backend(n).forward_only)  # not offered to training
_MODULE_OF: dict[str, str] = {n: _spec.backend(n).module for n in BACKENDS}  # backend name -> module

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxattn_attention_backends", default=None)
_MODULES: dict[str, object] = {}
_IMPORT_ERRORS: dict[str, str] = {}


class AttentionBackendError(RuntimeError):
    """No backend in the active list can serve this call. ``reasons`` maps each tried backend to its reason."""

    def __init__(self, reasons: dict[str, str], call: str = ""):
        self.reasons = dict(reasons)
        lines = "\n".join(f"  {name}: {why}" for name, why in self.reasons.items())
        super().__init__(
            f"no attention backend can serve this call{(' (' + call + ')') if call else ''}; tried, in order:\n{lines}"
        )


# --------------------------------------------------------------------------------------------- names
def _check_names(names, argname: str) -> tuple[str, ...]:
    return _spec.check_backend_names(names, argname, "jax")


@contextlib.contextmanager
def attention_backend(*names: str | Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Within the block, ``dot_product_attention(backend=None)`` tries ``names`` in order; the first whose
    ``supports()`` accepts the call wins.  Accepts ``attention_backend("flash", "xla")`` or
    ``attention_backend(["flash", "xla"])``.  Nested blocks replace (not extend) the outer list, like
    ``torch.nn.attention.sdpa_kernel``.  Unknown names raise ``ValueError`` listing the valid ones."""
    if len(names) == 1 and not isinstance(names[0], str):
        names = tuple(names[0])
    checked = _check_names(names, "attention_backend")
    token = _ACTIVE.set(checked)
    try:
        yield checked
    finally:
        _ACTIVE.reset(token)


def current_backends() -> tuple[str, ...] | None:
    """The list set by the innermost active ``attention_backend(...)`` block, or None outside any block."""
    return _ACTIVE.get()


def default_backends(q=None, k=None) -> tuple[str, ...]:
    """Preference used when neither ``backend=`` nor ``attention_backend`` says anything, for the platform the
    trace targets (:func:`current_target`) and, given ``q`` (and ``k``), its queries (and keys) per row, from the
    backend table's ranks: on a GPU ``cudnn, mosaic, flash, chunked, xla`` (``mosaic`` serves Hopper only); on a TPU
    ``splash, chunked, xla``; on a CPU ``chunked, xla``, but ``xla`` alone for one query per row (a decode step) or
    under 128 keys per row (benchmarks/NOTES.md, "JAX's CPU default" and "A key-length floor"). Interpreted Pallas
    kernels are for tests."""
    q_len = None if q is None else q.shape[1]
    return _default_for(platform_of(q), q_len, None if k is None else k.shape[1])


def _default_for(platform: str, q_len: int | None = None, kv_len: int | None = None) -> tuple[str, ...]:
    return _spec.default_order(platform if platform in _spec.PLATFORMS else "cpu", q_len, kv_len)


# --------------------------------------------------------------------------------------------- loading
def get_backend(name: str):
    """Import and return the backend module ``jaxattn.attention.<name>`` (for ``flash_decode``: ``decode``);
    raises ``ImportError`` with the original error when it cannot be imported (the dispatcher turns that into a
    decline reason)."""
    (name,) = _check_names((name,), "get_backend")
    if name in _MODULES:
        return _MODULES[name]
    if name in _IMPORT_ERRORS:
        raise ImportError(_IMPORT_ERRORS[name])
    try:
        mod = importlib.import_module(f"{__name__}.{_MODULE_OF[name]}")
        for attr in ("supports", "attention"):
            if not callable(getattr(mod, attr, None)):
                raise ImportError(f"module {mod.__name__} has no callable {attr}()")
    except Exception as e:  # any failure: ImportError, AttributeError in a moved jax API, ...
        first = str(e).splitlines()[0] if str(e) else ""
        msg = f"import of {__name__}.{_MODULE_OF[name]} failed: {type(e).__name__}: {first}"
        _IMPORT_ERRORS[name] = msg
        raise ImportError(msg) from e
    _MODULES[name] = mod
    return mod


def _decline_reason(name: str, q, k, v, args: AttnArgs) -> tuple[str | None, object]:
    try:
        mod = get_backend(name)
    except ImportError as e:
        return str(e), None
    try:
        reason = mod.supports(q, k, v, args)
    except Exception as e:  # a buggy supports() must not take the dispatcher down, but must be visible
        reason = f"supports() raised {type(e).__name__}: {e}"
        warnings.warn(f"attention backend {name!r}: {reason}", RuntimeWarning, stacklevel=3)
    if reason is not None and not isinstance(reason, str):
        reason = str(reason)
    return reason, mod


def _resolve(backend, target: Target, q_len: int, kv_len: int) -> tuple[str, ...]:
    if backend is not None:
        return _check_names(backend, "backend")
    active = _ACTIVE.get()
    return active if active is not None else _default_for(target.platform, q_len, kv_len)


def _describe(q, k, args: AttnArgs, target: Target) -> str:
    return (
        f"q {tuple(q.shape)} {q.dtype}, k/v {tuple(k.shape)}, causal={args.causal}, "
        f"window={args.window}, softcap={args.softcap}, segment_ids={'yes' if args.has_segment_ids else 'no'}"
        f", platform={target.platform}"
    )


def _entered(target: Target):
    """``target_platform`` of ``target``: what every supports() and kernel inside reads."""
    return target_platform(
        target.platform, compute_capability=target.compute_capability, device_kind=target.device_kind
    )


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
    """Scaled dot-product attention, ``softmax(mask(softcap(scale * q k^T))) v``.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0``; returns ``[B, Sq, Hq, D]`` in
    q's dtype.  ``causal`` is bottom-right aligned; ``window=(left, right)``; ``softcap=c`` applies
    ``c*tanh(s/c)``; ``segment_ids`` is ``[B, S]`` or ``(q_ids, kv_ids)``.  ``backend`` is None (the
    active ``attention_backend`` list, else :func:`default_backends`), a name, or an ordered sequence.
    """
    args = normalize(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, window=window, softcap=softcap)
    target = current_target(q)  # once per call: the backends below read it from the context
    with _entered(target):
        names = _resolve(backend, target, q.shape[1], k.shape[1])
        reasons: dict[str, str] = {}
        for name in names:
            reason, mod = _decline_reason(name, q, k, v, args)
            if reason is None:
                return mod.attention(q, k, v, args)
            reasons[name] = reason
        raise AttentionBackendError(reasons, _describe(q, k, args, target))


def available_backends(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    scale=None,
    window=None,
    softcap=None,
    backends: Sequence[str] | None = None,
) -> dict[str, str | None]:
    """``{name: None if it can serve this call else the reason}`` for every backend (or ``backends``)."""
    args = normalize(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, window=window, softcap=softcap)
    names = BACKENDS if backends is None else _check_names(backends, "backends")
    with _entered(current_target(q)):
        return {name: _decline_reason(name, q, k, v, args)[0] for name in names}
