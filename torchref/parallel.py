"""DDP, FSDP2 and Megatron tensor parallelism for the torch Llama, applied from OUTSIDE the model (torchtitan's
``parallelize.py``; the twin of ``jaxattn.sharding``). Run under ``torchrun``:

    dist.init_process_group("gloo")                              # "nccl" on GPUs
    mesh = build_mesh("fsdp", tp=1)                              # or "tp", "ddp", "fsdp+tp" (2-D: dp x tp)
    model = parallelize(LlamaForCausalLM(cfg), "fsdp", mesh)     # before building the optimizer
    rows = local_rows(batch, "fsdp", mesh)                      # each data-parallel rank its rows

One visible order, as in torchtitan: (1) tensor parallel on the ``tp`` mesh dimension — ``parallelize_module``
with the plan :func:`tp_plan` reads off the parameter table's logical axes (column-parallel q/k/v/gate/up, row-parallel
o/down, the embedding and the LM head split by vocab with replicated activations), each attention module's head
counts divided by ``tp`` (torchtitan's ``attn.n_heads //= tp``); (2) FSDP2: ``fully_shard`` on every decoder layer,
then on the root, with a ``MixedPrecisionPolicy``, on the ``dp`` mesh dimension; or (3) DDP. The data-parallel
ranks each get ``batch / dp`` rows, their share of every accumulation block (:func:`local_rows`); TP ranks see the
same rows.

Under ``fsdp+tp`` FSDP2 warns that the root "returned a view tensor ... can produce wrong gradients": the logits are
the tensor-parallel LM head's gathered output, a view. The hazard it names is an in-place op on that view (which
would skip FSDP's pre-backward hook); the loss (``train_step``) only reads the logits, so the gradients are right —
``parity_tests/test_parallel.py`` checks ``fsdp+tp`` losses step by step against one process and the JAX twin — and
:func:`parallelize` silences that one warning (by its text) where it applies. Code that adds an in-place op on the
logits must ``.clone()`` them first.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch import nn

from twincore import params

__all__ = [
    "MODES",
    "EP_MODES",
    "apply_ep",
    "build_mesh",
    "parallelize",
    "local_rows",
    "row_block",
    "dp_size",
    "tp_plan",
    "apply_tp",
]

MODES = ("ddp", "fsdp", "tp", "fsdp+tp", "ep", "ep+fsdp")
EP_MODES = ("ep", "ep+fsdp")  # expert parallelism (a Mixture-of-Experts model): experts split over the ranks


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"parallel mode {mode!r} is not known; use one of {MODES}")


def build_mesh(mode: str, tp: int | None = None, device_type: str | None = None):
    """A ``DeviceMesh`` over all ranks: 1-D ``("dp",)`` for ddp/fsdp, ``("tp",)`` for tp, ``("dp", "tp")`` for
    fsdp+tp (``tp`` ranks per tensor-parallel group, default 2). Needs an initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    _check_mode(mode)
    if not dist.is_initialized():
        raise RuntimeError(
            "torchref.parallel needs torch.distributed initialised (run under torchrun and call "
            "dist.init_process_group first)"
        )
    world = dist.get_world_size()
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if mode == "fsdp+tp":
        tp = 2 if tp is None else tp
        if tp < 1 or world % tp:
            raise ValueError(f"tp={tp} must divide the world size {world} for mode 'fsdp+tp'")
        return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("tp",) if mode == "tp" else ("dp",))


def dp_size(mode: str, mesh) -> int:
    """Number of data-parallel ranks (ranks that see different rows)."""
    return 1 if mode == "tp" else mesh["dp"].size() if mode == "fsdp+tp" else mesh.size()  # ep: every rank


def local_rows(batch: dict, mode: str, mesh, blocks: int = 1) -> dict:
    """This rank's rows of a global batch (rank order; :func:`row_block`'s ``blocks``: the step's accumulation
    blocks); ValueError if they do not divide."""
    n = dp_size(mode, mesh)
    rank = 0 if n == 1 else (mesh["dp"].get_local_rank() if mode == "fsdp+tp" else mesh.get_local_rank())
    return row_block(batch, n, rank, f"the {n} data-parallel ranks ({mode})", blocks)


