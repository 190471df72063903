"""Activation checkpointing for the PyTorch Llama, applied from outside the model (torchtitan's ``apply_ac``).

    model = torchref.remat.apply(model, "save_qkv_attn")   # sets ``LlamaForCausalLM.remat``; returns the model

The model stores the policy NAME and runs each decoder layer through :func:`run_layer`; the name -> torch
mechanism table lives here (names and meanings: ``twincore.remat``, shared with ``jaxattn.remat``):
``full`` = ``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)``; ``save_dots`` and
``save_qkv_attn`` = the same with selective checkpointing (``create_selective_checkpoint_contexts``), whose
policies see aten ops, not names — :class:`SaveDots`, :class:`SaveQkvAttn` say which ops stand for which JAX tag;
``offload`` = ``torch.autograd.graph.save_on_cpu`` around the layer (every saved tensor goes to host memory,
pinned where CUDA is available; nothing is recomputed). Checkpointing acts only while autograd records
(``torch.is_grad_enabled()``); the state_dict keys are unchanged (no wrapper modules).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from twincore.remat import REMAT_POLICIES, check_remat

__all__ = ["POLICIES", "apply", "run_layer", "SaveDots", "SaveQkvAttn", "SDPA_OPS"]

POLICIES = REMAT_POLICIES
_aten = torch.ops.aten

# The fused SDPA kernels: one op whose first output is the attention output (JAX's "attn_output" tag). SDPA's
# MATH backend is a composite of bmm/softmax ops, none of which is the attention output as one op.
SDPA_OPS = tuple(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
)


class SaveDots:
    """``save_dots``: keep the weight matmuls' outputs (``aten.mm`` / ``aten.addmm``: every ``nn.Linear`` on a
    ``[B, S, in]`` input), recompute the rest. ``bmm`` is NOT kept: it is the attention scores' batched matmul
    (SDPA's MATH backend), which JAX's ``dots_with_no_batch_dims_saveable`` does not keep either."""

    ops = (_aten.mm.default, _aten.addmm.default)

    def __call__(self, ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in self.ops else CheckpointPolicy.PREFER_RECOMPUTE


class SaveQkvAttn:
    """``save_qkv_attn``: keep the q/k/v projections and the attention output, recompute the rest.

    Ops carry no module names, so the q/k/v projections are found by position: ``LlamaAttention.forward``
    runs ``q_proj``, ``k_proj``, ``v_proj`` as the layer's first three ``mm`` (the input norm before them has
    none), so the first three ``mm``/``addmm`` of each checkpointed layer call are kept; the attention output
    is the output of a fused SDPA op (:data:`SDPA_OPS`). One instance per layer call (``context_fn`` makes a
    fresh one), counting the forward and the recompute separately so both see the same decisions."""

    def __init__(self):
        self.seen = {False: 0, True: 0}  # mm count so far, per is_recompute

    def __call__(self, ctx, op, *args, **kwargs):
        if op in SDPA_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in SaveDots.ops:
            self.seen[ctx.is_recompute] += 1
            if self.seen[ctx.is_recompute] <= 3:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _plain(layer, *args):
    return layer(*args)


def _full(layer, *args):
    return checkpoint(layer, *args, use_reentrant=False)


def _selective(policy_cls):
    def run(layer, *args):  # a fresh policy per layer call (SaveQkvAttn counts the layer's matmuls)
        return checkpoint(
            layer, *args, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy_cls())
        )

    return run


def _offload(layer, *args):
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return layer(*args)


# name -> how a decoder layer runs under it (the twin of jaxattn.remat's name -> jax.checkpoint policy table)
_RUNNERS = {
    "none": _plain,
    "full": _full,
    "save_dots": _selective(SaveDots),
    "save_qkv_attn": _selective(SaveQkvAttn),
    "offload": _offload,
}
assert tuple(_RUNNERS) == REMAT_POLICIES


def run_layer(layer: torch.nn.Module, policy: str, *args, arg: str = "remat"):
    """``layer(*args)`` under the remat ``policy`` (a plain call when autograd is not recording)."""
    policy = check_remat(policy, arg)
    return _RUNNERS[policy](layer, *args) if torch.is_grad_enabled() else layer(*args)


def apply(model: torch.nn.Module, policy: str) -> torch.nn.Module:
    """Set ``model.remat = policy`` (a ``torchref.model.LlamaForCausalLM``) and return ``model``; ValueError for
    an unknown name, listing :data:`POLICIES`."""
    check_remat(policy, "policy")
    if not hasattr(model, "remat"):
        raise TypeError(
            f"model must have a 'remat' setting (a torchref.model.LlamaForCausalLM), got {type(model).__name__}"
        )
    model.remat = policy
    return model
