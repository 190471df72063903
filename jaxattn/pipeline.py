"""Pipeline parallelism over a ``stage`` mesh axis: the decoder layers split into contiguous stages, one per
device group, micro-batches handed stage to stage with ``ppermute`` inside ONE ``shard_map`` (GPipe, Huang et al.
2019 §2.2; MaxText's layout: layers ``[stages, layers_per_stage]``, the rotation in one jitted program).

    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    with pipeline.pipelining(mesh, microbatches=4):       # the model's layer stack runs through gpipe()
        loss, grads = jax.value_and_grad(loss_fn)(params)  # all forwards, then all backwards: GPipe

Schedule: step ``t`` of ``m + p - 1``, stage ``s`` runs micro-batch ``t - s`` through its layers (a bubble step when
that is out of range; its result is never read) and passes it on; the last stage's outputs are summed over
``stage`` so every stage holds them (the embedding and the head run outside, replicated over ``stage``, as in
MaxText). ``jax.grad`` transposes the forward loop into the backward one (``ppermute`` reversed), so activations of
all ``m`` micro-batches stay live per stage until the backward: remat (``Llama.remat``) bounds them. Idle fraction
``(p - 1) / (m + p - 1)`` (:func:`bubble_fraction`). Written by hand: jax has the collectives, not a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import model
from .spec.pipeline import bubble_fraction, check_pipeline

__all__ = ["STAGE_AXIS", "bubble_fraction", "check_pipeline", "gpipe", "pipelining"]

STAGE_AXIS = "stage"


def gpipe(layer: Callable, x, stacked, side, *, mesh: Mesh, microbatches: int, axis: str = STAGE_AXIS):
    """``layer`` (``(h, params_of_one_layer, side) -> h``) applied over the stacked layers ``stacked`` (leaves
    ``[n_layers, ...]``), pipelined over ``mesh``'s ``axis``: equal to ``lax.scan`` over all layers. ``x``
    ``[B, ...]``; ``side``: a pytree of per-row inputs ``[B, ...]`` (RoPE tables, segment ids; None leaves kept)
    that follow their rows into the micro-batches."""
    stages = mesh.shape[axis]
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    batch = x.shape[0]
    check_pipeline(n_layers, stages, batch, microbatches)
    m = microbatches

    def split(a):  # [B, ...] -> [m, B/m, ...]
        return a.reshape(m, batch // m, *a.shape[1:])

    def per_stage(x, stacked, side):  # stacked: this stage's [n_layers / stages, ...]
        s = jax.lax.axis_index(axis)
        xm, sm = split(x), jax.tree.map(split, side)

        def run(h, sd):
            return jax.lax.scan(lambda h, p: (layer(h, p, sd), None), h, stacked)[0]

        def step(carry, t):
            h, out = carry
            h = jnp.where(s == 0, xm[jnp.clip(t, 0, m - 1)], h)  # stage 0 takes micro-batch t
            y = run(h, jax.tree.map(lambda a: a[jnp.clip(t - s, 0, m - 1)], sm))  # micro-batch t - s
            j = jnp.clip(t - (stages - 1), 0, m - 1)
            done = (s == stages - 1) & (t >= stages - 1)  # the last stage finished micro-batch j
            out = out.at[j].set(jnp.where(done, y, out[j]))
            h = jax.lax.ppermute(y, axis, [(k, (k + 1) % stages) for k in range(stages)])
            return (h, out), None

        init = (jnp.zeros_like(xm[0]), jnp.zeros_like(xm))
        (_, out), _ = jax.lax.scan(step, init, jnp.arange(m + stages - 1))
        out = jax.lax.psum(jnp.where(s == stages - 1, out, jnp.zeros((), out.dtype)), axis)  # [m, B/m, ...]
        return out.reshape(x.shape)

    # check_vma=False: a Pallas kernel inside (flash attention) has no varying-axis rule, and the attention's own
    # per-device-block shard_map nested in this one (jaxattn.sharding) then differentiates too
    return jax.shard_map(
        per_stage, mesh=mesh, in_specs=(P(), P(axis), P()), out_specs=P(), axis_names={axis}, check_vma=False
    )(x, stacked, side)


@contextlib.contextmanager
def pipelining(mesh: Mesh, microbatches: int, axis: str = STAGE_AXIS) -> Iterator[None]:
    """Within the block, every trace of ``Llama`` runs its decoder layers through :func:`gpipe` over ``mesh``'s
    ``axis`` (the model's ``LAYER_STACK`` seam; the model knows no mesh)."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no {axis!r} axis (axes: {tuple(mesh.shape)}); pipelining needs one")

    def run(layer, x, stacked, side):
        return gpipe(layer, x, stacked, side, mesh=mesh, microbatches=microbatches, axis=axis)

    token = model.LAYER_STACK.set(run)
    try:
        yield
    finally:
        model.LAYER_STACK.reset(token)