def row_block(batch: dict, n: int, rank: int, ranks: str, blocks: int = 1) -> dict:
    """Share ``rank`` of ``n`` of every array in ``batch`` (None kept): of each of ``blocks`` consecutive row blocks
    (a step's accumulation blocks) its ``rank``-th consecutive part, so the ranks' block j together is the batch's
    block j, as one process accumulates it (an MoE's router terms are per block); ValueError naming ``ranks`` (who
    shares the rows) when the rows do not divide."""
    b = batch["tokens"].shape[0]
    if b % (n * blocks):
        raise ValueError(
            f"batch size {b} is not divisible by {ranks}" + (f" times {blocks} blocks" if blocks > 1 else "")
        )
    m = b // (n * blocks)
    return {
        k: None if v is None else v.reshape(blocks, n, m, *v.shape[1:])[:, rank].reshape(blocks * m, *v.shape[1:])
        for k, v in batch.items()
    }


def _check_tp(cfg, tp: int) -> None:
    if cfg.is_moe:
        raise ValueError(
            "tensor parallelism of a Mixture-of-Experts model is not supported in torchref (its experts are stacked "
            "parameters, not nn.Linear modules a TP plan splits); use fsdp / ddp"
        )
    axes = {a for r in params.rows(cfg) for a in r.axes if a in params.TENSOR_PARALLEL_AXES}
    for field in (params.AXIS_FIELDS[a] for a in params.TENSOR_PARALLEL_AXES if a in axes):
        if getattr(cfg, field) % tp:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)} is not divisible by the tensor-parallel size tp={tp}"
            )


def tp_plan(cfg) -> tuple[dict, dict]:
    """``(model_plan, layer_plan)``: module path -> ``"colwise"`` / ``"rowwise"`` / ``None`` (replicated), read
    off the parameter table's logical axes (``twincore.params.tp_style``: the same axes JAX's ``tensor`` mesh
    axis splits). ``model_plan`` is under the model, ``layer_plan`` under each decoder layer."""
    plan: tuple[dict, dict] = ({}, {})
    for r in params.rows(cfg):
        plan[r.per_layer][r.module] = params.tp_style(r)
    return plan


def _apply_tp(model: nn.Module, tp_mesh) -> None:
    apply_tp(model, tp_mesh, model.model.layers)


def apply_tp(root: nn.Module, tp_mesh, layers, prefix: str = "") -> None:
    """The tensor-parallel plan (:func:`tp_plan`) on ``layers`` and on the model-level modules under ``root``
    (their plan paths less ``prefix``; one a pipeline stage does not hold is skipped)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg, tp = root.config, tp_mesh.size()
    _check_tp(cfg, tp)
    if cfg.tie_embeddings:
        raise ValueError(
            "tensor parallel with tie_embeddings=True is not supported (the embedding and the LM head "
            "are split on different dimensions)"
        )
    model_plan, layer_plan = tp_plan(cfg)
    model_plan = {m.removeprefix(prefix): st for m, st in model_plan.items() if _has(root, m.removeprefix(prefix))}
    # the embedding and the head take and give whole (replicated) activations; inside a layer Megatron's pairs
    # (column-parallel then row-parallel) keep the activations split between them
    outer = {
        "colwise": ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    inner = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    parallelize_module(root, tp_mesh, {m: outer[s] for m, s in model_plan.items() if s is not None})
    local = dataclasses.replace(
        cfg, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp, head_dim=cfg.resolved_head_dim
    )
    for layer in layers:
        parallelize_module(layer, tp_mesh, {m: inner[s] for m, s in layer_plan.items() if s is not None})
        layer.self_attn.cfg = local  # this rank's heads (torchtitan: attn.n_heads //= tp)
        for m in (m for m, s in layer_plan.items() if s is None):
            _replicate(layer.get_submodule(m), tp_mesh)
    for m in (m for m, s in model_plan.items() if s is None):
        _replicate(root.get_submodule(m), tp_mesh)


def _has(root: nn.Module, path: str) -> bool:
    try:
        return root.get_submodule(path) is not None
    except AttributeError:
        return False


def _replicate(module: nn.Module, mesh) -> None:
    """Parameters as replicated DTensors (so every parameter is a DTensor on the TP mesh: the grad-norm and the
    foreach optimizer need one kind), inputs wrapped as replicated DTensors, outputs back to local tensors. The
    activations around a norm are already identical on every TP rank (a row-parallel all-reduce before, a
    column-parallel input's all-reduce in the backward after), so its weight gradient is the full one."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(mod, args, mesh):
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()])
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(mod, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, input_fn=inputs, output_fn=outputs)


