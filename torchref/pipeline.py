"""Pipeline parallelism for the torch Llama through ``torch.distributed.pipelining`` (torchtitan's way; the twin of
``jaxattn.pipeline``): the decoder layers split into contiguous stages, the embedding on the first and the final
norm + LM head + loss on the last, micro-batches scheduled by the library (GPipe, 1F1B, interleaved 1F1B). Run under
``torchrun``, one rank per stage (two per rank for ``interleaved``):

    dist.init_process_group("gloo")
    pipe = Pipeline(model, "1f1b", microbatches=4)     # this rank's stage(s) of ``model``, and their schedule
    loss = pipe.step(batch)                             # forward + backward of the whole batch; grads on the stage
                                                        # (the loss on the last stage's rank, None elsewhere)

Nothing is written by hand but the split (:class:`StageModule`) and the loss scaling: each micro-batch's loss is its
summed token losses over the WHOLE batch's token count, so the micro-batches' gradients add up to the full batch's
mean (the library backpropagates each micro-batch's loss); an MoE's micro-batch adds its own router terms, weighted
1/m, from router sums its stages hand on with the hidden states. Idle fraction ``(p - 1) / (m + p - 1)`` (GPipe
and 1F1B; interleaving divides it by the virtual stages per rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twincore.loss import DEFAULT_CHUNK, check_loss
from twincore.pipeline import SCHEDULES, check_pipeline, virtual_stages
from twincore.remat import check_remat
from twincore.runlog import MOE_KEYS

from . import parallel
from .fused_ce import fused_cross_entropy
from .model import LlamaForCausalLM, rope_cos_sin
from .remat import run_layer

__all__ = ["SCHEDULES", "StageModule", "Pipeline", "check_pipeline", "make_pipeline_step", "rank_stages"]

PIPELINE_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")  # the batch keys Pipeline.step takes


class StageModule(nn.Module):
    """Stage ``index`` of ``n_stages`` of ``model``: its share of the decoder layers (the model's own modules, so
    the stage trains the model's parameters), with the embedding on stage 0 and the final norm + LM head on the
    last. Input: token ids ``[b, S]`` (stage 0) or hidden states ``[b, S, dim]``, and for packed rows
    ``segment_ids`` / ``positions [b, S]`` (every stage gets them from the schedule's kwargs: RoPE is recomputed and
    attention masked per stage; positions default to ``0..S-1``); output: hidden states, or float32 logits
    ``[b, S, vocab]`` on the last stage. With ``fused`` set (``(chunk, dtype)``, :class:`Pipeline`'s ``loss="fused"``)
    the last stage returns the summed token losses of its micro-batch instead (``torchref.fused_ce``: the head and the
    cross-entropy in chunks, never the logits), from the ``targets`` / ``weights [b, S]`` kwargs. An MoE stage also
    takes (after stage 0) and returns the micro-batch's router sums ``[n_layers, 3E + 3]`` (:func:`_stats_row` per
    layer; the earlier stages' rows, its own, zeros after): the last stage's loss reads the whole model's."""

    def __init__(self, model: LlamaForCausalLM, index: int, n_stages: int):
        super().__init__()
        cfg = model.config
        if cfg.tie_embeddings and n_stages > 1:
            raise ValueError(
                "tie_embeddings: a pipeline puts the embedding on the first stage and the LM head on the last, so a "
                "tied table would be two copies; use an untied config"
            )
        self.config = cfg  # the tensor-parallel plan reads it (torchref.parallel.apply_tp)
        self.first, self.last = index == 0, index == n_stages - 1
        self.layer_ids = stage_layers(cfg.n_layers, index, n_stages)
        self.layers = nn.ModuleList(model.model.layers[i] for i in self.layer_ids)
        self.embed_tokens = model.model.embed_tokens if self.first else None
        self.norm = model.model.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None
        self.register_buffer("inv_freq", model.model.inv_freq.clone(), persistent=False)
        self.remat = check_remat(model.remat, "model.remat")
        self.fused: tuple[int, torch.dtype] | None = None

    def forward(self, x: torch.Tensor, *router, segment_ids=None, positions=None, targets=None, weights=None):
        b, s = x.shape[:2]
        if positions is None:
            positions = torch.arange(s, device=x.device).expand(b, s)
        cos, sin = rope_cos_sin(self.inv_freq, positions)  # [b, 1, S, head_dim]
        if self.first:
            x = self.embed_tokens(x)  # [b, S, dim]
        moe = self.config.is_moe
        mask = None if segment_ids is None or not moe else segment_ids != 0  # as the train step: padding not routed
        rows = []  # an MoE's router sums of this stage's layers for the micro-batch, one [3E + 3] row each
        for layer in self.layers:
            x = run_layer(layer, self.remat, x, cos, sin, segment_ids, None, mask)  # a dense layer ignores mask
            if moe:
                x, st = x
                rows.append(_stats_row(st))
        out = self._head(x, targets, weights) if self.last else x
        if not moe:
            return out
        # the micro-batch's router sums so far, one row per layer [n_layers, 3E + 3]: the earlier stages' rows,
        # then this stage's (the layers after it are still zeros); the loss reads them on the last stage
        before = router[0] if router else x.new_zeros(self.config.n_layers, rows[0].numel(), dtype=torch.float32)
        lo, hi = self.layer_ids.start, self.layer_ids.stop
        return out, torch.cat([before[:lo], torch.stack(rows), before[hi:]])

    def _head(self, x: torch.Tensor, targets, weights) -> torch.Tensor:
        if self.fused is not None:  # as the train step's fused loss: outside autocast, in `dtype`
            chunk, dtype = self.fused
            hidden = self.norm(x).flatten(0, 1)  # [b * S, dim]
            with torch.autocast(x.device.type, enabled=False):
                return fused_cross_entropy(
                    hidden, self.lm_head.weight, targets.flatten(), weights.flatten(), 1.0, chunk=chunk, dtype=dtype
                ).reshape(1)  # the micro-batch's summed token losses, [1]: the library concatenates outputs
        return self.lm_head(self.norm(x)).float()  # [b, S, vocab]


class Pipeline:
    """This rank's stage(s) of ``model`` under ``schedule`` (:data:`SCHEDULES`) with ``microbatches``; one stage
    per pipeline rank (``interleaved``: ``virtual`` stages per rank, rank r holding stages r, r + p, ...). Needs an
    initialised process group; ``step(batch)`` runs the whole batch (``{"tokens": [B, S + 1]}``) forward and
    backward and returns the loss on the last stage's rank (None elsewhere). ``mesh``: a 2-D ``DeviceMesh``
    ``("pp", "dp_shard" | "tp")`` whose second dimension shards each stage (``shard``: ``"fsdp"`` — FSDP2 over
    that dimension — or ``"tp"``, applied to the stage modules before the library wraps them, torchtitan's order);
    None: every rank is one pipeline rank. ``gather_once`` (fsdp): FSDP2 keeps each layer's gathered weights from
    its forward to the step's end (``reshard_after_forward=False``, torchtitan's setting under pipelining) instead
    of regathering them for every micro-batch. ``loss``: ``"dense"`` (the last stage's logits, then the
    cross-entropy) or ``"fused"`` (``torchref.fused_ce`` in the last stage, chunks of ``loss_chunk`` tokens, the head
    in ``loss_dtype``; not with ``shard="tp"``, whose head is split over the vocabulary). ``compile``: each stage
    module ``torch.compile``d in place (after its sharding, as the trainer compiles a whole FSDP2 model), so the
    library's schedule runs compiled forwards and backwards."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        schedule: str,
        microbatches: int,
        *,
        virtual: int | None = None,
        device=None,
        mesh=None,
        shard: str | None = None,
        gather_once: bool = False,
        loss: str = "dense",
        loss_chunk: int = DEFAULT_CHUNK,
        loss_dtype: torch.dtype | None = None,
        compile: bool = False,
    ):
        from torch.distributed import pipelining as pp

        check_loss(loss, loss_chunk)
        if loss == "fused" and shard == "tp":
            raise ValueError(
                "loss='fused' with shard='tp': the last stage's LM head is split over the vocabulary, and the fused "
                "loss is not the vocabulary-parallel cross-entropy; use loss='dense'"
            )

        if model.config.is_moe and shard == "tp":
            raise ValueError(
                "shard='tp' with a Mixture-of-Experts model: torchref has no tensor-parallel plan for stacked experts; "
                "use shard='fsdp' or none"
            )
        if not dist.is_initialized():
            raise RuntimeError("torchref.pipeline needs torch.distributed initialised (run under torchrun)")
        if (mesh is None) != (shard is None) or shard not in (None, "fsdp", "tp"):
            raise ValueError(f"shard={shard!r} needs a 2-D mesh ('pp', ...) and is one of 'fsdp', 'tp'")
        group = None if mesh is None else mesh["pp"].get_group()
        rank = dist.get_rank() if mesh is None else mesh["pp"].get_local_rank()
        world = dist.get_world_size() if mesh is None else mesh["pp"].size()
        per_rank = virtual_stages(schedule, virtual)
        n_stages = world * per_rank
        check_pipeline(model.config.n_layers, world, microbatches, microbatches, schedule, per_rank)
        device = device or torch.device("cpu")
        self.indices = rank_stages(rank, world, per_rank)
        self.n_stages, self.pp_size, self.mesh, self.shard = n_stages, world, mesh, shard
        self.modules = [StageModule(model, i, n_stages) for i in self.indices]
        self.fused = loss == "fused"
        for m in self.modules if self.fused else ():
            m.fused = (loss_chunk, loss_dtype)
        for m in self.modules if shard is not None else ():
            _shard_stage(m, shard, mesh[mesh.mesh_dim_names[1]], gather_once)
        for m in self.modules if compile else ():
            m.compile()
        stages = [pp.PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(self.modules, self.indices)]
        self.first = 0 in self.indices
        self.last = n_stages - 1 in self.indices
        self.microbatches = microbatches
        self._denominator, self.loss_scale = 1.0, 1.0
        self.config = model.config
        # an MoE's router terms: each micro-batch's, weighted moe_scale / microbatches (make_pipeline_step sets
        # 1 / grad_accum), as one process weighs its accumulation blocks'; their metrics, one dict per micro-batch
        self.moe_scale, self.moe_metrics, self._pending = 1.0, [], []
        cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B}[schedule]
        # scale_grads=False: the library would divide the gradients by the micro-batch count (it assumes each
        # micro-batch's loss is that micro-batch's mean); ours are already fractions of the whole batch's mean
        self.schedule = cls(
            stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False
        )

    @property
    def dp(self) -> int:
        """Ranks that see different rows: the FSDP dimension of ``pp+fsdp``, else 1."""
        return self.mesh["dp_shard"].size() if self.shard == "fsdp" else 1

    def rows(self, batch: dict, blocks: int = 1) -> dict:
        """This rank's rows of a host batch: a share per FSDP rank (``pp+fsdp``; of each of ``blocks`` accumulation
        blocks, ``torchref.parallel.row_block``), all of them otherwise."""
        if self.dp == 1:
            return batch
        rank = self.mesh["dp_shard"].get_local_rank()
        return parallel.row_block(batch, self.dp, rank, f"the {self.dp} FSDP ranks of each stage", blocks)

    def _loss(self, out, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss from the last stage's ``out``: its logits (dense), or its summed token losses
        (fused), over the whole batch's target count; an MoE's ``(out, router sums [n_layers, 3E + 3])`` adds
        the micro-batch's router terms (``torchref.moe.moe_losses`` of its own sums, as a one-process
        accumulation block's)."""
        from .moe import moe_losses
        from .train_step import moe_metrics

        router = None
        if isinstance(out, tuple):
            out, router = out
        if self.fused:
            nll = out.sum()
        else:
            nll = F.cross_entropy(out.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)
        # the whole batch's token count: micro-batch losses add up to its mean (times the loss scale under fp16)
        loss = nll / self._denominator
        if router is not None:
            cfg, moe = self.config, moe_losses(_stats_of(router), self.config)
            terms = cfg.router_aux_loss_coef * moe["aux_loss"] + cfg.router_z_loss_coef * moe["z_loss"]
            loss = (loss + self.moe_scale / self.microbatches * terms) * self.loss_scale
            # kept with its loss: the library also calls this once on placeholder outputs (shape inference)
            self._pending.append((loss, {k: v.detach() for k, v in moe_metrics(moe, cfg).items()}))
            return loss
        return loss * self.loss_scale

    def step(self, batch: dict, denominator: float | None = None) -> float | None:
        """``batch``: ``{"tokens": [B, S + 1], "loss_mask"?, "segment_ids"?, "positions"?}``; the targets are the
        train step's (``torchref.train_step.loss_weights``: a target whose ``loss_mask`` is 0, or the first token of
        a packed document, adds nothing) and the mean is over the counted ones. Packed rows' ``segment_ids`` and
        ``positions`` go to every stage as the schedule's kwargs, split into the micro-batches with the tokens.
        Micro-batch j is rows ``j, j + m, j + 2m, ...`` (JAX's twin splits a row-sharded batch that way): an MoE's
        router terms, each micro-batch's own, then equal ``jaxattn.pipeline``'s."""
        from .train_step import loss_weights

        extra = sorted(k for k in batch if k not in PIPELINE_KEYS and batch[k] is not None)
        if extra:
            raise ValueError(f"batch: Pipeline.step takes {list(PIPELINE_KEYS)}, not {extra}")
        rows, m = batch["tokens"].shape[0], self.microbatches
        check_pipeline(1, 1, rows, m)
        order = torch.arange(rows, device=batch["tokens"].device).reshape(rows // m, m).T.flatten()  # library: blocks
        batch = {k: None if v is None else v[order] for k, v in batch.items()}
        tokens = batch["tokens"]
        # contiguous: torch 2.11's stages check each micro-batch's strides against the first one's ([B, S+1] sliced
        # to [B, S] has stride S+1: "stride mismatch: expected (16, 1) actual (17, 1)")
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].long()  # cross_entropy takes int64 targets
        weights = loss_weights(batch)  # [B, S]: an ignored target (masked, or a document's first token) weighs 0
        packed = {k: batch[k][:, :-1].contiguous() for k in ("segment_ids", "positions") if batch.get(k) is not None}
        if self.fused:  # the last stage computes the loss: its targets and their weights, split with the tokens
            packed.update(targets=targets.contiguous(), weights=weights)
        targets = torch.where(weights > 0, targets, torch.full_like(targets, -100))  # cross_entropy's ignore_index
        # pp+fsdp: each rank's loss is over the whole batch's count / dp, and FSDP averages the gradients over dp
        count = float((targets != -100).sum()) if denominator is None else denominator
        self._denominator = max(count, 1.0)
        losses: list = []
        if self.first and self.last:  # interleaved on one rank: both ends here
            self.schedule.step(inputs, target=targets, losses=losses, **packed)
        elif self.first:
            self.schedule.step(inputs, **packed)
        elif self.last:
            self.schedule.step(target=targets, losses=losses, **packed)
        else:
            self.schedule.step(**packed)
        self.moe_metrics += [m for loss, m in self._pending if any(loss is x for x in losses)]  # the real ones
        self._pending = []
        return float(sum(loss.item() for loss in losses)) if self.last else None

    def parameters(self):
        """The parameters this rank's stages train (give these to the optimizer)."""
        seen = {}
        for m in self.modules:
            for p in m.parameters():
                seen[id(p)] = p
        return list(seen.values())

    def _owner(self, model: nn.Module) -> dict:
        """Parameter name -> the global rank that sends it: the first rank of the pipeline rank holding its stage."""
        owner = {}
        for r in range(self.pp_size):
            src = r if self.mesh is None else int(self.mesh.mesh[r].flatten()[0])
            for i in rank_stages(r, self.pp_size, self.n_stages // self.pp_size):
                owner.update({n: src for n in _stage_names(model, i, self.n_stages)})
        return owner

    def sync_model(self, target: nn.Module, model: nn.Module | None = None) -> None:
        """``target`` (a plain model, on every rank) gets every stage's current weights: each stage's parameters
        gathered whole on its ranks (``full_tensor()`` of a sharded stage) and broadcast by its first rank; for an
        evaluation or an export of the whole model. ``model``: the one the stages were cut from (default
        ``target``: plain ``pp``, where the stages share the model's parameters)."""
        model = target if model is None else model
        owner, live = self._owner(model), dict(model.named_parameters())
        for n, p in target.named_parameters():
            if n not in owner:
                continue
            q = live[n].detach()
            full = q.full_tensor() if hasattr(q, "full_tensor") else q  # the stage's peers gather it together
            buf = full.clone() if dist.get_rank() == owner[n] else torch.empty_like(p.data)
            dist.broadcast(buf, src=owner[n])
            p.data.copy_(buf)

    def optimizer_state(self, model: nn.Module, optimizer) -> dict:
        """``{"state": {name: {...}}, "param_groups": [...]}`` of every stage's parameters on every rank (whole
        tensors, CPU): torch's full optimizer state dict layout, keyed by ``model``'s parameter names (a sharded
        stage's state gathered whole on its ranks, sent by its first rank)."""
        owner, mine, names = self._owner(model), {}, {id(p): n for n, p in model.named_parameters()}
        stage = self._names(model)
        for n, p in model.named_parameters():
            if n not in stage or p not in optimizer.state:
                continue
            full = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                if torch.is_tensor(v)
                else v
                for k, v in optimizer.state[p].items()
            }
            if owner[n] == dist.get_rank():
                mine[n] = full
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        return {"state": {k: v for part in parts for k, v in part.items()}, "param_groups": groups}

    def _names(self, model: nn.Module) -> set:
        return {n for i in self.indices for n in _stage_names(model, i, self.n_stages)}

    def grad_norm_and_clip(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm over all stages' parameters (each rank's squares summed over the ranks; a
        replicated shard counted once); with ``max_norm``, every stage's gradients scaled by
        ``min(1, max_norm / norm)``, as ``clip_grad_norm_`` would."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32)
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g
            copies = 1
            for dim, placement in enumerate(getattr(g, "placements", ())):
                copies *= g.device_mesh.size(dim) if placement.is_replicate() else 1
            sq = sq + local.detach().float().pow(2).sum().cpu() / copies
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        norm = sq.sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                local = g.to_local() if hasattr(g, "to_local") else g
                local.mul_(coef.to(local.dtype))
        return norm

    def broadcast_loss(self, loss: float | None) -> float:
        """The whole batch's loss on every rank: the mean of the last stage's ranks' losses (FSDP ranks hold
        fractions of the whole batch's mean, tensor-parallel ranks the same one)."""
        t = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / (dist.get_world_size() // self.pp_size)

    def broadcast_moe(self) -> dict:
        """An MoE's router metrics of the step on every rank (``{}`` for a dense model): each the mean over the
        micro-batches the last stage saw since :func:`make_pipeline_step` began the step (its ranks hold the same
        values: their router sums are all-reduced over the FSDP ranks)."""
        if not self.config.is_moe:
            return {}
        t = torch.zeros(len(MOE_KEYS), dtype=torch.float64)
        if self.last and self.moe_metrics:
            t = torch.tensor([[float(m[k]) for k in MOE_KEYS] for m in self.moe_metrics], dtype=torch.float64)
            t = t.mean(0)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t / (dist.get_world_size() // self.pp_size)
        return {k: v.float() for k, v in zip(MOE_KEYS, t)}


def _shard_stage(stage: StageModule, shard: str, mesh, gather_once: bool = False) -> None:
    """``shard`` (``"fsdp"``: FSDP2 per layer and over the stage, fp32 gradient reduction, as ``--parallel
    fsdp``; ``"tp"``: ``torchref.parallel``'s tensor-parallel plan on the stage's layers and its ends) over the
    1-D ``mesh``."""
    if shard == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = dict(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32), reshard_after_forward=not gather_once)
        parallel.apply_ep(stage, mesh, mesh.size(), split=False)  # an MoE: router sums over the FSDP ranks' rows
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(stage, mesh=mesh, **kw)
    else:
        parallel.apply_tp(stage, mesh, stage.layers, prefix="model.")


def rank_stages(rank: int, ranks: int, per_rank: int) -> list[int]:
    """The stages pipeline rank ``rank`` of ``ranks`` holds: ``rank, rank + ranks, ...`` (``per_rank`` of them; round
    robin, so stage ``i + 1`` is always on the next rank, as the library's interleaved schedule sends it)."""
    return [rank + k * ranks for k in range(per_rank)]


def stage_layers(n_layers: int, index: int, n_stages: int) -> range:
    """The decoder layers of stage ``index`` of ``n_stages``: a contiguous, equal share, in order."""
    per = n_layers // n_stages
    return range(index * per, (index + 1) * per)


def _stage_names(model: nn.Module, index: int, n_stages: int) -> set:
    """The parameter names of stage ``index`` (the split :class:`StageModule` makes)."""
    names = {f"model.layers.{j}." for j in stage_layers(model.config.n_layers, index, n_stages)}
    out = {n for n, _ in model.named_parameters() if any(n.startswith(prefix) for prefix in names)}
    if index == 0:
        out |= {n for n, _ in model.named_parameters() if n.startswith("model.embed_tokens.")}
    if index == n_stages - 1:
        out |= {n for n, _ in model.named_parameters() if n.startswith(("model.norm.", "lm_head."))}
    return out


def make_pipeline_step(
    pipe: Pipeline, optimizer, *, max_grad_norm: float | None = None, autocast=None, scaler=None, grad_accum: int = 1
):
    """``step(batch, denominator=None) -> metrics`` for the pipeline modes: the schedule's forward and backward of
    the batch (``grad_accum`` row blocks one after another, the gradients adding up; inside ``autocast()``, the
    precision policy's context, when given), the global gradient norm (clipped with ``max_grad_norm``), the
    optimizer step; metrics as ``torchref.train_step.make_train_step``'s (``loss`` the whole batch's, on every
    rank). ``scaler`` (fp16): a ``ShardedGradScaler`` over all ranks — the schedule's losses are scaled, the
    gradients unscaled before the norm, and a non-finite gradient on any rank skips the step on every rank."""
    import contextlib

    from .train_step import loss_denominator

    scaling = scaler is not None and scaler.is_enabled()

    def step(batch: dict, denominator=None) -> dict:
        optimizer.zero_grad(set_to_none=True)
        rows = batch["tokens"].shape[0]
        if rows % grad_accum:
            raise ValueError(f"batch: {rows} rows do not split into grad_accum={grad_accum} blocks")
        if denominator is None:  # the whole batch's targets: the blocks' losses add up to its mean
            denominator = float(loss_denominator({k: v for k, v in batch.items() if v is not None}))
        # scaler.scale(1) sets the scaler up for this step (its scale lives on the first tensor it scales)
        pipe.loss_scale = loss_scale = float(scaler.scale(torch.ones(()))) if scaling else 1.0
        pipe.moe_scale, pipe.moe_metrics = 1.0 / grad_accum, []
        total, b = 0.0, rows // grad_accum
        for i in range(grad_accum):
            block = {k: v if v is None else v[i * b : (i + 1) * b] for k, v in batch.items()}
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = pipe.step(block, float(denominator))
            total += loss or 0.0
        loss = pipe.broadcast_loss(total if pipe.last else None) / loss_scale
        if scaling:
            scaler.unscale_(optimizer)  # all ranks agree on a non-finite gradient (ShardedGradScaler's all-reduce)
        norm = pipe.grad_norm_and_clip(max_grad_norm)
        skipped = False
        if scaling:
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < loss_scale  # the scale shrinks exactly on a skipped step
        else:
            optimizer.step()
        return {
            "loss": torch.tensor(loss),
            "grad_norm": norm,
            "loss_scale": torch.tensor(loss_scale, dtype=torch.float32),
            "skipped": torch.tensor(skipped),
            **pipe.broadcast_moe(),  # an MoE's router metrics (mean over micro-batches), as make_train_step's
        }

    return step


def _stats_row(st: dict) -> torch.Tensor:
    """One layer's router sums (``torchref.moe.MoEBlock``'s ``stats``) as one float32 row ``[3E + 3]``: counts,
    probs, kept, then z, tokens, routed (every count is exact in float32 below 2^24)."""
    return torch.cat(
        [st[k].float() for k in ("counts", "probs", "kept")] + [st[k].float().reshape(1) for k in _SCALARS]
    )


def _stats_of(rows: torch.Tensor) -> list[dict]:
    """:func:`_stats_row`'s rows ``[n_layers, 3E + 3]`` back into the per-layer stats ``moe_losses`` takes."""
    e = (rows.shape[-1] - len(_SCALARS)) // 3
    return [
        {"counts": r[:e], "probs": r[e : 2 * e], "kept": r[2 * e : 3 * e], **dict(zip(_SCALARS, r[3 * e :]))}
        for r in rows
    ]


_SCALARS = ("z", "tokens", "routed")
