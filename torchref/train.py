"""One training step for the PyTorch Llama, the twin of ``jaxattn.train.train_step``.

The canonical ``torch.amp`` recipe: forward under ``torch.autocast`` (per the precision policy), loss = mean
next-token cross-entropy in float32 over ``tokens[:, :-1] -> tokens[:, 1:]`` (weighted by the loss mask and by
segment boundaries), ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)`` BEFORE clipping,
``torch.nn.utils.clip_grad_norm_``, ``scaler.step(optimizer)`` (skipped on non-finite gradients), and
``scaler.update()``. Without a scaler (fp32 / bf16) it is the plain ``backward`` / ``clip`` / ``step``.

The optimizer is the caller's (e.g. ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)``; see
``jaxattn/train.py`` for why that equals ``optax.adamw`` with the same hyper-parameters).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from .precision import Policy, get_policy

__all__ = ["train_step", "loss_fn", "loss_weights", "cross_entropy", "BATCH_KEYS"]

BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")

_FP16_NO_SCALE = ("fp16 training WITHOUT dynamic loss scaling: float16 gradients underflow to zero and "
                  "overflow to inf without it. Pass scaler=Policy.preset('fp16').make_grad_scaler(device) "
                  "(torch.amp.GradScaler), or train in bf16.")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_batch(batch: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping with keys {BATCH_KEYS} ('tokens' required), "
                        f"got {type(batch).__name__}")
    unknown = [k for k in batch if k not in BATCH_KEYS]
    if unknown or "tokens" not in batch:
        raise ValueError(f"batch keys must be 'tokens' plus optional {BATCH_KEYS[1:]}; got {sorted(batch)}")
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.is_floating_point() or tokens.shape[1] < 2:
        raise ValueError(f"batch['tokens'] must be an int tensor [batch, seq] with seq >= 2, "
                         f"got {tokens.dtype}{list(tokens.shape)}")
    for k in BATCH_KEYS[1:]:
        if batch.get(k) is not None and tuple(batch[k].shape) != tuple(tokens.shape):
            raise ValueError(f"batch[{k!r}] must have the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(batch[k].shape)}")


def loss_weights(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """float32 ``[B, S-1]`` target weights: ``loss_mask[:, 1:]`` times "same segment as the previous token"."""
    tokens = batch["tokens"]
    w = torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.float32, device=tokens.device)
    if batch.get("loss_mask") is not None:
        w = w * batch["loss_mask"][:, 1:].float()
    if batch.get("segment_ids") is not None:
        seg = batch["segment_ids"]
        w = w * (seg[:, 1:] == seg[:, :-1]).float()
    return w


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean token cross-entropy in float32: ``sum(w * nll) / max(sum(w), 1)``."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().long(), reduction="none")
    return (nll * weights.flatten()).sum() / weights.sum().clamp_min(1.0)


def loss_fn(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], *, policy: Union[str, Policy] = "fp32"
            ) -> torch.Tensor:
    """Next-token loss (forward under the policy's autocast; the loss itself in float32, outside autocast)."""
    policy = get_policy(policy)
    tokens = batch["tokens"]
    pos, seg = batch.get("positions"), batch.get("segment_ids")
    with policy.autocast(tokens.device.type):
        logits = model(tokens[:, :-1], positions=None if pos is None else pos[:, :-1],
                       segment_ids=None if seg is None else seg[:, :-1])
    return cross_entropy(logits, tokens[:, 1:], loss_weights(batch))


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    per_device = scaler._found_inf_per_device(optimizer)  # set by unscale_; the same value step() consults
    return bool(sum(v.item() for v in per_device.values()))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor], *,
               policy: Union[str, Policy] = "fp32", scaler: Optional[torch.amp.GradScaler] = None,
               max_grad_norm: Optional[float] = None) -> dict[str, Any]:
    """One training step, in place on ``model`` / ``optimizer`` / ``scaler``; returns the metrics.

    ``batch``: ``{"tokens": int [B, S+1], "loss_mask"?, "segment_ids"?, "positions"?}`` (same shapes).
    Metrics: ``loss`` (float32 0-d tensor, unscaled), ``grad_norm`` (0-d tensor: global norm of the unscaled
    gradients before clipping), ``loss_scale`` (float: the scale applied to this step's loss, 1.0 without a
    scaler), ``skipped`` (bool).
    """
    policy = get_policy(policy)
    _check_batch(batch)
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be None or a positive float, got {max_grad_norm!r}")
    scaling = scaler is not None and scaler.is_enabled()
    if policy.uses_loss_scaling and not scaling:
        _warn_once(_FP16_NO_SCALE)

    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch, policy=policy)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if scaling:
        scaler.scale(loss).backward()
        loss_scale = scaler.get_scale()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
        loss_scale = 1.0
    grads = [p.grad for p in params if p.grad is not None]
    if max_grad_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if scaling:
        skipped = _found_inf(scaler, optimizer)
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
        skipped = False
    return {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "loss_scale": float(loss_scale),
            "skipped": skipped}