OFFLOAD_MODES = ("fsdp", "fsdp+tp")


def apply_ep(model: nn.Module, mesh, dp: int, split: bool) -> set:
    """An MoE model's blocks under data / expert parallelism: their router statistics summed over the ``dp``
    ranks (the load-balancing loss of the whole batch, as one process computes it); with ``split`` the stacked
    experts become DTensors sharded on dim 0 over ``mesh`` (rank r keeps ``E / ranks`` experts) and the blocks
    exchange tokens by all-to-all (``torchref.moe.ExpertParallel``). Returns the expert parameters (empty when
    not split) for FSDP / replicate to leave alone. A dense model is left as it is."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from .moe import ExpertParallel, MoEBlock

    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        if split:
            raise ValueError("--parallel ep / ep+fsdp splits a Mixture-of-Experts model's experts; this model is dense")
        return set()
    n = mesh.size()
    if split and model.config.n_experts % n:
        raise ValueError(
            f"ModelConfig.n_experts={model.config.n_experts} is not divisible by the {n} expert-parallel ranks"
        )
    group = mesh.get_group()
    out = set()
    for block in blocks:
        block.stats_group = group if dp > 1 else None
        if not split:
            continue
        for name in params.expert_weights():
            w = getattr(block.experts, name)
            setattr(block.experts, name, nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(0)])))
            out.add(getattr(block.experts, name))
        block.ep = ExpertParallel(group, n, 1.0 / dp)
    return out


def parallelize(
    model: nn.Module,
    mode: str,
    mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    offload: bool = False,
) -> nn.Module:
    """Apply ``mode`` (one of :data:`MODES`) to ``model`` in place over ``mesh`` (:func:`build_mesh`); returns
    the module to train (the DDP wrapper for ddp, ``model`` otherwise). Build the optimizer AFTER this.
    ``offload`` (fsdp modes): FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters, their gradients and so
    the optimizer state and step on the CPU (the twin of ``jaxattn.sharding``'s ``offload_optimizer``, which
    offloads only the optimizer state)."""
    _check_mode(mode)
    if offload and mode not in OFFLOAD_MODES:
        raise ValueError(f"offload=True needs an FSDP mode {OFFLOAD_MODES}, got mode {mode!r}")
    if mode in ("tp", "fsdp+tp"):
        _apply_tp(model, mesh["tp"] if mode == "fsdp+tp" else mesh)
    experts = apply_ep(model, mesh, dp_size(mode, mesh), mode in EP_MODES)
    if mode == "ep":  # the rest data-parallel: FSDP2's replicate (DDP semantics on DTensors, like the experts)
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for layer in model.model.layers:
            replicate(layer, mesh=mesh, ignored_params=experts)
        replicate(model, mesh=mesh, ignored_params=experts)
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=None if mesh.device_type == "cpu" else [torch.cuda.current_device()])
    if mode in ("fsdp", "fsdp+tp", "ep+fsdp"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        dp_mesh = mesh["dp"] if mode == "fsdp+tp" else mesh
        kw = dict(
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy(),
            ignored_params=experts or None,  # ep+fsdp: the experts stay split by expert, not FSDP-sharded
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, **kw)
        fully_shard(model, mesh=dp_mesh, **kw)
        if mode == "fsdp+tp":  # harmless here: the loss never writes into the logits (module docstring)
            warnings.filterwarnings(
                "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
            )
    return model
