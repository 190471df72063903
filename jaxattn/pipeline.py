"""Pipeline parallelism over a ``stage`` mesh axis: the decoder layers split into stages, one per device group,
micro-batches handed stage to stage with ``ppermute`` inside ONE ``shard_map`` in the one jitted step — GPipe
(Huang et al. 2019 §2.2) and the circular schedule (MaxText's; the SPMD form of interleaved 1F1B, Narayanan et al.
2021 §2.2): with ``virtual`` v > 1 each stage holds v non-adjacent chunks of layers and a micro-batch goes round
the ring v times.

    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    with pipeline.pipelining(mesh, microbatches=4):       # the model's layer stack runs through pipelined()
        loss, grads = jax.value_and_grad(loss_fn)(params)  # all forwards, then all backwards: GPipe

Schedule: step ``t`` of ``v m + p - 1``, stage ``s`` runs item ``i = t - s`` — micro-batch ``i mod m`` in round
``i // m`` through its round's chunk (a bubble step when ``i`` is out of range; its result is never read) — and
passes it on; stage 0 parks what comes back from the last stage until that micro-batch's next round (needs
``m >= p``). Outside the loop the rows are split over ``stage`` too (the embedding, head and loss run
data-parallel over the stages, ``jaxattn.sharding.batch_axes``): the loop gathers the rows on entry and
reduce-scatters the last stage's outputs back to each stage's rows (a batch that does not split over the stages
enters whole and leaves summed). ``jax.grad`` transposes the forward
loop into the backward one (``ppermute`` reversed), so the activations of all ``m`` micro-batches stay live per
stage until the backward — 1F1B's memory gain needs the loss inside the loop; remat (``Llama.remat``) bounds them
instead. Idle fraction ``(p - 1) / (v m + p - 1)`` (:func:`bubble_fraction`). An MoE's router sums leave the loop
per (micro-batch, layer), so each micro-batch's router terms are its own, as under gradient accumulation.

The circular chunks are strided over the stored layers (chunk ``c = r p + s`` on stage ``s``), the parameters are
stored in layer order (contiguous blocks per stage), so ``virtual > 1`` regathers each stage's layers inside the
step (an all-to-all of the layer weights forward, of their gradients backward; the plan suite counts its bytes).
Written by hand: jax has the collectives, not a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twincore.params import TENSOR_PARALLEL_AXES
from twincore.pipeline import bubble_fraction, check_pipeline

from . import model

__all__ = ["STAGE_AXIS", "bubble_fraction", "check_pipeline", "pipelined", "pipelining"]

STAGE_AXIS = "stage"


def pipelined(
    layer: Callable,
    x,
    stacked,
    side,
    *,
    mesh: Mesh,
    microbatches: int,
    virtual: int = 1,
    axis: str = STAGE_AXIS,
    gather_once: bool = False,
    stats: bool = False,
):
    """``layer`` (``(h, params_of_one_layer, side) -> h``) applied over the stacked layers ``stacked`` (leaves
    ``[n_layers, ...]``), pipelined over ``mesh``'s ``axis`` with ``virtual`` chunks per stage (1: GPipe, > 1:
    circular): equal to ``lax.scan`` over all layers. ``x`` ``[B, ...]``; ``side``: a pytree of per-row inputs
    ``[B, ...]`` (RoPE tables, segment ids; None leaves kept) that follow their rows into the micro-batches.
    ``stats``: ``layer`` returns ``(h, per-layer stats)`` (an MoE's router sums over its micro-batch) and this
    returns ``(h, stats)`` with leaves ``[microbatches, n_layers, ...]``: each micro-batch's own, as one process's
    accumulation blocks have them (``jaxattn.moe.moe_losses`` averages their router terms).
    ``gather_once``: each stage's weights gathered whole over the mesh's other axes (tensor parallel kept) once per
    step, before the loop, instead of once per trip inside it (MaxText's ``pipeline_fsdp_ag_once``; torch's twin is
    FSDP2's ``reshard_after_forward=False``): FSDP traffic for memory."""
    p, m, v = mesh.shape[axis], microbatches, virtual
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    batch = x.shape[0]
    check_pipeline(n_layers, p, batch, m, "interleaved" if v > 1 else "gpipe", virtual=v)
    k = n_layers // (p * v)  # layers per chunk
    if v > 1:  # chunk c = r p + s (layers [c k, (c + 1) k)) runs on stage s in round r: [L] -> stage-major
        stacked = jax.tree.map(lambda a: a.reshape(v, p, k, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape), stacked)

    if gather_once:
        stacked = {k: _gathered(w, k, mesh, axis) for k, w in stacked.items()}

    def split(a):  # [B, ...] -> [m, B/m, ...], micro-batch j = rows j, j + m, ...: a row-sharded batch splits
        return a.reshape(batch // m, m, *a.shape[1:]).swapaxes(0, 1)  # in place, no rows move between devices

    rows = batch % p == 0  # the rows split over the stages outside the loop (jaxattn.sharding.batch_axes)

    def gather(a):  # this stage's rows -> all of them (every stage's loop sees the whole batch)
        return jax.lax.all_gather(a, axis, axis=0, tiled=True) if rows else a

    def per_stage(x, stacked, side):  # stacked: this stage's [v k, ...]
        s = jax.lax.axis_index(axis)
        x, side = gather(x), jax.tree.map(gather, side)
        chunks = jax.tree.map(lambda a: a.reshape(v, k, *a.shape[1:]), stacked)  # [v, k, ...]
        xm, sm = split(x), jax.tree.map(split, side)

        def run(h, r, sd):  # round r's chunk of this stage -> (h, its layers' stats [k, ...] or None)
            ws = jax.tree.map(lambda a: a[r], chunks)
            return jax.lax.scan(lambda h, w: layer(h, w, sd) if stats else (layer(h, w, sd), None), h, ws)

        def step(carry, t):
            h, park, out, st_out = carry
            if v > 1:  # stage 0 parks item t - p (back from the last stage) until its micro-batch's next round
                back = t - p
                keep = (s == 0) & (back >= 0) & (back < (v - 1) * m)
                park = park.at[back % m].set(jnp.where(keep, h, park[back % m]))
            h = jnp.where(s == 0, park[t % m], h)  # stage 0 takes item t: a fresh micro-batch in round 0
            i = jnp.clip(t - s, 0, v * m - 1)  # this stage's item
            y, st = run(h, i // m, jax.tree.map(lambda a: a[i % m], sm))
            done = (s == p - 1) & (t - s >= (v - 1) * m)  # the last stage finished micro-batch i mod m
            j = i % m
            out = out.at[j].set(jnp.where(done, y, out[j]))
            real = (t - s >= 0) & (t - s < v * m)  # not a bubble step: item i's stats are its micro-batch's
            st_out = jax.tree.map(lambda b, a: b.at[j, i // m].set(jnp.where(real, a, b[j, i // m])), st_out, st)
            h = jax.lax.ppermute(y, axis, [(a, (a + 1) % p) for a in range(p)])
            return (h, park, out, st_out), None

        shapes = jax.eval_shape(run, xm[0], 0, jax.tree.map(lambda a: a[0], sm))[1]  # [k, ...] per layer stat
        st_out = jax.tree.map(lambda a: jnp.zeros((m, v, *a.shape), a.dtype), shapes)  # [m, v, k, ...]
        init = (jnp.zeros_like(xm[0]), xm, jnp.zeros_like(xm), st_out)  # park starts as the micro-batches
        (_, _, out, st_out), _ = jax.lax.scan(step, init, jnp.arange(v * m + p - 1))
        out = jnp.where(s == p - 1, out, jnp.zeros((), out.dtype)).swapaxes(0, 1).reshape(x.shape)  # [B, ...]
        if rows:  # each stage its rows of the last stage's outputs; the backward gathers their cotangents
            out = jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
        else:
            out = jax.lax.psum(out, axis)
        return out, jax.tree.map(lambda a: a[:, :, None], st_out)  # [m, v, 1 (this stage), k, ...]

    # check_vma=False: a Pallas kernel inside (flash attention) has no varying-axis rule, and the attention's own
    # per-device-block shard_map nested in this one (jaxattn.sharding) then differentiates too
    spec = P(axis) if rows else P()
    h, st = jax.shard_map(
        per_stage,
        mesh=mesh,
        in_specs=(spec, P(axis), spec),
        out_specs=(spec, P(None, None, axis)),
        axis_names={axis},
        check_vma=False,
    )(x, stacked, side)
    if not stats:
        return h
    # [m, v, p, k, ...] -> [m, n_layers, ...]: round r of stage s ran chunk r p + s, layers [(r p + s) k, ... + k)
    return h, jax.tree.map(lambda a: a.reshape(m, n_layers, *a.shape[4:]), st)


def _gathered(w, name: str, mesh: Mesh, axis: str):
    """Stacked layer weight ``name`` constrained to its layers over ``axis`` and its tensor-parallel dimensions over
    ``tensor`` only (every other axis gathered); a weight the model does not name is left alone."""
    axes = model.PARAM_AXES.get(name)
    if axes is None or len(axes) != w.ndim:
        return w
    spec = []
    for d, a in zip(w.shape, axes):
        mesh_axis = axis if a == "layers" else "tensor" if a in TENSOR_PARALLEL_AXES else None
        spec.append(mesh_axis if mesh_axis in mesh.shape and d % mesh.shape[mesh_axis] == 0 else None)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*spec)))


@contextlib.contextmanager
def pipelining(
    mesh: Mesh, microbatches: int, virtual: int = 1, axis: str = STAGE_AXIS, gather_once: bool = False
) -> Iterator[None]:
    """Within the block, every trace of ``Llama`` runs its decoder layers through :func:`pipelined` over ``mesh``'s
    ``axis`` (the model's ``LAYER_STACK`` seam; the model knows no mesh); ``virtual`` > 1: the circular schedule."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no {axis!r} axis (axes: {tuple(mesh.shape)}); pipelining needs one")

    def run(layer, x, stacked, side, stats=False):
        return pipelined(
            layer, x, stacked, side, mesh=mesh, microbatches=microbatches, virtual=virtual, axis=axis,
            gather_once=gather_once, stats=stats,
        )  # fmt: skip

    token = model.LAYER_STACK.set(run)
    try:
        yield
    finally:
        model.LAYER_STACK.reset(token)
