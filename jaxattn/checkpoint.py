"""Training checkpoints for the JAX trainer with orbax, in a run directory of ``twincore.rundir`` (twin of
``torchref.checkpoint``).

    ckpt = Checkpointer("runs/a", keep=3, run={"seed": 0, ...})
    ckpt.save(step, {"train": state, "rng": key_data}, meta={"step": step, "data_position": step, ...})
    tree, meta = ckpt.restore(ckpt.latest_step(), like={"train": state, "rng": key_data})

A checkpoint holds the whole ``TrainState`` pytree, the root PRNG key data and a JSON ``meta``, in ``step_<N>/``.
orbax writes it into a temporary directory and renames it when complete, so a kill leaves the previous steps whole.
orbax's own pruning and step discovery are off: the run marker (``twincore.rundir``) records each step before it is
written and its files' sha256 after, so ``keep`` deletes only steps this run wrote and :meth:`latest_step` is the
newest step whose checksums match (a corrupt one is skipped with a warning). Zero-size arrays (an optimizer's
unused state) are not written (orbax refuses them) and come back from ``like``. Saves are synchronous. The writer holds
the directory's lock from construction (a directory in use is refused before orbax's manager is built) to
:meth:`close` or the end of :meth:`locked`."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from twincore.rundir import StepCheckpointer

__all__ = ["Checkpointer", "ORBAX_VERSION"]

ORBAX_VERSION = getattr(ocp, "__version__", "unknown")
STEP_PREFIX = "step"  # step_<N>/: a folder of the user's named by a number is never taken for a step


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) if hasattr(x, "shape") else x
        ),
        tree,
    )


def _path(path) -> tuple:
    """A jax key path as names (dict keys, attribute names, indices), as orbax's metadata tree spells them."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _is_empty(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and math.prod(x.shape) == 0


def _without_empty(tree: Any) -> Any:
    """``tree`` with every zero-size array as ``None``: orbax refuses to save one (an 8-bit optimizer's absmax of a
    small param, Adafactor's unused moment), and its contents are its shape, which ``like`` gives back."""
    return jax.tree.map(lambda x: None if _is_empty(x) else x, tree)


def _refill(restored: Any, like: Any) -> Any:
    """:func:`_without_empty`'s inverse: zeros of ``like``'s shape, dtype and sharding where ``restored`` has None."""
    leaves, treedef = jax.tree.flatten(like)
    got = treedef.flatten_up_to(restored)

    def empty(x):
        z = np.zeros(x.shape, x.dtype)
        return jax.device_put(z, x.sharding) if getattr(x, "sharding", None) is not None else jnp.asarray(z)

    return treedef.unflatten([empty(x) if _is_empty(x) else r for x, r in zip(leaves, got)])


class Checkpointer(StepCheckpointer):
    """Step checkpoints of one run in ``directory`` (see the module docstring); ``keep``, ``run``, ``resume``,
    ``overwrite``, ``writer``: ``twincore.rundir.StepCheckpointer``'s (the writer is process 0, and orbax cleans on
    process 0 only)."""

    FRAMEWORK = "jax"

    def __init__(self, directory: str, keep: int = 3, **run_dir: Any):
        # the lock before orbax's manager deletes the temporary directories it finds (a live trainer's in-flight step)
        super().__init__(directory, keep, **run_dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,
            create=True,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
            step_prefix=STEP_PREFIX,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        except BaseException:
            self.run_dir.release()
            raise

    def path(self, step: int) -> str:
        """The folder of ``step``'s checkpoint."""
        return os.path.join(self.directory, f"{STEP_PREFIX}_{int(step)}")

    def save(self, step: int, tree: Any, meta: dict) -> None:
        step = int(step)
        if self.writer:
            self.run_dir.begin(step, [f"{STEP_PREFIX}_{step}"])
        try:
            self.manager.reload()
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(_without_empty(tree)), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            self.manager.wait_until_finished()
        except BaseException:
            if self.writer:
                self.run_dir.abort(step)
            raise
        if self.writer:
            self.run_dir.commit(step)
            self.run_dir.prune(self.keep)

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """``(tree, meta)`` of ``step``; ``like`` is a tree of the same structure (arrays or shape structs). An
        array stored in another shape of the same size and dtype (8-bit AdamW's moments, flat before they were held
        by row) is read as stored and reshaped to ``like``'s."""
        self.manager.reload()
        target = _abstract(_without_empty(like))
        stored = self._stored_shapes(int(step))
        reshaped = set()

        def as_stored(path, x):
            shape = stored.get(_path(path))
            if not isinstance(x, jax.ShapeDtypeStruct) or shape is None or shape == x.shape:
                return x
            if math.prod(shape) != math.prod(x.shape):
                return x  # orbax names the mismatch
            reshaped.add(_path(path))
            sh = x.sharding
            full = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec()) if hasattr(sh, "mesh") else sh
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=full)

        target = jax.tree_util.tree_map_with_path(as_stored, target)
        out = self.manager.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
        )
        state = out["state"]
        if reshaped:

            def back(path, x, want):
                if _path(path) not in reshaped:
                    return x
                y = jnp.reshape(x, want.shape)
                return jax.device_put(y, want.sharding) if getattr(want, "sharding", None) is not None else y

            state = jax.tree_util.tree_map_with_path(back, state, _abstract(_without_empty(like)))
        return _refill(state, like), out["meta"]

    def _stored_shapes(self, step: int) -> dict[tuple, tuple]:
        """``{path: shape}`` of the arrays ``step`` holds, from orbax's metadata ({} where it cannot be read)."""
        try:
            meta = ocp.StandardCheckpointer().metadata(os.path.join(self.path(step), "state"))
            tree = getattr(meta, "item_metadata", meta)  # orbax >= 0.11.x wraps the tree in a StepMetadata
            tree = getattr(tree, "tree", tree)
            leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
            return {_path(p): tuple(x.shape) for p, x in leaves if hasattr(x, "shape")}
        except Exception:  # an orbax without item metadata: restore as before
            return {}

    def close(self) -> None:
        """Close orbax's manager and let the directory's lock go."""
        try:
            self.manager.close()
        finally:
            super().close()
