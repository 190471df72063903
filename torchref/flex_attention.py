"""FlexAttention for torchref: the attention contract as one compiled torch kernel (backend ``flex``).

    out = torchref.attention.dot_product_attention(q, k, v, causal=True, window=(128, 0), backend="flex")

``torch.nn.attention.flex_attention`` compiles a mask function and a score function into one fused kernel that skips
the key blocks its block mask marks empty (Dong et al., "Flex Attention", 2024). Here the mask is the contract's
(bottom-right causal, window, segment ids: ``twincore.attention.visible_bounds``), the score function the softcap,
GQA by ``enable_gqa``; a row that sees no key gives zeros. ``torchref.attention`` serves it as ``backend="flex"`` /
``attention_backend("flex")``; its JAX counterparts are the kernels that take the same masks natively (``flash``,
``mosaic``, ``splash``, ``chunked``). The kernel is torch's: only the two functions and the block-mask cache are
written here, for a call ``torchref.attention`` has checked. On a CPU, torch (2.13) has no FlexAttention backward: a
call that needs gradients there is refused. ``COMPILED = False`` runs torch's unfused reference instead (tests).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from twincore import attention as _spec

__all__ = ["flex_dot_product_attention", "block_mask", "COMPILED"]

COMPILED = True  # False: torch's unfused reference implementation (all S² scores; seconds cheaper than a compile)


@functools.cache
def _compiled():
    """``flex_attention`` under ``torch.compile`` (uncompiled it runs torch's unfused reference: all S² scores)."""
    return torch.compile(flex_attention)


def _mask_mod(sq: int, sk: int, causal: bool, window, ids):
    left, right = _spec.visible_bounds(causal, window)
    offset = sk - sq  # bottom-right alignment: query i sits at key position i + Sk - Sq

    def mask_mod(b, h, qi, kj):
        i_abs = qi + offset
        keep = kj >= 0
        if left is not None:
            keep = keep & (kj >= i_abs - left)
        if right is not None:
            keep = keep & (kj <= i_abs + right)
        if ids is not None:
            keep = keep & (ids[0][b, qi] == ids[1][b, kj])
        return keep

    return mask_mod


@functools.lru_cache(maxsize=64)
def _static_block_mask(sq: int, sk: int, causal: bool, window, device: str):
    return create_block_mask(_mask_mod(sq, sk, causal, window, None), None, None, sq, sk, device=device)


_LAST_SEGMENTS = None  # (q_ids, kv_ids, key, mask) of the last call with segment ids, replaced in one assignment


def block_mask(sq: int, sk: int, *, causal: bool, window=None, segment_ids=None, device=None):
    """The ``BlockMask`` of the contract's mask for ``Sq`` queries over ``Sk`` keys (None when nothing is masked).

    Without segment ids it is cached by shape; with them, the last call's mask is reused while the same two id
    tensors, unmodified, come back (every layer of one model call)."""
    global _LAST_SEGMENTS
    if not causal and window is None and segment_ids is None:
        return None
    device = str(torch.device(device) if device is not None else torch.device("cpu"))
    if segment_ids is None:
        return _static_block_mask(sq, sk, causal, window, device)
    q_ids, kv_ids = segment_ids
    key = (sq, sk, causal, window, device, q_ids._version, kv_ids._version)
    last = _LAST_SEGMENTS  # read once: another thread may replace it meanwhile
    if last is not None and last[0] is q_ids and last[1] is kv_ids and last[2] == key:
        return last[3]
    mask = create_block_mask(
        _mask_mod(sq, sk, causal, window, segment_ids), q_ids.shape[0], None, sq, sk, device=device
    )
    _LAST_SEGMENTS = (q_ids, kv_ids, key, mask)
    return mask


def flex_dot_product_attention(q, k, v, *, causal: bool, segment_ids, scale: float, window, softcap):
    """``softmax(mask(softcap(scale * q k^T))) v`` by FlexAttention, for a call already checked by
    ``torchref.attention`` (``segment_ids``: None or a ``(q_ids, kv_ids)`` pair; ``scale`` a float).

    q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``; returns ``[B, Hq, Sq, D]``."""
    mask = block_mask(q.shape[2], k.shape[2], causal=causal, window=window, segment_ids=segment_ids, device=q.device)
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, qi, kj):
            return softcap * torch.tanh(score / softcap)

    # inside a compiled region dynamo traces flex_attention itself; outside, the compiled wrapper
    fn = _compiled() if COMPILED and not torch.compiler.is_compiling() else flex_attention
    try:
        return fn(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    except NotImplementedError as e:
        if "backward" not in str(e):
            raise
        raise ValueError(
            f"backend 'flex': torch {torch.__version__} has no FlexAttention backward on {q.device.type} "
            f"(q, k or v requires grad); run it under torch.no_grad() there, or train with backend 'xla' or "
            f"'chunked' ({str(e).splitlines()[0]})"
        ) from None
