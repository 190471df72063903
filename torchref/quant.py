"""int8 weight-only quantization for ``torchref.model.LlamaForCausalLM``, applied from outside (twin of
``jaxattn/quant.py``).

    qmodel = torchref.quant.quantize(model)       # a copy whose nn.Linear layers are Int8Linear

Rule (identical to the JAX twin, so the int8 weights are bit-identical): per OUTPUT channel, symmetric,
``scale = max|w| / 127`` over the input dim (1.0 for an all-zero row), ``q = clamp(round(w / scale), -127, 127)``
(round-half-to-even), in float32. :class:`Int8Linear` keeps ``weight_int8 [out, in]`` int8 and ``scale [out]``
float32 buffers and computes ``F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None])``: the weight is
dequantized in ``x``'s dtype first, then multiplied, as ``jaxattn.quant.matmul``. Why this order: ``x @ q`` sums
``|q|`` up to 127 over the input dim, so in float16 it overflows (> 65504 -> inf, then NaN logits) wherever
``x @ w`` is merely in the tens; the dequantized weight is ``w`` to within half a quantization step, so it is finite
wherever the float model is (the JAX twin's docstring has the rest). Quantized: the parameter table's linear weights
(``twincore.params``: the seven projections of every decoder layer and an untied ``lm_head``); the embedding (and
so a tied head) and the norms stay in float, as torchao's ``int8_weight_only`` (which replaces ``nn.Linear`` only).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from twincore import params

from .model import LlamaForCausalLM
from .moe import Experts


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [..., out, in], scale float32 [..., out])`` of a float ``[..., out, in]`` weight (stacked experts
    carry a leading ``experts`` axis)."""
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight: w must be a float tensor [..., out, in], got {w.dtype}{list(w.shape)}")
    w = w.detach().float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return q, scale[..., 0].contiguous()


class Int8Linear(nn.Module):
    """``nn.Linear`` with an int8 weight and per-output-channel float32 scales; a bias (Qwen2's q / k / v) stays
    float, as the JAX twin adds it after its int8 matmul."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None], bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8Experts(Experts):
    """``torchref.moe.Experts`` with int8 stacked weights ``[E, out, in]`` and per-(expert, output channel) float32
    scales, dequantized in the input's dtype for each grouped product."""

    def __init__(self, experts: Experts):
        nn.Module.__init__(self)
        for name in _EXPERT_WEIGHTS:
            q, scale = quantize_weight(getattr(experts, name))
            self.register_buffer(f"{name}_int8", q)
            self.register_buffer(f"{name}_scale", scale)

    def weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        return [
            getattr(self, f"{n}_int8").to(dtype) * getattr(self, f"{n}_scale").to(dtype)[..., None]
            for n in _EXPERT_WEIGHTS
        ]

    def extra_repr(self) -> str:
        return f"experts={self.gate_proj_int8.shape[0]}, int8 per-channel"


_EXPERT_WEIGHTS = params.expert_weights()  # gate_proj, up_proj, down_proj
QUANTIZED = (Int8Linear, Int8Experts)


def quantize(model):
    """A copy of ``model`` (a ``torchref.model.LlamaForCausalLM``) with :class:`Int8Linear` projections (and
    :class:`Int8Experts` for an MoE's experts; the router stays float)."""
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"quantize: model must be a torchref.model.LlamaForCausalLM, got {type(model).__name__}")
    if any(isinstance(m, QUANTIZED) for m in model.modules()):
        raise ValueError("quantize: model is already quantized")
    out = copy.deepcopy(model)
    for row in params.quantizable_rows(model.config):  # the parameter table's linear weights
        for root in out.model.layers if row.per_layer else (out,):
            parent_path, _, name = row.module.rpartition(".")
            parent = root.get_submodule(parent_path)
            module = getattr(parent, name)
            if not isinstance(module, QUANTIZED):  # the experts' three rows share one module
                setattr(parent, name, Int8Experts(module) if isinstance(module, Experts) else Int8Linear(module))
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers (int8 + scales for quantized layers); a tied
    weight counts once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [
        b for n, b in model.named_buffers() if n.split(".")[-1].endswith(("weight_int8", "scale", "_int8"))
    ]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
