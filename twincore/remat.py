"""Remat (activation checkpointing) policy names, shared by both twins (``jaxattn.remat`` / ``torchref.remat``).

    from twincore.remat import check_remat
    check_remat("save_dots")    # -> "save_dots"; check_remat("dots") raises ValueError listing the names

Each policy applies per decoder layer; what the backward pass finds saved for each layer:

``none``: every activation. ``full``: only the layer's input; the layer is recomputed. ``save_dots``: the outputs
of the weight matmuls (q/k/v, attention-out projection, gate/up/down; not attention's batched matmuls); the
norms, RoPE, attention and SwiGLU are recomputed. ``save_qkv_attn``: the q/k/v projections and the attention
output (torchtitan's selective AC); the rest is recomputed. ``offload``: activations kept in host memory instead
of device memory (JAX: the :data:`OFFLOAD_NAMES` tags, the rest recomputed; torch: every saved tensor of the layer
via ``save_on_cpu``, nothing recomputed).
"""

from __future__ import annotations

REMAT_POLICIES: tuple[str, ...] = ("none", "full", "save_dots", "save_qkv_attn", "offload")

# checkpoint_name tags (twincore.tensors.REMAT_TAGS) kept by save_qkv_attn, and moved to host memory by offload.
QKV_ATTN_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "attn_output")
OFFLOAD_NAMES: tuple[str, ...] = QKV_ATTN_NAMES + ("gate_proj", "up_proj", "mlp_hidden")


def check_remat(name: object, arg: str = "remat") -> str:
    """``name`` if it is one of :data:`REMAT_POLICIES`, else a ValueError naming ``arg`` and the valid names."""
    if not isinstance(name, str) or name not in REMAT_POLICIES:
        raise ValueError(f"{arg}={name!r} is not a remat policy; valid names: {', '.join(REMAT_POLICIES)}")
    return name
