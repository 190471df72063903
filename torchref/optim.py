"""Optimizers for the training CLI's ``--optimizer`` choices, with a ``LambdaLR`` schedule (twin of ``jaxattn.optim``).

    optimizer, scheduler = build(model, "adamw", 3e-4, weight_decay=0.1, schedule="cosine", warmup=100, steps=10_000)
    ...; metrics = step(batch); step_scheduler(scheduler, skipped=bool(metrics["skipped"]))

Names, defaults, schedules and the weight-decay rule (by NAME: two param groups) are ``twincore.optim``'s.
``scheduler.last_epoch`` counts APPLIED updates, as optax's ``count`` does: call :func:`step_scheduler`, which
steps it only when the update was applied (``GradScaler.step`` may skip ``optimizer.step()``).

* ``adamw`` / ``adamw_fused``: ``torch.optim.AdamW`` (``fused=True``: one fused kernel over all tensors).
* ``adafactor``: ``torch.optim.Adafactor(lr, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0)``.
* ``adamw8bit``: :class:`AdamW8bit`, block-wise 8-bit AdamW with the rounding of ``jaxattn.optim`` (bitsandbytes'
  CPU quantiser is the same algorithm but does not always round to the nearest entry; the tests compare).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from twincore import optim as spec
from twincore.optim import BLOCK_SIZE, MIN_8BIT_SIZE, OPTIMIZER_NAMES, SCHEDULE_NAMES

__all__ = ["build", "step_scheduler", "param_groups", "AdamW8bit", "state_bytes", "OPTIMIZER_NAMES", "SCHEDULE_NAMES"]


def _named(params_or_model: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params_or_model, torch.nn.Module):
        return list(params_or_model.named_parameters())
    if isinstance(params_or_model, Mapping):
        items = list(params_or_model.items())
    elif isinstance(params_or_model, Iterable) and not isinstance(params_or_model, torch.Tensor):
        items = list(params_or_model)
    else:
        items = None
    if not items or not all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) and isinstance(i[1], torch.Tensor) for i in items
    ):
        raise TypeError(
            "params_or_model must be an nn.Module, a dict name -> Parameter, or (name, Parameter) "
            "pairs such as model.named_parameters(): the no-decay rule goes by name; got "
            f"{type(params_or_model).__name__}"
        )
    return items


def param_groups(params_or_model: Any, weight_decay: float) -> list[dict]:
    """Two param groups by ``twincore.optim.decays``: ``weight_decay`` for weights, 0 for norm weights and biases
    (parameters with ``requires_grad=False`` are left out; empty groups are dropped)."""
    named = [(n, p) for n, p in _named(params_or_model) if p.requires_grad]
    decay = [p for n, p in named if spec.decays(n)]
    no_decay = [p for n, p in named if not spec.decays(n)]
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, skipped: bool) -> None:
    """Advance ``scheduler`` only when this step's optimizer update was applied (optax's count rule)."""
    if not skipped:
        scheduler.step()


# ----------------------------------------------------------------------------------------------------------------
# 8-bit AdamW
# ----------------------------------------------------------------------------------------------------------------


def _quantize(x: torch.Tensor, code: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest map entry to ``x / absmax`` per block, ties to the lower index
    (``twincore.optim.quantize_blockwise``)."""
    flat = x.reshape(-1)
    n_blocks = -(-flat.numel() // block_size)
    blocks = F.pad(flat, (0, n_blocks * block_size - flat.numel())).view(n_blocks, block_size)
    absmax = blocks.abs().amax(dim=1)
    nonzero = (absmax > 0)[:, None]
    normed = torch.where(nonzero, blocks / torch.where(nonzero, absmax[:, None], 1.0), 0.0)
    idx = (torch.searchsorted(code, normed.contiguous(), right=True) - 1).clamp_(0, code.numel() - 2)
    right_closer = (normed - code[idx + 1]).abs() < (normed - code[idx]).abs()
    return (idx + right_closer).to(torch.uint8), absmax


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (code[codes.long()] * absmax[:, None]).reshape(-1)[: like.numel()].view(like.shape)


class AdamW8bit(torch.optim.Optimizer):
    """Block-wise 8-bit AdamW (Dettmers et al. 2022; bitsandbytes' ``AdamW8bit`` with ``percentile_clipping=100``).

    Per parameter with at least ``min_8bit_size`` elements: dequantise m and v, update them in float32, take
    the direction ``u = (m / (sqrt(v) / sqrt(1 - b2^t) + eps)) / (1 - b1^t)`` from these float32 values, apply
    ``p <- p - lr * (u + wd * p)`` (optax.adamw's chain order), and store m and v back in 8 bits: per block of
    ``block_size`` consecutive elements one float32 absmax, m on the signed and v on the unsigned dynamic map
    (``twincore.optim.quantization_map``), nearest entry, ties to the lower index. Smaller parameters keep float32
    moments (same update). State per quantised element: 2 bytes + 8 bytes per block.

    FSDP2's DTensor parameters (``--parallel fsdp``: rows split evenly over a 1-D mesh, whole blocks per rank) are
    updated shard by shard, their 8-bit state a DTensor row-sharded like them: the ranks' blocks, in order, are the
    one-process blocks, and a full state dict gathers the one-process state. Other shardings (tensor parallel's
    column shards) would cut blocks across ranks and are refused before any parameter moves.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        *,
        block_size: int = BLOCK_SIZE,
        min_8bit_size: int = MIN_8BIT_SIZE,
    ):
        for arg, val in (("block_size", block_size), ("min_8bit_size", min_8bit_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg}={val!r} must be a positive int")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(f"lr={lr!r} must be a float >= 0")
        spec.check_hparams("adamw8bit", 1.0, weight_decay, b1=betas[0], b2=betas[1], eps=eps)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size, self.min_8bit_size = block_size, min_8bit_size
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _codes(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._maps:
            self._maps[device] = tuple(torch.from_numpy(spec.quantization_map(s)).to(device) for s in (True, False))
        return self._maps[device]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # every shard checked before any parameter moves
            for p in group["params"]:
                if p.grad is not None and not self.state[p] and p.numel() >= self.min_8bit_size:
                    _check_blocks(p, _local(p), self.block_size)
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                code_m, code_v = self._codes(p.device)
                state = self.state[p]
                quantised = p.numel() >= self.min_8bit_size  # the whole parameter's size, sharded or not
                local = _local(p)  # this rank's shard of a DTensor (FSDP2), else p itself
                if not state:
                    state["step"] = 0
                    if quantised:  # absmax 0: every code dequantises to 0
                        n_blocks = -(-_check_blocks(p, local, self.block_size) // self.block_size)
                        for k in ("m", "v"):
                            codes = torch.zeros(n_blocks, self.block_size, dtype=torch.uint8, device=p.device)
                            state[f"{k}_codes"] = _like(codes, p)
                            state[f"{k}_absmax"] = _like(torch.zeros(n_blocks, dtype=torch.float32, device=p.device), p)
                    else:  # like p: a DTensor of p's placements when p is one
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                g = _local(_placed_like(p.grad, p)).float()
                if quantised:
                    m = _dequantize(_local(state["m_codes"]), _local(state["m_absmax"]), code_m, local)
                    v = _dequantize(_local(state["v_codes"]), _local(state["v_absmax"]), code_v, local)
                else:
                    m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                u = m / (v.sqrt() / math.sqrt(1.0 - b2**t) + eps) / (1.0 - b1**t)
                p32 = local.float()
                local.copy_(p32 - lr * (u + wd * p32))
                if quantised:
                    for k, x, code in (("m", m, code_m), ("v", v, code_v)):
                        codes, absmax = _quantize(x, code, self.block_size)
                        state[f"{k}_codes"], state[f"{k}_absmax"] = _like(codes, p), _like(absmax, p)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the parameter), or the tensor itself."""
    if not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _placed_like(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``p``'s placements (tensor parallel can leave a gradient placed otherwise than its parameter)."""
    if not torch.distributed.is_available():
        return grad
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def _like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """8-bit state made from ``p``'s shard, as a DTensor row-sharded like ``p`` when ``p`` is one: the blocks of the
    ranks, in rank order, are then the blocks of the whole parameter, and a full state dict gathers the one-process
    state (and scatters it back on load)."""
    if not torch.distributed.is_available():
        return local
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, [Shard(0)], run_check=False)


def _check_blocks(p: torch.Tensor, local: torch.Tensor, block_size: int) -> int:
    """The number of elements the 8-bit blocks cover on this rank (ValueError where a DTensor's shard would cut
    blocks: only a 1-D mesh's even row shards, of whole blocks each, keep the one-process blocks)."""
    if not torch.distributed.is_available():
        return p.numel()
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return p.numel()
    ranks = p.device_mesh.size()
    rows = p.shape[0] if p.dim() else 0
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),) or rows % ranks or local.numel() % block_size:
        raise ValueError(
            f"AdamW8bit: a DTensor parameter of shape {list(p.shape)} with placements {tuple(p.placements)} on a "
            f"{p.device_mesh.ndim}-D mesh of {ranks} ranks ({local.numel()} elements here); its 8-bit blocks take "
            f"the rows of a 1-D mesh (FSDP2's Shard(0)), split evenly, a multiple of block_size={block_size} "
            f"elements per rank: use --parallel fsdp or ddp, or --optimizer adamw"
        )
    return local.numel()


