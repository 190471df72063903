"""Data, FSDP (ZeRO-3) and Megatron tensor parallelism for the JAX Llama, applied from OUTSIDE the model (twin of
``torchref.parallel``; torchtitan's ``parallelize.py`` split).

    mesh = make_mesh("data=2,fsdp=2,tensor=2")                    # axes (stage, data, fsdp, expert, tensor)
    tx, state, sharding = shard_train_state(graphdef, tx, state, mesh, batch_size=8)
    step = make_train_step(graphdef, tx, sharding=sharding)       # one jax.jit with in/out shardings

Parameters: their logical axis names (the parameter table's) go through :data:`RULES` to mesh axes — ``heads``,
``kv_heads``, ``mlp``, ``vocab`` on ``tensor`` (Megatron: column- then row-parallel), ``embed`` on ``fsdp`` and
``expert`` (ZeRO-3 over every device of expert parallelism, as MaxText does; an expert weight's on ``fsdp`` only),
``layers`` on ``stage`` (pipeline stages: with ``stage`` > 1 the step runs its layers through ``jaxattn.pipeline``'s
GPipe loop in ``microbatches``), an MoE's ``experts`` on ``expert`` (expert parallelism: ``jaxattn.moe`` exchanges
the routed tokens by all-to-all inside ``shard_map``); the optimizer state is sharded like its parameter (ZeRO-3),
scalars and misfit leaves replicated; the batch splits over (data, fsdp, expert). XLA's SPMD partitioner inserts
the other collectives.
Activations: the model's ``constrain`` / ``per_shard`` seams become ``with_sharding_constraint`` / ``shard_map``
under :func:`activation_sharding` (hidden states keep ``embed`` whole, so FSDP gathers each layer's weights inside
the loop; attention runs on each device's rows and heads, so a Pallas kernel is not gathered whole). Every
divisibility problem is a ValueError before a compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twincore import params
from twincore.cli import print_line

from . import remat
from .model import ACTIVATION_CONSTRAINT, PER_SHARD
from .moe import EXPERT_PARALLEL, moe_block
from .optim import LAYER_SHARDS, ScaleByAdam8bitState

__all__ = [
    "MESH_AXES",
    "BATCH_AXES",
    "batch_axes",
    "RULES",
    "parse_mesh",
    "make_mesh",
    "logical_to_spec",
    "check_config",
    "check_batch_size",
    "check_stages",
    "state_shardings",
    "batch_sharding",
    "shard_state",
    "shard_train_state",
    "TrainSharding",
    "global_batch",
    "initialize_distributed",
    "ACTIVATION_RULES",
    "activation_sharding",
    "per_shard_map",
    "expert_parallel_map",
    "offloaded",
    "offload_unavailable_reason",
]

MESH_AXES = ("stage", "data", "fsdp", "expert", "tensor")  # stage outermost: pipeline stages may span hosts
BATCH_AXES = ("data", "fsdp", "expert")  # expert parallelism splits the tokens too (each device routes its own)
# logical axis name (jaxattn.model.PARAM_AXES) -> mesh axis (None: replicated)
RULES: dict[str, str | None] = {
    **{a: "tensor" for a in params.TENSOR_PARALLEL_AXES},
    # ZeRO-3 over fsdp AND expert (MaxText's rule): expert parallelism splits the tokens, so the dense weights shard
    # over its devices too; an expert weight's embed keeps fsdp only (its experts dim holds expert, _unused)
    "embed": ("fsdp", "expert"),
    "head_dim": None,
    "experts": "expert",  # an MoE's experts: expert parallelism (jaxattn.moe's all-to-all under shard_map)
    "layers": "stage",  # pipeline stages (jaxattn.pipeline): each holds its contiguous share of the layers
}
# logical axis name of an activation (jaxattn.model.ACT_AXES / LOGITS_AXES) -> mesh axes; embed stays whole
ACTIVATION_RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "seq": None,
    "embed": None,
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
}


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` (or a dict) -> ``{"data": 2, "fsdp": 2, "tensor": 2}``; a missing axis is 1."""
    if isinstance(spec, str):
        sizes: dict[str, Any] = {}
        for part in spec.split(","):
            name, _, size = part.partition("=")
            name, size = name.strip(), size.strip()
            if not name or not size.isdigit() or name in sizes:
                raise ValueError(
                    f"mesh {spec!r}: expected comma-separated, non-repeated AXIS=N with AXIS in "
                    f"{MESH_AXES} and N >= 1, e.g. 'data=2,fsdp=2,tensor=2'"
                )
            sizes[name] = int(size)
    elif isinstance(spec, Mapping):
        sizes = dict(spec)
    else:
        raise TypeError(f"mesh must be a string like 'data=2,fsdp=2,tensor=2' or a dict, got {type(spec).__name__}")
    unknown = [a for a in sizes if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh {spec!r}: unknown axis {unknown[0]!r}; the axes are {MESH_AXES}")
    for a, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"mesh {spec!r}: axis {a!r} has size {n!r}; sizes are integers >= 1")
    return {a: int(sizes.get(a, 1)) for a in MESH_AXES}


