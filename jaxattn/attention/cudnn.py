"""``cudnn`` backend: cuDNN fused flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``
(the twin of torch's CUDNN_ATTENTION).

Nothing is hand-written here except ``supports()``, which declines, with a one-line reason, every call the
jaxattn contract allows but this path cannot serve exactly:

* a target that is not a GPU (``jaxattn.attention.current_target``: a CPU host compiling for a GPU counts
  as a GPU target); no cuDNN library (jax's wrapper asks cuDNN for its version when the call is traced, so an
  ahead-of-time compile on a machine without the library would stop with "cuDNN not found": declined here);
* float32 inputs (cuDNN flash attention takes fp16/bf16 only);
* head_dim not a multiple of 8, or above 128 (pre-Hopper, or a deviceless compile: jax's wrapper asks the
  live default backend whether it is Hopper) / 256 (Hopper and later);
* ``softcap`` (no score modification in ``jax.nn.dot_product_attention``);
* segment ids (no such argument in jax 0.10/0.11; a dense boolean mask would not be flash attention);
* causal or window with ``Sq != Sk``: the jax wrapper's causal mask is top-left aligned (``jnp.tril`` in
  its xla path; cuDNN's plain CAUSAL mask type), the contract is bottom-right;
* windows other than ``(left, 0)``: cuDNN's sliding window only looks left (the jax wrapper raises for a
  right window without causal).  A ``(left, 0)`` window is passed as ``is_causal=True,
  local_window_size=(left, 0)`` (cuDNN ``sliding_window_length = left + 1``, i.e. ``i-left <= j <= i``).
"""

from __future__ import annotations

import functools

import jax

from .args import AttnArgs
from .target import current_target

__all__ = ["supports", "attention", "cudnn_version"]


@functools.lru_cache(maxsize=1)
def cudnn_version() -> int | None:
    """cuDNN's version as jax reads it (e.g. 91000 for 9.10.0), or None when the library is not found."""
    try:
        from jax._src.lib import cuda_versions  # what jax's cuDNN attention itself asks, at trace time

        return None if cuda_versions is None else int(cuda_versions.cudnn_get_version())
    except Exception:  # RuntimeError("cuDNN not found."), an ImportError on a jax that moved it, ...
        return None


def _live_cuda_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu" and "cuda" in str(jax.devices()[0].client.platform_version)
    except Exception:  # pragma: no cover
        return False


def supports(q, k, v, args: AttnArgs):
    target = current_target(q)  # the dispatcher's target (one context-variable read)
    plat = target.platform
    if plat != "gpu":
        return f"needs an NVIDIA GPU with cuDNN (found {plat})"
    dt = str(q.dtype)
    if dt not in ("bfloat16", "float16"):
        return f"cuDNN flash attention takes bfloat16/float16 only (got {dt})"
    if cudnn_version() is None:
        return (
            "cuDNN library not found (jax's cuDNN attention reads its version when traced; install "
            "the nvidia-cudnn-cu12 wheel, e.g. with jax[cuda12])"
        )
    d = q.shape[-1]
    cc = target.compute_capability
    hopper = cc is not None and cc >= (9, 0) and _live_cuda_gpu()
    d_max = 256 if hopper else 128
    if d % 8 or d > d_max:
        return (
            f"head_dim {d} not a multiple of 8 in [8, {d_max}] (compute capability {cc}"
            f"{'' if hopper or cc is None or cc < (9, 0) else '; 256 needs a live Hopper GPU: jax asks it'})"
        )
    if args.softcap is not None:
        return "softcap is not supported by jax.nn.dot_product_attention"
    if args.has_segment_ids:
        return "segment_ids are not expressible in jax.nn.dot_product_attention (no segment-id argument)"
    sq, sk = q.shape[1], k.shape[1]
    if (args.causal or args.window is not None) and sq != sk:
        return f"causal/window with Sq={sq} != Sk={sk}: the cuDNN path is top-left aligned, the contract bottom-right"
    if args.window is not None and args.window[1] != 0:
        return f"window {args.window}: cuDNN sliding windows only look left (right side must be 0)"
    return None


def attention(q, k, v, args: AttnArgs):
    kw = dict(scale=args.scale, implementation="cudnn")
    if args.window is not None:  # (left, 0) or (None, 0), see supports()
        left, _ = args.window
        kw["is_causal"] = True
        if left is not None:
            kw["local_window_size"] = (left, 0)
    else:
        kw["is_causal"] = args.causal
    return jax.nn.dot_product_attention(q, k, v, **kw)
