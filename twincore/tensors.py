"""One vocabulary for the per-layer activations both twins name: the ``checkpoint_name`` tags of ``jaxattn.model``
(what the remat policies keep or offload), the porting debugger's rows and the torch modules it hooks. A tensor
has Hugging Face's module name where it is a module's output (``q_proj``, ``o_proj``, ``gate_proj``), HF's
variable name where it is one (``attn_output``: ``o_proj``'s input).

    from twincore.tensors import LAYER_TENSORS, REMAT_TAGS
    REMAT_TAGS  # ("q_proj", "k_proj", "v_proj", "attn_output", "o_proj", ...)
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["LayerTensor", "LAYER_TENSORS", "REMAT_TAGS", "TORCH_HOOKS"]


class LayerTensor(NamedTuple):
    """One per-layer activation: ``name``; ``hf_module``, the submodule of ``model.layers.{i}`` it is taken at
    (``""``: the decoder layer itself; None: inside the attention, no module has it); ``side``, ``"out"`` for that
    module's output or ``"in"`` for its input; ``remat``, a ``checkpoint_name`` tag of ``jaxattn.model``."""

    name: str
    hf_module: str | None
    side: str
    remat: bool = True


# In forward order.
LAYER_TENSORS: tuple[LayerTensor, ...] = (
    LayerTensor("q_proj", "self_attn.q_proj", "out"),
    LayerTensor("k_proj", "self_attn.k_proj", "out"),
    LayerTensor("v_proj", "self_attn.v_proj", "out"),
    LayerTensor("q_rope", None, "out", remat=False),  # q and k after RoPE: the debugger's own capture
    LayerTensor("k_rope", None, "out", remat=False),
    LayerTensor("attn_output", "self_attn.o_proj", "in"),  # attention's output, before the projection
    LayerTensor("o_proj", "self_attn.o_proj", "out"),
    LayerTensor("attention_residual", "post_attention_layernorm", "in"),  # x + attention: the MLP norm's input
    LayerTensor("gate_proj", "mlp.gate_proj", "out"),
    LayerTensor("up_proj", "mlp.up_proj", "out"),
    LayerTensor("mlp_hidden", "mlp.down_proj", "in"),  # silu(gate) * up
    LayerTensor("decoder_layer_output", "", "out"),
)

REMAT_TAGS: tuple[str, ...] = tuple(t.name for t in LAYER_TENSORS if t.remat)
# torch side, per decoder layer: (name, submodule of ``model.layers.{i}``, "out" | "in")
TORCH_HOOKS: tuple[tuple[str, str, str], ...] = tuple(
    (t.name, t.hf_module, t.side) for t in LAYER_TENSORS if t.hf_module is not None
)
