"""Mixture of Experts for the torch model (twin: ``jaxattn/moe.py``): the router, its load-balancing and z losses, and
the experts' SwiGLUs — dropless (tokens sorted by expert, one ``torch._grouped_mm`` per projection) or with a
capacity factor (static ``[rows, experts, capacity]`` buffers; assignments past an expert's capacity are dropped).

    block = MoEBlock(cfg)                     # HF names: block.gate (the router), block.experts.gate_proj ...
    y, stats = block(x)                       # x [B, S, dim]
    losses = moe_losses([stats, ...], cfg)    # aux_loss, z_loss, tokens_per_expert [L, E], dropped_fraction

The router follows transformers' Mixtral / Qwen3-MoE order (float32 logits, softmax, top-k, optional
renormalisation); the losses are ``load_balancing_loss_func``'s and ST-MoE's z-loss (derivations in
``jaxattn/moe.py``). Experts are stacked ``[E, out, in]`` parameters (transformers 5's layout; ``torchref.hf`` splits
them into the per-expert tensors of HF files). ``torch._grouped_mm`` needs 16-byte-aligned feature sizes and
float32/bf16/fp16; elsewhere (or on a build without it) :func:`grouped_mm` runs one matmul per expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEBlock", "Experts", "ExpertParallel", "route", "grouped_mm", "moe_losses", "STAT_KEYS"]

STAT_KEYS = ("counts", "probs", "z", "tokens", "kept", "routed")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # under torch.compile the op's fake kernel (what Dynamo traces) takes bf16 only, whatever eager accepts
    dtypes = (torch.bfloat16,) if torch.compiler.is_compiling() else _GROUPED_DTYPES
    if not hasattr(torch, "_grouped_mm") or x.dtype not in dtypes or w.dtype != x.dtype:
        return False
    size = x.element_size()
    return all(n * size % 16 == 0 for n in (x.shape[-1], w.shape[-2], w.shape[-1]))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rows of ``x [T, in]`` grouped by ``sizes [E]`` (consecutive, summing to T), group e times ``w[e] [in, out]``:
    ``[T, out]``. ``torch._grouped_mm`` where it applies; else one matmul per expert (a host sync for the sizes)."""
    if _grouped_mm_ok(x, w):
        y = torch._grouped_mm(x, w, offs=torch.cumsum(sizes, 0, dtype=torch.int32))
        if y.requires_grad:  # its backward refuses a broadcast (stride-0) gradient, e.g. the one of a .sum()
            y.register_hook(lambda g: g.contiguous())
        return y
    parts = torch.split(x, sizes.tolist())
    return torch.cat([p @ w[e] for e, p in enumerate(parts)]) if parts else x.new_zeros(0, w.shape[-1])


class Experts(nn.Module):
    """``n_experts`` SwiGLUs, stacked: ``gate_proj`` / ``up_proj`` ``[E, ffn, dim]``, ``down_proj``
    ``[E, dim, ffn]``."""

    def __init__(self, cfg):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
        self.gate_proj = nn.Parameter(torch.empty(e, f, d))
        self.up_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, matmul, ep: ExpertParallel | None = None) -> torch.Tensor:
        """``matmul(x, w [E, in, out])`` is the grouped (or batched) product, in autocast's dtype when it is on
        (``torch._grouped_mm`` is not on autocast's op lists: cast here, as autocast casts a Linear); under expert
        parallelism ``ep`` the local experts' weights."""
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        w = self.weights(x.dtype) if ep is None else ep.weights(self, x.dtype)
        w = [m.transpose(-2, -1) for m in w]  # [E, in, out]
        return matmul(F.silu(matmul(x, w[0])) * matmul(x, w[1]), w[2])

    def weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """``[gate_proj, up_proj, down_proj]`` in ``dtype`` (HF layout ``[E, out, in]``; this rank's experts when
        they are DTensors sharded by expert parallelism)."""
        return [_local(p).to(dtype) for p in (self.gate_proj, self.up_proj, self.down_proj)]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def route(x: torch.Tensor, router: nn.Linear, cfg):
    """``x [T, dim]`` -> ``(logits [T, E] f32, probs [T, E] f32, weights [T, k] f32, experts [T, k] int64)``."""
    with torch.autocast(x.device.type, enabled=False):  # float32 logits (JAX: an f32-accumulated dot)
        logits = F.linear(x.float(), router.weight.float())
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, probs, weights, experts


