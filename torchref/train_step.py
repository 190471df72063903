"""One training step for the PyTorch Llama, the twin of ``jaxattn.train_step.make_train_step``.

    step = make_train_step(model, torch.optim.AdamW(model.parameters(), lr=3e-4), policy="bf16")
    metrics = step({"tokens": tokens})                     # loss, grad_norm, loss_scale, skipped

The canonical ``torch.amp`` recipe: forward under ``torch.autocast`` (per the precision policy), loss = mean
next-token cross-entropy in float32 over ``tokens[:, :-1] -> tokens[:, 1:]`` (weighted by the loss mask and by
segment boundaries; masked targets dropped with ``where``), ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)`` BEFORE clipping, ``torch.nn.utils.clip_grad_norm_``, ``scaler.step(optimizer)``
(skipped on non-finite gradients), and ``scaler.update()``. Without a scaler (fp32 / bf16) it is the plain
``backward`` / ``clip`` / ``step``. The batch format and the token-id rule are ``twincore.batch``'s, checked
before the forward.

The optimizer is the caller's (e.g. ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)``; see
``parity_tests/test_train_step.py`` for why that equals ``optax.adamw`` with the same hyper-parameters).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from twincore.batch import BATCH_KEYS, check_batch, check_token_ids
from twincore.grad_accum import check_accum_batch, check_grad_accum
from twincore.loss import DEFAULT_CHUNK, check_loss

from .fused_ce import fused_cross_entropy
from .precision import Policy, get_policy

__all__ = [
    "make_train_step",
    "loss_fn",
    "moe_metrics",
    "loss_weights",
    "loss_denominator",
    "cross_entropy",
    "BATCH_KEYS",
]

_FP16_NO_SCALE = (
    "fp16 training WITHOUT dynamic loss scaling: float16 gradients underflow to zero and "
    "overflow to inf without it. Pass scaler=Policy.preset('fp16').make_grad_scaler(device) "
    "(torch.amp.GradScaler), or train in bf16."
)
_warned: set[str] = set()
Metrics = dict[str, torch.Tensor]


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, denominator: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted mean token cross-entropy in float32: ``sum(w * nll) / max(sum(w), 1)``; targets with ``w == 0``
    are dropped with ``where`` on the logits and targets first (a NaN logit or an out-of-range target there
    stays out of the loss and its gradient, where ``0 * nan`` would not). ``denominator`` replaces
    ``max(sum(w), 1)`` (gradient accumulation divides each microbatch by the WHOLE batch's weight)."""
    keep = weights > 0
    logits = torch.where(keep[..., None], logits.float(), 0.0)
    targets = torch.where(keep, targets.long(), 0)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    if denominator is None:
        denominator = weights.sum().clamp_min(1.0)
    return (nll * weights.flatten()).sum() / denominator


