"""Remat (activation checkpointing) policy names, shared by both twins (``Llama.remat`` / ``LlamaForCausalLM.remat``).

    from jaxattn.spec.remat import check_remat
    check_remat("save_dots")    # -> "save_dots"; check_remat("dots") raises ValueError listing the names

``none``: keep every activation; ``full``: recompute each decoder layer in the backward pass, keeping only its
input; ``save_dots``: keep the outputs of the weight matmuls (no batch dims), recompute the rest;
``save_qkv_attn``: keep the q/k/v projections and the attention output, recompute the rest.
"""
from __future__ import annotations

REMAT_POLICIES: tuple[str, ...] = ("none", "full", "save_dots", "save_qkv_attn")


def check_remat(name: object, arg: str = "remat") -> str:
    """``name`` if it is one of :data:`REMAT_POLICIES`, else a ValueError naming ``arg`` and the valid names."""
    if not isinstance(name, str) or name not in REMAT_POLICIES:
        raise ValueError(f"{arg}={name!r} is not a remat policy; valid names: {', '.join(REMAT_POLICIES)}")
    return name