def _dropless(x, weights, experts, n_experts, grouped):
    """Every assignment computed: sorted by expert (stable), ``grouped(rows, sizes)`` runs the experts on the rows
    grouped by expert (locally, or through :meth:`ExpertParallel.grouped`)."""
    t, k = experts.shape
    flat = experts.reshape(t * k)
    order = torch.sort(flat, stable=True).indices  # [T*k] assignments grouped by expert
    sizes = torch.bincount(flat, minlength=n_experts)  # [E]
    ys = grouped(x[order // k], sizes)  # [T*k, dim]
    y = torch.zeros_like(ys).index_copy(0, order, ys).view(t, k, -1)  # back in (token, choice) order (out of
    # place: selective checkpointing refuses an in-place write to a tensor it may have cached)
    return torch.einsum("tkd,tk->td", y.float(), weights).to(x.dtype), sizes


def _with_capacity(x, weights, experts, n_experts, capacity, buffers):
    b, s, k = experts.shape
    flat = experts.reshape(b, s * k)  # [B, S*k], token-major
    with torch.no_grad():  # integer bookkeeping (out of selective checkpointing's cache: one_hot writes in place)
        onehot = F.one_hot(flat, n_experts)  # [B, S*k, E]
        pos = (onehot.cumsum(1) * onehot).sum(-1) - 1  # [B, S*k] place in its expert's queue
        keep = pos < capacity
        slot = torch.where(keep, flat * capacity + pos, n_experts * capacity)  # dropped -> a spare slot
        kept = (onehot * keep[..., None]).sum((0, 1))  # [E]
    rows = torch.arange(b, device=x.device)[:, None]
    xr = x[:, :, None, :].expand(b, s, k, x.shape[-1]).reshape(b, s * k, -1)  # [B, S*k, dim]
    buf = x.new_zeros(b, n_experts * capacity + 1, x.shape[-1]).index_put((rows, slot), xr)
    ys = buffers(buf[:, :-1].reshape(b, n_experts, capacity, -1))  # [B, E, C, dim]
    ys = torch.cat([ys.reshape(b, n_experts * capacity, -1), ys.new_zeros(b, 1, ys.shape[-1])], dim=1)
    y = ys[rows, slot].view(b, s, k, -1)  # [B, S, k, dim]; dropped read the zero slot
    w = torch.where(keep.view(b, s, k), weights.view(b, s, k), 0.0)
    return torch.einsum("bskd,bsk->bsd", y.float(), w).to(x.dtype), kept


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (an expert's gradient summed over every rank's tokens)."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


@dataclasses.dataclass
class ExpertParallel:
    """A block's expert parallelism (set by ``torchref.parallel``): the ``group`` of ``size`` ranks over which the
    experts are split (rank r holds experts ``[r * E / size, (r + 1) * E / size)``, the stacked parameters DTensors
    sharded on dim 0); ``grad_scale``: each rank's loss counts its rows ``dp`` times (the global-mean denominator
    divided by the data-parallel size), so the local experts' gradients, summed over every rank's tokens by the
    all-to-all's backward, are scaled by ``1 / dp``."""

    group: Any
    size: int
    grad_scale: float

    def weights(self, experts: Experts, dtype):
        return [_ScaleGrad.apply(w, self.grad_scale) for w in experts.weights(dtype)]

    def grouped(self, experts: Experts):
        """Dropless: rows grouped by expert (``sizes [E]``) go to their experts' ranks by ``all_to_all_single``
        (exact split sizes: a host sync each), regrouped there by local expert, computed, and sent back."""
        from torch.distributed.nn.functional import all_to_all_single

        def run(rows, sizes):
            n, e_local = self.size, sizes.numel() // self.size
            per_rank = sizes.view(n, e_local)
            counts = torch.empty_like(per_rank)
            dist.all_to_all_single(counts, per_rank.contiguous(), group=self.group)  # [n sources, E/n]
            send, recv = per_rank.sum(1).tolist(), counts.sum(1).tolist()
            got = all_to_all_single(rows.new_empty(sum(recv), rows.shape[1]), rows, recv, send, group=self.group)
            local = torch.arange(e_local, device=rows.device).repeat(n).repeat_interleave(counts.reshape(-1))
            order = torch.sort(local, stable=True).indices  # by local expert, then source
            ys = experts(got[order], lambda a, w: grouped_mm(a, w, counts.sum(0)), self)
            ys = torch.zeros_like(ys).index_copy(0, order, ys)
            return all_to_all_single(rows.new_empty(rows.shape[0], ys.shape[1]), ys, send, recv, group=self.group)

        return run

    def buffers(self, experts: Experts):
        """With a capacity: the ``[B, E, C, dim]`` buffers split over experts, one equal-split all-to-all to their
        owners and one back (GShard)."""
        from torch.distributed.nn.functional import all_to_all_single

        def run(buf):
            b, e, c, d = buf.shape
            n = self.size
            send = buf.transpose(0, 1).reshape(n, e // n, b * c, d).contiguous()
            got = all_to_all_single(torch.empty_like(send), send, group=self.group)  # [n sources, E/n, B*C, dim]
            local = got.transpose(0, 1).reshape(e // n, n * b * c, d)
            ys = experts(local, lambda a, w: torch.einsum("ecd,edf->ecf", a, w), self)  # [E/n, n*B*C, dim]
            ys = ys.reshape(e // n, n, b * c, d).transpose(0, 1).contiguous()
            back = all_to_all_single(torch.empty_like(ys), ys, group=self.group)  # [n owners, E/n, B*C, dim]
            return back.reshape(e, b, c, d).transpose(0, 1)

        return run


class MoEBlock(nn.Module):
    """The sparse MLP (HF's ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` names: ``gate``, ``experts``):
    ``block(x [B, S, dim], mask=None) -> (y [B, S, dim], stats)``; ``mask [B, S]`` bool marks the real tokens the
    balance and z statistics count (padding is still routed)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.ep: ExpertParallel | None = None  # set by torchref.parallel (expert parallelism)
        self.stats_group = None  # set by torchref.parallel: the router statistics are summed over these ranks

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        cfg = self.cfg
        b, s, d = x.shape
        e, k = cfg.n_experts, cfg.experts_per_token
        logits, probs, weights, experts = route(x.reshape(b * s, d), self.gate, cfg)  # [T, E], [T, k]
        capacity = cfg.expert_capacity(s)
        mlp, ep = self.experts, self.ep
        if capacity is None:
            grouped = ep.grouped(mlp) if ep else lambda rows, sizes: mlp(rows, lambda a, w: grouped_mm(a, w, sizes))
            y, kept = _dropless(x.reshape(b * s, d), weights, experts, e, grouped)
            y = y.view(b, s, d)
        else:
            buffers = ep.buffers(mlp) if ep else lambda buf: mlp(buf, lambda a, w: torch.einsum("becd,edf->becf", a, w))
            y, kept = _with_capacity(x, weights.view(b, s, k), experts.view(b, s, k), e, capacity, buffers)
        m = x.new_ones(b * s, dtype=torch.float32) if mask is None else mask.reshape(b * s).float()
        # top-k assignments of real tokens per expert (no gradient, as in transformers)
        counts = m.new_zeros(e).index_add(0, experts.reshape(-1), m.repeat_interleave(k))  # [E]
        lse = torch.logsumexp(logits, dim=-1)  # [T]
        stats = {
            "counts": counts,
            "probs": (probs * m[:, None]).sum(0),  # not m @ probs: its mm output is squeezed in place, which
            # selective checkpointing (the save_dots remat policy caches mm outputs) refuses
            "z": (m * lse * lse).sum(),
            "tokens": m.sum(),
            "kept": kept,
            "routed": torch.tensor(b * s * k, device=x.device),
        }
        if self.stats_group is not None:  # data / expert parallel: the whole batch's sums, as one process has
            stats = _all_reduce(stats, self.stats_group)
        return y, stats


def _all_reduce(stats: dict, group) -> dict:
    """The sums over ``group``'s ranks: differentiable (``torch.distributed.nn``) where the loss takes gradients."""
    from torch.distributed.nn.functional import all_reduce

    out = {}
    for key, v in stats.items():
        if v.requires_grad:
            out[key] = all_reduce(v, group=group)
        else:
            out[key] = v.clone()
            dist.all_reduce(out[key], group=group)
    return out


def moe_losses(stats: list[dict], cfg) -> dict:
    """Each layer's ``stats`` -> ``aux_loss`` (transformers' load-balancing loss, NOT multiplied by
    ``router_aux_loss_coef``), ``z_loss`` (unweighted), ``tokens_per_expert [L, E]`` and ``dropped_fraction``."""
    stacked = {key: torch.stack([st[key] for st in stats]) for key in STAT_KEYS}
    n = stacked["tokens"].sum().clamp(min=1.0)
    f = stacked["counts"].sum(0) / n
    share = stacked["probs"].sum(0) / n
    return {
        "aux_loss": cfg.n_experts * (f * share).sum(),
        "z_loss": stacked["z"].sum() / n,
        "tokens_per_expert": stacked["kept"],
        "dropped_fraction": 1.0 - stacked["kept"].sum().float() / stacked["routed"].sum().float(),
    }