def make_mesh(spec: str | Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` with axes ``(stage, data, fsdp, expert, tensor)`` over ``devices`` (default ``jax.devices()``),
    auto axis types (newer jax defaults ``jax.make_mesh`` to explicit ones). The sizes' product must equal the
    device count."""
    sizes = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[a] for a in MESH_AXES)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh {spec!r}: stage*data*fsdp*expert*tensor = {int(np.prod(shape))} but there are {len(devices)} "
            f"devices; the product of the axis sizes must equal the device count"
            + (
                f" (on a CPU, simulate {int(np.prod(shape))} devices with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={int(np.prod(shape))} set before jax starts)"
                if devices and devices[0].platform == "cpu"
                else ""
            )
        )
    try:
        from jax.sharding import AxisType

        kw = {"axis_types": (AxisType.Auto,) * len(shape)}
    except ImportError:  # pragma: no cover - a jax without axis types
        kw = {}
    try:
        return jax.make_mesh(shape, MESH_AXES, devices=devices, **kw)
    except TypeError:  # pragma: no cover - a jax.make_mesh without devices=/axis_types=
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, **kw)
    except NotImplementedError:
        # a TPU torus whose physical axes cannot hold each mesh axis whole (data=8 on a 4x4x4 v5p): let an axis span
        # two physical ones, as MaxText does (jax's make_mesh does not offer it)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, **kw)


def logical_to_spec(names: Sequence[str | None], rules: Mapping[str, str | None] = RULES) -> P:
    """Logical axis names -> ``PartitionSpec`` of mesh axes (an unknown name raises)."""
    out = []
    for n in names:
        if n is not None and n not in rules:
            raise ValueError(f"logical axis {n!r} has no sharding rule; known: {sorted(rules)}")
        out.append(None if n is None else rules[n])
    return P(*out)


def batch_axes(mesh: Mesh) -> tuple:
    """The mesh axes a batch's rows split over: (``data``, ``fsdp``), and ``stage`` first with a ``stage`` axis > 1
    (outside the pipelined layers the embedding, head and loss run data-parallel over the stages; the stage loop
    gathers the rows it pipelines, ``jaxattn.pipeline``)."""
    return (("stage",) if _axis_size(mesh, ("stage",)) > 1 else ()) + BATCH_AXES


def _unused(spec, taken) -> P:
    """``spec`` without the mesh axes in ``taken`` (a pipeline region's manual axes, or axes an earlier dimension
    holds)."""
    out, used = [], set(taken)
    for a in spec:
        axes = tuple(x for x in (a if isinstance(a, tuple) else (a,)) if x is not None and x not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _axis_size(mesh: Mesh, axis) -> int:
    if axis is None:
        return 1
    axes = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[a] for a in axes]))


def check_config(config, mesh: Mesh) -> None:
    """Every config size a split logical axis needs (``twincore.params.AXIS_FIELDS``: heads, KV heads, FFN and vocab on
    ``tensor``, ``dim`` on ``fsdp``) must divide by its mesh axis. ValueError otherwise."""
    for logical, field in params.AXIS_FIELDS.items():
        axis = RULES.get(logical)
        value, n = getattr(config, field), _axis_size(mesh, axis)
        if value % n:
            axes = axis if isinstance(axis, tuple) else (axis,)
            name = "*".join(a for a in axes if mesh.shape[a] > 1)  # the axes that split it
            raise ValueError(
                f"ModelConfig.{field}={value} is not divisible by the mesh axis {name}={n}; use a "
                f"{name} size that divides it (divisors <= 8: "
                f"{[d for d in range(1, 9) if value % d == 0]})"
            )


def check_batch_size(batch_size: int, mesh: Mesh, grad_accum: int = 1) -> None:
    """The batch (each microbatch with ``grad_accum``) must divide by ``data * fsdp * expert`` (times ``stage``)."""
    n = _axis_size(mesh, batch_axes(mesh))
    if batch_size % grad_accum or (batch_size // grad_accum) % n:
        raise ValueError(
            f"batch_size={batch_size} (grad_accum={grad_accum}) is not divisible by the data axes "
            f"{'*'.join(batch_axes(mesh))}={n}: each (micro)batch's rows are split over "
            f"({', '.join(batch_axes(mesh))}); use a multiple of {n * grad_accum}"
        )


def check_stages(config, mesh: Mesh, rows: int, microbatches: int, virtual: int = 1) -> None:
    """With a ``stage`` axis > 1: the layers split into equal stages, the ``rows`` of a step into ``microbatches``
    (each a multiple of ``data * fsdp * expert``); ``microbatches`` > 1 needs a ``stage`` axis (ValueError naming
    them)."""
    stages = _axis_size(mesh, ("stage",))
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if stages == 1:
        if microbatches > 1:
            raise ValueError(
                f"microbatches={microbatches} splits the batch for pipeline stages, but the mesh has no stage axis "
                f"(add stage=N to the mesh; gradient accumulation is grad_accum)"
            )
        return
    from .pipeline import check_pipeline

    schedule = "interleaved" if virtual > 1 else "gpipe"
    check_pipeline(getattr(config, "n_layers", stages), stages, rows, microbatches, schedule, virtual)
    n = _axis_size(mesh, BATCH_AXES)
    if (rows // microbatches) % n:
        raise ValueError(
            f"a micro-batch of {rows // microbatches} rows (microbatches={microbatches}) does not split over the "
            f"data axes data*fsdp*expert={n}"
        )


def _names(leaf) -> tuple | None:
    md = leaf.get_metadata()
    return md.get("out_sharding") or md.get("sharding_names") or md.get("sharding")


def _divisible(mesh: Mesh, shape: Sequence[int], spec: Sequence) -> NamedSharding:
    """``spec`` with every axis that does not divide its dim left whole."""
    return NamedSharding(mesh, P(*(a if dim % _axis_size(mesh, a) == 0 else None for dim, a in zip(shape, spec))))


def _leaf_sharding(leaf, mesh: Mesh, rules: Mapping[str, str | None]) -> NamedSharding:
    shape = getattr(leaf.get_value() if hasattr(leaf, "get_value") else leaf.value, "shape", ())
    names = _names(leaf)
    if not names or len(names) != len(shape):
        return NamedSharding(mesh, P())  # no names, or a leaf that is not the param's shape (e.g. a factored moment)
    return _divisible(mesh, shape, _unused(logical_to_spec(names, rules), ()))  # stage holds layers: not embed too


def _codes_sharding(leaf, mesh: Mesh, rules: Mapping[str, str | None]) -> NamedSharding:
    """8-bit Adam's codes (``jaxattn.optim``). By row, ``[*param.shape[:-1], last / block, block]``: the param's
    spec, the block axis whole, so each device quantises its own elements. Flat, ``[*lead, n_blocks, block]`` (a
    last dim that is not a whole number of blocks): the layer axes as the param's, the blocks over every axis the
    param's own dims are split over (XLA moves the elements of a block that straddles two devices)."""
    shape = (leaf.get_value() if hasattr(leaf, "get_value") else leaf.value).shape
    names = _names(leaf) or ()
    spec = tuple(_unused(logical_to_spec(names, rules), ())) if names else ()
    if len(shape) == len(spec) + 1:
        # an axis that does not divide the row's blocks (a device's share of the row under a block) splits the
        # rows instead (XLA then moves each device's elements to the device of their blocks); never the layers
        grid, moved = list(spec), []
        for i, a in enumerate(spec):
            if a is not None and shape[i] % _axis_size(mesh, a):
                grid[i], moved = None, [*moved, a]
        for a in moved:
            for i, name in enumerate(names):
                axes = (*_axes(grid[i]), *_axes(a))
                if name != "layers" and shape[i] % _axis_size(mesh, axes) == 0:
                    grid[i] = axes
                    break
        return NamedSharding(mesh, P(*grid, None))
    b = len(shape) - 2
    own = tuple(a for s in spec[b:] for a in _axes(s))
    first = spec[b] if len(spec) > b else None
    blocks = next((a for a in (own, first) if a and shape[b] % _axis_size(mesh, a) == 0), None)
    return _divisible(mesh, shape, (*spec[:b], blocks, None))


def _axes(a) -> tuple:
    """A spec entry's mesh axes: None, a name or a tuple of names."""
    return () if a is None else (a,) if isinstance(a, str) else tuple(a)


def _adam8bit_shardings(node: ScaleByAdam8bitState, mesh: Mesh, rules: Mapping[str, str | None]):
    """Codes by :func:`_codes_sharding`, each absmax as its codes without the block axis; float32 moments (small
    params) like their params."""

    def moment(leaf):
        return _codes_sharding(leaf, mesh, rules) if _is_codes(leaf) else _leaf_sharding(leaf, mesh, rules)

    def absmax(codes, codes_sharding, leaf):
        if _is_codes(codes):
            return NamedSharding(mesh, P(*codes_sharding.spec[:-1]))
        return _leaf_sharding(leaf, mesh, rules)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    mu, nu = (jax.tree.map(moment, t, is_leaf=is_var) for t in (node.mu, node.nu))
    return ScaleByAdam8bitState(
        NamedSharding(mesh, P()),
        mu,
        jax.tree.map(absmax, node.mu, mu, node.mu_absmax, is_leaf=is_var),
        nu,
        jax.tree.map(absmax, node.nu, nu, node.nu_absmax, is_leaf=is_var),
    )


def _is_codes(leaf) -> bool:
    return (
        isinstance(leaf, nnx.Variable)
        and (leaf.get_value() if hasattr(leaf, "get_value") else leaf.value).dtype == jnp.uint8
    )


def state_shardings(state: Any, mesh: Mesh, rules: Mapping[str, str | None] = RULES) -> Any:
    """A tree of ``NamedSharding`` (a prefix of ``state``: one per ``nnx.Variable`` or array leaf) for any pytree
    holding the model's ``nnx.Param`` leaves: a ``TrainState`` (params, optimizer moments: ZeRO-3), an
    ``nnx.State``. Leaves without logical names (scalars, the RoPE table, the loss scale) are replicated; 8-bit
    Adam's blocks of a param are split as the param's elements are (:func:`_codes_sharding`). A rule naming
    ``stage`` applies only where the mesh has a ``stage`` axis larger than 1 (no pipeline: layers whole)."""
    if "stage" not in mesh.shape or mesh.shape["stage"] == 1:
        rules = {k: (None if v == "stage" else v) for k, v in rules.items()}
    elif rules.get("embed") == RULES["embed"]:  # the embedding, head and norms (outside the stages) over them too
        rules = {**rules, "embed": ("stage", *RULES["embed"])}

    def one(x):
        if isinstance(x, ScaleByAdam8bitState):
            return _adam8bit_shardings(x, mesh, rules)
        return _leaf_sharding(x, mesh, rules) if isinstance(x, nnx.Variable) else NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, (nnx.Variable, ScaleByAdam8bitState)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over (``data``, ``fsdp``) — and ``stage`` with pipeline stages, :func:`batch_axes` — the sequence
    replicated (a prefix for every array of a batch dict)."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def global_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict:
    """A host batch (the SAME global batch on every process) as global arrays split by :func:`batch_sharding`:
    each process fills only its own devices' rows (multi-process; one process may pass numpy directly)."""
    sh = batch_sharding(mesh)
    return {
        k: None if v is None else jax.make_array_from_callback(np.shape(v), sh, lambda idx, v=v: np.asarray(v)[idx])
        for k, v in batch.items()
    }


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout: float = 300.0,
) -> None:
    """``jax.distributed.initialize`` from the arguments, else the environment (``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); on CPU with gloo collectives. Call before any other jax use. Says on
    stderr whom it waits for; a process that has not met all the others within ``timeout`` seconds prints one
    line naming the coordinator and the count and exits with status 2 (jax's own deadline aborts from C++)."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
    if process_id is None and os.environ.get("JAX_PROCESS_ID") is not None:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None or num_processes is None or process_id is None:
        raise ValueError(
            f"initialize_distributed needs coordinator, num_processes and process_id (or the "
            f"JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables); got "
            f"{coordinator!r}, {num_processes!r}, {process_id!r}"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # pragma: no cover - a jax without the option
        pass
    print_line(
        f"jaxattn: process {process_id} waiting up to {timeout:g} s for all {num_processes} processes at {coordinator}"
    )
    # jax's own deadline ends the process from C++ (a CHECK failure and a stack dump), so ours fires first: one line
    # and exit status 2; jax's is set later so that it never wins the race
    watchdog = threading.Timer(timeout, _rendezvous_timed_out, (process_id, num_processes, coordinator, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator, num_processes=num_processes, process_id=process_id, initialization_timeout=int(timeout) + 60
        )
    finally:
        watchdog.cancel()


def _rendezvous_timed_out(process_id: int, num_processes: int, coordinator: str, timeout: float) -> None:
    print_line(
        f"jaxattn: error: process {process_id}: the {num_processes} processes did not all meet at {coordinator} "
        f"within {timeout:g} s; start every process with the same --coordinator and --num-processes, or raise "
        f"--distributed-timeout"
    )
    os._exit(2)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Mapping[str, Any] = ACTIVATION_RULES):
    """While active (at TRACE time), ``jaxattn.model.constrain(x, names)`` applies
    ``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))`` with ``spec`` from ``rules``; a dimension
    its mesh axes do not divide stays unsplit. Outside it the hook is a no-op."""

    if rules.get("batch") == BATCH_AXES:  # with pipeline stages the rows outside the stage loop split over them
        rules = {**rules, "batch": batch_axes(mesh)}

    def constrain(x, names):
        ctx, manual = _context_mesh(mesh)  # inside the stage loop, stage is held by hand: not named here
        spec = _unused(logical_to_spec(names, rules), manual)
        spec = P(*(a if d % _axis_size(mesh, a) == 0 else None for d, a in zip(x.shape, spec)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(ctx, spec))

    def local(fn, args, in_axes, out_axes):
        return per_shard_map(fn, args, in_axes, out_axes, mesh, rules)

    def experts(x, p, cfg, mask):
        return expert_parallel_map(x, p, cfg, mask, mesh)

    stages = _axis_size(mesh, ("stage",)) if RULES["layers"] == "stage" else 1
    seams = (ACTIVATION_CONSTRAINT, constrain), (PER_SHARD, local), (EXPERT_PARALLEL, experts), (LAYER_SHARDS, stages)
    tokens = [(var, var.set(value)) for var, value in seams]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def expert_parallel_map(x, p, cfg, mask, mesh: Mesh):
    """``jaxattn.moe.moe_block`` on each device's rows under ``shard_map``: tokens are routed where they live (no
    global sort), the experts split over the ``expert`` axis (their weights gathered over ``fsdp`` / ``tensor``)
    with the assignments exchanged by all-to-all when it is > 1; the router statistics are summed over devices
    after the map (so they equal one device's). Inside a pipeline's stage loop (``stage`` held by hand) the map is
    over the other axes, on the micro-batch's rows (split over ``data`` / ``fsdp`` where they divide it)."""
    n = _axis_size(mesh, "expert")
    axes = tuple(a for a in batch_axes(mesh) if a not in _context_mesh(mesh)[1])
    rows = P(axes) if x.shape[0] % _axis_size(mesh, axes) == 0 else P()
    # the block's weights (the parameter table's router and expert rows): experts split over `expert`, router whole;
    # an int8 weight is a pytree (q, scale): one spec per leaf
    moe_rows = [r for r in params.layer_rows(cfg) if r.expert or r.kind == "router"]
    weights = {r.name: p[r.name] for r in moe_rows}
    specs = {r.name: jax.tree.map(lambda _, r=r: P("expert") if r.expert else P(), weights[r.name]) for r in moe_rows}

    def body(x, weights, mask):
        y, stats = moe_block(x, weights, cfg, mask, expert_axis="expert", expert_shards=n)
        return y, jax.tree.map(lambda v: v[None], stats)  # [1, ...] per device, summed outside

    mask = jnp.ones(x.shape[:2], bool) if mask is None else mask  # None = every token (moe_block's default)
    y, stats = _shard_map(body, mesh, (rows, specs, rows), (rows, rows))(x, weights, mask)
    return y, jax.tree.map(lambda v: v.sum(0), stats)


def _context_mesh(mesh: Mesh):
    """``(mesh, ())``, or inside a ``shard_map`` that already holds some axes by hand (``jaxattn.pipeline``'s
    ``stage``) ``(that region's abstract mesh, its manual axes)``: a nested shard_map or sharding constraint must
    name the region's mesh and leave those axes alone."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    am = get() if get is not None else None
    manual = tuple(getattr(am, "manual_axes", ()) or ()) if am is not None and not am.empty else ()
    return (am, manual) if manual else (mesh, ())


def _shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` without the replication check (a Pallas call has no rule for it); jax < 0.7 spelled it
    ``jax.experimental.shard_map.shard_map(..., check_rep=)``. Inside a region already manual over some axes, over
    the others only."""
    if hasattr(jax, "shard_map"):
        ctx, manual = _context_mesh(mesh)
        if manual:
            axes = frozenset(ctx.axis_names) - set(manual)
            return jax.shard_map(fn, mesh=ctx, in_specs=in_specs, out_specs=out_specs, axis_names=axes, check_vma=False)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - older jax

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def per_shard_map(
    fn,
    args: Sequence[Any],
    in_axes: Sequence[Any],
    out_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, Any] = ACTIVATION_RULES,
):
    """``fn(*args)`` run on each device's block under ``shard_map``: arg ``i``'s dimensions split as its logical
    names ``in_axes[i]`` say (through ``rules``), the output assembled by ``out_axes``. A mesh axis is used only if
    it divides EVERY dimension named onto it (else that axis is dropped everywhere: q heads and kv heads must split
    together or GQA's head groups would change), so the result always equals ``fn(*args)``. ``None`` args stay
    ``None``."""
    manual = _context_mesh(mesh)[1]  # a pipeline region's manual axes: not named here
    named = [(x, _unused(logical_to_spec(n, rules), manual)) for x, n in zip(args, in_axes) if x is not None]
    dropped = set(manual)
    for x, spec in named:
        for leaf in jax.tree.leaves(x):
            for d, a in zip(leaf.shape, spec):
                if a is not None and d % _axis_size(mesh, a):
                    dropped.update(a if isinstance(a, tuple) else (a,))

    def keep(spec):
        out = []
        for a in spec:
            axes = tuple(x for x in (a if isinstance(a, tuple) else (a,)) if x is not None and x not in dropped)
            out.append(None if not axes else axes[0] if len(axes) == 1 and not isinstance(a, tuple) else axes)
        return P(*out)

    specs = [keep(s) for _, s in named]
    out_spec = keep(_unused(logical_to_spec(out_axes, rules), manual))
    present = [i for i, x in enumerate(args) if x is not None]

    def body(*blocks):
        full = [None] * len(args)
        for i, b in zip(present, blocks):
            full[i] = b
        return fn(*full)

    return _shard_map(body, mesh, tuple(specs), out_spec)(*[args[i] for i in present])


def shard_state(state: Any, mesh: Mesh, rules: Mapping[str, str | None] = RULES) -> Any:
    """``state`` moved onto ``mesh`` with :func:`state_shardings`."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def offload_unavailable_reason(mesh: Mesh) -> str | None:
    """None when every device of ``mesh`` has a ``pinned_host`` memory space, else why not."""
    for d in mesh.devices.flat:
        reason = remat.offload_unavailable_reason(d)
        if reason is not None:
            return reason
    return None


def offloaded(tx, device_shardings: Any, host_shardings: Any):
    """``tx`` whose optimizer state lives in ``pinned_host`` memory between steps (ZeRO-Offload's idea, with XLA's
    memory spaces): ``update`` brings the state to device memory, updates it there and sends it back, so the
    device holds it only while the step runs. ``*_shardings``: prefix trees of the state's shardings."""

    def update(updates, opt_state, params=None):
        new_updates, new_state = tx.update(updates, jax.device_put(opt_state, device_shardings), params)
        return new_updates, jax.device_put(new_state, host_shardings)

    return optax.GradientTransformation(tx.init, update)


@dataclasses.dataclass(frozen=True)
class TrainSharding:
    """How a train step is laid out on ``mesh``; ``jaxattn.train_step.make_train_step(..., sharding=...)`` reads it.

    ``state``: a tree of ``NamedSharding`` for the ``TrainState`` (ZeRO-3; the optimizer state in ``pinned_host``
    memory when offloaded); ``batch``: rows over (data, fsdp, expert). The step is jitted with :attr:`in_shardings` /
    :attr:`out_shardings`, checks a batch with :meth:`check_batch_size`, turns a host batch into a global array
    with :meth:`place` (multi-process) and traces under :meth:`tracing` (the model's activation constraints)."""

    mesh: Mesh
    state: Any
    batch: NamedSharding
    grad_accum: int = 1
    microbatches: int = 1  # pipeline micro-batches per (accumulation) batch, with a ``stage`` axis > 1
    virtual: int = 1  # pipeline chunks per stage: 1 GPipe, > 1 the circular schedule (jaxattn.pipeline)
    gather_once: bool = False  # each stage's weights gathered once per step, not once per trip (jaxattn.pipeline)

    @property
    def in_shardings(self) -> tuple:
        return (self.state, self.batch)

    @property
    def out_shardings(self) -> tuple:
        return (self.state, NamedSharding(self.mesh, P()))

    def tracing(self):
        """The model's activation constraints and, with a ``stage`` axis > 1, its layers as pipeline stages."""
        if _axis_size(self.mesh, ("stage",)) == 1:
            return activation_sharding(self.mesh)
        from . import pipeline  # imports the model

        stack = contextlib.ExitStack()
        stack.enter_context(activation_sharding(self.mesh))
        stack.enter_context(
            pipeline.pipelining(self.mesh, self.microbatches, self.virtual, gather_once=self.gather_once)
        )
        return stack

    def check_batch_size(self, batch_size: int) -> None:
        check_batch_size(batch_size, self.mesh, self.grad_accum)

    def place(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """``batch`` itself in one process; across processes, the global arrays built from every process's copy."""
        return batch if jax.process_count() == 1 else global_batch(batch, self.mesh)


def shard_train_state(
    graphdef: nnx.GraphDef,
    tx,
    state: Any,
    mesh: Mesh,
    *,
    batch_size: int,
    grad_accum: int = 1,
    rules: Mapping[str, str | None] = RULES,
    offload_optimizer: bool = False,
    microbatches: int = 1,
    virtual: int = 1,
    gather_once: bool = False,
):
    """``(tx, state, sharding)`` for ``make_train_step(graphdef, tx, sharding=sharding)``: the mesh checked against
    the model config and ``batch_size`` (ValueError naming the value, before any compile; with a ``stage`` axis the
    layers must split into equal stages and each accumulation batch into ``microbatches``), the state's shardings
    (:func:`state_shardings`), ``state`` placed on them. ``offload_optimizer``: the optimizer state kept in host
    memory (``memory_kind="pinned_host"``, ``tx`` wrapped by :func:`offloaded`); a backend without that memory
    space is a ValueError."""
    config = getattr(nnx.merge(graphdef, state.params, state.rest), "config", None)
    if config is not None:
        check_config(config, mesh)
    check_batch_size(batch_size, mesh, grad_accum)
    check_stages(config, mesh, batch_size // max(grad_accum, 1), microbatches, virtual)
    sh = state_shardings(state, mesh, rules)
    if offload_optimizer:
        reason = offload_unavailable_reason(mesh)
        if reason is not None:
            raise ValueError(
                f"offload_optimizer=True cannot be served on this backend: {reason}; keep the "
                f"optimizer state in device memory (offload_optimizer=False)"
            )
        host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), sh.opt_state)
        tx = offloaded(tx, jax.tree.map(lambda s: s.with_memory_kind("device"), sh.opt_state), host)
        sh = dataclasses.replace(sh, opt_state=host)
    return (
        tx,
        jax.device_put(state, sh),
        TrainSharding(mesh, sh, batch_sharding(mesh), grad_accum, microbatches, virtual, gather_once),
    )
