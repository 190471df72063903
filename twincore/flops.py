"""Model FLOPs, one formula for every benchmark and report: 6·N per trained token (2·N forward only) for the N
parameters a token's matmuls use (``params.active_matmul_param_count``: an MoE counts its top-k experts), plus
attention by FlashAttention's convention (forward 4·B·H·Sq·Sk·D, halved when causal; the backward 2.5× the forward).

    model_flops(ModelConfig.preset("1b"), batch=4, seq=2048, train=True)["model_flops"]
"""

from __future__ import annotations

from .params import active_matmul_param_count

__all__ = ["attention_flops", "model_flops", "flops_per_token"]


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool, backward: bool = False) -> float:
    """Forward 4·B·H·Sq·Sk·D (halved when causal); ``backward=True``: forward + backward = 3.5× forward."""
    f = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


def model_flops(cfg, batch: int, seq: int, *, train: bool) -> dict:
    """``{"matmul_params", "dense_flops", "attention_flops", "model_flops"}`` of one causal step over
    ``batch × seq`` tokens (a train step: forward + backward)."""
    n = active_matmul_param_count(cfg)
    dense = (6 if train else 2) * n * batch * seq
    attn = cfg.n_layers * attention_flops(batch, cfg.n_heads, seq, seq, cfg.resolved_head_dim, True, backward=train)
    return {
        "matmul_params": n,
        "dense_flops": float(dense),
        "attention_flops": float(attn),
        "model_flops": float(dense + attn),
    }


def flops_per_token(cfg, seq: int, train: bool = True) -> float:
    """Model FLOPs per token at sequence length ``seq`` (what MFU divides by the peak)."""
    return model_flops(cfg, 1, seq, train=train)["model_flops"] / seq
