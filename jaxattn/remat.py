"""Remat (activation checkpointing) for the Flax NNX Llama, applied from outside the model (torchtitan's ``apply_ac``).

    model = jaxattn.remat.apply(model, "save_qkv_attn")   # sets the hashable ``Llama.remat``; returns the model

The model only stores the policy NAME (static, in the graphdef, so it is part of the jit cache key) and calls
:func:`wrap_layer` on its scanned layer body; the name -> ``jax.checkpoint`` policy table lives here. The
policies keep the model's ``checkpoint_name`` tags (``jaxattn.model.REMAT_NAMES``); names and meanings are
``twincore.remat``'s, shared with ``torchref.remat``. ``offload`` moves the :data:`OFFLOAD_NAMES` tags to
the ``pinned_host`` memory space (``save_and_offload_only_these_names``) and recomputes the rest; it needs a
backend with that memory space (CPU, GPU and TPU backends have one): :func:`offload_unavailable_reason`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from twincore.remat import OFFLOAD_NAMES, QKV_ATTN_NAMES, REMAT_POLICIES, check_remat

__all__ = [
    "POLICIES",
    "OFFLOAD_NAMES",
    "QKV_ATTN_NAMES",
    "apply",
    "checkpoint_policy",
    "wrap_layer",
    "offload_unavailable_reason",
]

POLICIES = REMAT_POLICIES
_cp = jax.checkpoint_policies

# name -> jax.checkpoint policy (None: no jax.checkpoint at all; "full" saves nothing but the layer input).
_TABLE: dict[str, Callable | None] = {
    "none": None,
    "full": _cp.nothing_saveable,
    "save_dots": _cp.dots_with_no_batch_dims_saveable,  # weight matmuls; attention's batched dots are recomputed
    "save_qkv_attn": _cp.save_only_these_names(*QKV_ATTN_NAMES),
    "offload": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(OFFLOAD_NAMES),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}
assert tuple(_TABLE) == REMAT_POLICIES


def offload_unavailable_reason(device: Any = None) -> str | None:
    """None when ``device`` (default ``jax.devices()[0]``) has a ``pinned_host`` memory space to offload to,
    else why ``offload`` cannot be served there."""
    device = jax.devices()[0] if device is None else device
    try:
        kinds = sorted({m.kind for m in device.addressable_memories()})
    except Exception as e:  # a backend without memory spaces
        return f"{device} reports no memory spaces ({type(e).__name__}: {e})"
    if "pinned_host" not in kinds:
        return f"{device} has memory spaces {kinds}, no 'pinned_host' to offload activations to"
    return None


def _check_servable(policy: str, device: Any = None, arg: str = "policy") -> None:
    if policy == "offload":
        reason = offload_unavailable_reason(device)
        if reason is not None:
            others = ", ".join(p for p in POLICIES if p != "offload")
            raise ValueError(f"{arg}='offload' cannot be served on this backend: {reason}; use one of {others}")


def checkpoint_policy(name: str) -> Callable | None:
    """The ``jax.checkpoint`` policy of a remat name (None for ``none``); ValueError for an unknown name."""
    return _TABLE[check_remat(name)]


def wrap_layer(layer: Callable, name: str, arg: str = "remat") -> Callable:
    """``layer`` under ``jax.checkpoint`` with the policy ``name`` (``layer`` itself for ``none``)."""
    _check_servable(check_remat(name, arg), arg=arg)
    policy = _TABLE[name]
    if policy is None:
        return layer
    return jax.checkpoint(layer, policy=policy, prevent_cse=False)  # under scan CSE cannot merge the recompute


def apply(model, policy: str, *, device: Any = None):
    """Set ``model.remat = policy`` (a ``jaxattn.model.Llama``, or any module with a ``remat`` attribute) and
    return ``model``. ValueError for an unknown name (listing :data:`POLICIES`) or for ``offload`` where
    ``device`` (default ``jax.devices()[0]``) has no host memory space to offload to."""
    check_remat(policy, "policy")
    if not hasattr(model, "remat"):
        raise TypeError(f"model must have a 'remat' setting (a jaxattn.model.Llama), got {type(model).__name__}")
    _check_servable(policy, device)
    model.remat = policy
    return model