# ----------------------------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------------------------


def build(
    params_or_model: Any,
    name: str,
    lr: float | Callable[[int], float],
    weight_decay: float = spec.WEIGHT_DECAY_DEFAULT,
    *,
    schedule: str = "constant",
    warmup: int = 0,
    steps: int | None = None,
    min_lr_ratio: float = 0.0,
    b1: float | None = None,
    b2: float | None = None,
    eps: float | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``(optimizer, scheduler)`` for ``--optimizer name`` (one of ``OPTIMIZER_NAMES``).

    ``params_or_model``: an ``nn.Module`` or named parameters (the decay rule needs names). ``lr``: the peak lr
    (shaped by ``schedule``/``warmup``/``steps``/``min_lr_ratio`` through ``LambdaLR``) or a callable
    ``applied_steps -> lr``. ``b1``/``b2``/``eps`` default to ``twincore.optim.ADAMW_DEFAULTS`` (refused for
    adafactor). Advance the scheduler with :func:`step_scheduler`. Bad values raise a ValueError naming them.
    """
    hp = spec.check_hparams(
        name,
        lr,
        weight_decay,
        schedule=schedule,
        warmup=warmup,
        steps=steps,
        min_lr_ratio=min_lr_ratio,
        b1=b1,
        b2=b2,
        eps=eps,
    )
    groups = param_groups(params_or_model, float(weight_decay))
    if callable(lr):
        base, factor = 1.0, (lambda step: float(lr(step)))
    else:
        kw = dict(
            schedule=schedule,
            warmup=int(warmup),
            steps=None if steps is None else int(steps),
            min_lr_ratio=float(min_lr_ratio),
        )
        base, factor = float(lr), (lambda step: float(spec.lr_factor(step, **kw)))
    if name in ("adamw", "adamw_fused"):
        opt = torch.optim.AdamW(
            groups,
            lr=base,
            betas=(hp["b1"], hp["b2"]),
            eps=hp["eps"],
            weight_decay=float(weight_decay),
            fused=True if name == "adamw_fused" else None,
        )
    elif name == "adamw8bit":
        opt = AdamW8bit(groups, lr=base, betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=float(weight_decay))
    else:
        d = spec.ADAFACTOR_DEFAULTS
        opt = torch.optim.Adafactor(
            groups,
            lr=base,
            beta2_decay=-d["decay_rate"],
            eps=(None, d["min_param_scale"]),
            d=d["clipping_threshold"],
            weight_decay=float(weight_decay),
        )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's per-parameter state tensors (each storage counted once)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total
