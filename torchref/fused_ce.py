"""Fused linear + cross-entropy (twin of ``jaxattn/fused_ce.py``): the LM head and the loss in chunks of tokens.

    loss = fused_cross_entropy(hidden, model.lm_head.weight, targets, weights, chunk=1024)   # [N, dim], [vocab, dim]

``hidden`` ``[N, dim]``, ``weight`` ``[vocab, dim]`` (``nn.Linear``'s layout, tied or not), ``targets`` int ``[N]``,
``weights`` float ``[N]``: ``sum(w * nll) / denominator`` (default ``max(sum(w), 1)``) as ``train_step``'s dense loss
computes it, without ever holding ``[N, vocab]`` logits: an ``autograd.Function`` whose forward keeps one chunk's
float32 logits at a time and saves the per-token log-sum-exp as two floats (the max logit ``m`` and
``log(sum(exp(logits - m)))``: one float32 ``m + log-sum`` rounds at ``ulp(m)``, and with it the softmax of logits
near 1e4); its backward recomputes each chunk's logits and gives
``d hidden`` and ``d weight`` directly (``dlogits = (softmax - onehot) * w / denominator``; float32 accumulation).
Liger-Kernel's FusedLinearCrossEntropy does this in Triton (GPU only); this is the same algorithm in plain torch ops,
a Python loop over a fixed number of chunks, which ``torch.compile`` unrolls. Written by hand: no torch library
ships one for the CPU. ``parity_tests/test_fused_ce.py`` checks it against the dense loss and the JAX twin.
"""

from __future__ import annotations

import torch

from twincore.loss import DEFAULT_CHUNK

__all__ = ["fused_cross_entropy", "DEFAULT_CHUNK"]


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, w: torch.Tensor):
    """One chunk's float32 logits ``[chunk, vocab]`` (the matmul in ``x``'s dtype, as the head under autocast) with
    weight-0 rows (and their targets) replaced by 0."""
    keep = w > 0
    logits = (x @ weight.to(x.dtype).T).float().masked_fill_(~keep[:, None], 0.0)  # in place: one chunk buffer
    return logits, torch.where(keep, t, 0)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, denominator, chunk):
        total = hidden.new_zeros((), dtype=torch.float32)
        maxes, log_sums = [], []
        for s in range(0, hidden.shape[0], chunk):
            x, t, w = hidden[s : s + chunk], targets[s : s + chunk], weights[s : s + chunk]
            logits, t = _chunk_logits(x, weight, t, w)
            m = logits.amax(dim=-1)  # [chunk]
            target_logit = logits.gather(1, t[:, None])[:, 0]
            log_sum = logits.sub_(m[:, None]).exp_().sum(dim=-1).log_()  # in place: one chunk buffer
            total = total + (((m - target_logit) + log_sum) * w).sum()
            maxes.append(m)
            log_sums.append(log_sum)
        ctx.save_for_backward(hidden, weight, targets, weights, denominator, torch.cat(maxes), torch.cat(log_sums))
        ctx.chunk = chunk
        return total / denominator

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets, weights, denominator, m, log_sum = ctx.saved_tensors
        scale = g / denominator
        dhidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w_c = weight.to(hidden.dtype)
        for s in range(0, hidden.shape[0], ctx.chunk):
            x, t, w = hidden[s : s + ctx.chunk], targets[s : s + ctx.chunk], weights[s : s + ctx.chunk]
            logits, t = _chunk_logits(x, weight, t, w)
            # softmax from the forward's log-sum-exp, in place
            dlogits = logits.sub_(m[s : s + ctx.chunk, None]).sub_(log_sum[s : s + ctx.chunk, None]).exp_()
            dlogits[torch.arange(len(t), device=t.device), t] -= 1.0
            dlogits = dlogits.mul_((w * scale)[:, None]).to(hidden.dtype)
            if dhidden is not None:
                dhidden[s : s + ctx.chunk] = (dlogits @ w_c).to(hidden.dtype)  # logits = x @ W.T: dx = dlogits @ W
            dweight += (dlogits.T @ x).float()  # dW = dlogits.T @ x, accumulated in float32
        return dhidden, dweight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None, None


def fused_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    denominator: torch.Tensor | float | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weighted mean token cross-entropy of ``hidden @ weight.T`` (see the module docstring); float32 scalar.
    ``dtype``: the head matmul's dtype (autocast's compute dtype; default ``hidden``'s), accumulated in float32."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_cross_entropy: hidden must be [N, dim] with targets and weights [N]; got hidden "
            f"{list(hidden.shape)}, targets {list(targets.shape)}, weights {list(weights.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"fused_cross_entropy: weight must be [vocab, dim] with dim={hidden.shape[1]}; got {list(weight.shape)}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"fused_cross_entropy: chunk must be a positive int (tokens per chunk), got {chunk!r}")
    weights = weights.float()
    if denominator is None:
        denominator = weights.sum().clamp(min=1.0)
    denominator = torch.as_tensor(denominator, dtype=torch.float32, device=hidden.device)
    if dtype is not None and hidden.dtype != dtype:
        hidden = hidden.to(dtype)  # the gradient flows back through the cast
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets.long(), weights, denominator, chunk)