def loss_denominator(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """float32 ``max(sum(loss_weights(batch)), 1)``: the number of real (loss-weighted) targets in ``batch``."""
    return loss_weights(batch).sum().clamp_min(1.0)


def loss_fn(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    policy: str | Policy = "fp32",
    denominator: torch.Tensor | None = None,
    loss: str = "dense",
    loss_chunk: int = DEFAULT_CHUNK,
    moe_scale: float | None = None,
):
    """Next-token loss (forward under the policy's autocast; the loss itself in float32, outside autocast);
    ``denominator``: see :func:`cross_entropy`. ``loss="fused"``: the final hidden states (``model(...,
    head=False)``, through any DDP / FSDP / torch.compile wrapper) and the LM head go to
    :func:`torchref.fused_ce.fused_cross_entropy` in chunks of ``loss_chunk`` tokens (the same number, never the
    ``[tokens, vocab]`` logits).

    ``moe_scale`` (training): returns ``(loss, moe)`` as ``jaxattn.train_step.loss_fn`` does — for a
    Mixture-of-Experts model the loss also holds ``moe_scale * (router_aux_loss_coef * aux_loss +
    router_z_loss_coef * z_loss)`` and ``moe`` the router metrics (:func:`moe_metrics`; ``{}`` when dense)."""
    check_loss(loss, loss_chunk)
    policy = get_policy(policy)
    tokens = batch["tokens"]
    pos, seg = batch.get("positions"), batch.get("segment_ids")
    inputs = dict(positions=None if pos is None else pos[:, :-1], segment_ids=None if seg is None else seg[:, :-1])
    cfg = getattr(_unwrap(model), "config", None)
    routed = moe_scale is not None and getattr(cfg, "is_moe", False)
    if routed:
        inputs.update(moe_stats=True, moe_mask=None if seg is None else seg[:, :-1] != 0)
    with policy.autocast(tokens.device.type):
        out = model(tokens[:, :-1], **inputs, head=loss != "fused")  # fused: [B, S, dim] hidden states
    moe = None
    if routed:
        out, moe = out
    value = _next_token_loss(model, out, batch, policy, denominator, loss, loss_chunk)
    if moe_scale is None:
        return value
    if moe is None:
        return value, {}
    value = value + moe_scale * (cfg.router_aux_loss_coef * moe["aux_loss"] + cfg.router_z_loss_coef * moe["z_loss"])
    return value, moe_metrics(moe, cfg)


def moe_metrics(moe: Mapping[str, torch.Tensor], cfg) -> Metrics:
    """The train step's router metrics (``jaxattn.train_step.moe_metrics``' twin): ``aux_loss``, ``z_loss``
    (unweighted), ``expert_load_min`` / ``expert_load_max`` (the least / most loaded expert of any layer as a
    multiple of a balanced share) and ``dropped_fraction``; detached."""
    load = moe["tokens_per_expert"].float()  # [L, E]
    balanced = load.sum(-1, keepdim=True).clamp_min(1.0) / cfg.n_experts
    return {
        "aux_loss": moe["aux_loss"].detach().float(),
        "z_loss": moe["z_loss"].detach().float(),
        "expert_load_min": (load / balanced).min(),
        "expert_load_max": (load / balanced).max(),
        "dropped_fraction": moe["dropped_fraction"].detach().float(),
    }


def _next_token_loss(model, out, batch, policy, denominator, loss, loss_chunk) -> torch.Tensor:
    tokens = batch["tokens"]
    if loss == "fused":
        weights = loss_weights(batch)
        return fused_cross_entropy(
            out.flatten(0, 1),
            _unwrap(model).lm_head.weight,
            tokens[:, 1:].flatten(),
            weights.flatten(),
            denominator,  # None: fused_cross_entropy's own max(sum(weights), 1)
            chunk=loss_chunk,
            dtype=policy.compute_dtype,
        )
    return cross_entropy(out, tokens[:, 1:], loss_weights(batch), denominator)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``LlamaForCausalLM`` inside a DDP wrapper and/or a ``torch.compile``d module."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def _tensor_parallel(model: torch.nn.Module) -> bool:
    """True when the LM head is split by tensor parallelism (a DTensor sharded on a ``"tp"`` mesh dimension,
    ``torchref.parallel``): the fused loss would need the vocabulary-parallel cross-entropy (torchtitan's loss
    parallel), which it is not. FSDP's shards (the ``"dp"`` dimension) are gathered in the forward, as usual."""
    from torch.distributed.tensor import DTensor, Shard

    w = getattr(getattr(_unwrap(model), "lm_head", None), "weight", None)
    if not isinstance(w, DTensor):
        return False
    names = w.device_mesh.mesh_dim_names or ()
    return any(n == "tp" and isinstance(p, Shard) for n, p in zip(names, w.placements))


def make_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    policy: str | Policy = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
    grad_accum: int = 1,
    loss: str = "dense",
    loss_chunk: int = DEFAULT_CHUNK,
) -> Callable[[Mapping[str, torch.Tensor]], Metrics]:
    """``step(batch) -> metrics``: one training step, in place on ``model`` / ``optimizer`` / ``scaler``.

    ``batch``: ``{"tokens": int [B, S+1], "loss_mask"?, "segment_ids"?, "positions"?}`` (same shapes;
    ``twincore.batch``); ids outside ``[0, vocab)`` raise ValueError naming the first one. ``metrics``, each
    a 0-d tensor as in ``jaxattn.train_step.make_train_step``: ``loss`` (float32, unscaled), ``grad_norm`` (float32:
    global norm of the unscaled gradients before clipping), ``loss_scale`` (float32: the scale applied to this
    step's loss, 1 without a scaler), ``skipped`` (bool). A skipped step is read with GradScaler's public API:
    ``update()`` backs the scale off exactly when ``step()`` skipped (found a non-finite gradient).

    ``grad_accum=k``: the batch (``[k * b, S+1]``) is split into ``k`` microbatches of ``b`` consecutive rows,
    each forward + ``backward()`` in turn (gradients accumulate in ``.grad``), then one unscale / clip / step.
    Each microbatch loss is divided by the real (loss-weighted) targets of the WHOLE batch, so the step equals
    one step on the full batch up to float rounding; a ``k`` that does not divide the batch is a ValueError.

    ``loss``: ``"dense"`` (the head's full logits, then the loss) or ``"fused"`` (:mod:`torchref.fused_ce`: the head
    and the loss in chunks of ``loss_chunk`` tokens, never the whole logits): with the plain model, DDP, FSDP2 and
    ``torch.compile``, not with a tensor-parallel LM head (ValueError).
    """
    grad_accum = check_grad_accum(grad_accum)
    check_loss(loss, loss_chunk)
    if loss == "fused" and not hasattr(_unwrap(model), "lm_head"):
        raise ValueError(f"loss='fused' needs a LlamaForCausalLM (its lm_head), got {type(_unwrap(model)).__name__}")
    if loss == "fused" and _tensor_parallel(model):
        raise ValueError(
            "loss='fused' does not run with a tensor-parallel LM head (split over the vocabulary: it would need "
            "a vocabulary-parallel cross-entropy); use loss='dense' with tp / fsdp+tp"
        )
    policy = get_policy(policy)
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be None or a positive float, got {max_grad_norm!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be None or a torch.amp.GradScaler, got {type(scaler).__name__}")
    scaling = scaler is not None and scaler.is_enabled()
    if policy.uses_loss_scaling and not scaling:
        _warn_once(_FP16_NO_SCALE)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def step(batch: Mapping[str, torch.Tensor], denominator: torch.Tensor | None = None) -> Metrics:
        check_batch(batch)
        micro = check_accum_batch(batch, grad_accum)
        tokens = batch["tokens"]
        if vocab is not None and bool(((tokens < 0) | (tokens >= vocab)).any()):
            check_token_ids(tokens.detach().cpu(), vocab, arg="batch['tokens']")
        optimizer.zero_grad(set_to_none=True)
        denominator = loss_denominator(batch) if denominator is None else denominator  # torchref.parallel: global
        loss_scale = scaler.get_scale() if scaling else 1.0
        total = torch.zeros((), dtype=torch.float32, device=tokens.device)
        moe: dict[str, torch.Tensor] = {}  # an MoE's router metrics, mean over micro-batches
        for i in range(grad_accum):
            mb = {k: v if v is None else v[i * micro : (i + 1) * micro] for k, v in batch.items()}
            mb_loss, mb_moe = loss_fn(
                model,
                mb,
                policy=policy,
                denominator=denominator,
                loss=loss,
                loss_chunk=loss_chunk,
                moe_scale=1.0 / grad_accum,
            )
            (scaler.scale(mb_loss) if scaling else mb_loss).backward()
            total = total + mb_loss.detach()
            moe = {k: moe.get(k, 0.0) + v / grad_accum for k, v in mb_moe.items()}
        if scaling:
            scaler.unscale_(optimizer)
        if max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if scaling:
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < loss_scale  # backoff < 1: the scale shrinks exactly on a skipped step
        else:
            optimizer.step()
            skipped = False
        return {
            "loss": total,
            "grad_norm": grad_norm.detach().float(),
            "loss_scale": torch.tensor(loss_scale, dtype=torch.float32),
            "skipped": torch.tensor(skipped),
            **moe,
        }

    return step
