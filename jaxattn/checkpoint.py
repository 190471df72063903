"""Training checkpoints for the JAX trainer with orbax (twin of ``torchref.checkpoint``).

    ckpt = Checkpointer("runs/a", keep=3)
    ckpt.save(step, {"train": state, "rng": key_data}, meta={"step": step, "data_position": step, ...})
    tree, meta = ckpt.restore(ckpt.latest_step(), like={"train": state, "rng": key_data})

What a checkpoint holds: the whole ``TrainState`` pytree (params, the model's other variables, the optax state,
the loss scale, the step), the root PRNG key data, and a JSON ``meta`` (step, data position, host RNG states,
the model config and the flags). orbax's ``CheckpointManager`` writes each step into a temporary directory,
finalises it and renames it to ``<step>/`` only when complete (the commit), so a kill during a write leaves the
previous checkpoints intact and the half-written one invisible (its temporary directory is removed by the next
manager). ``keep`` = ``max_to_keep``: orbax deletes only its own older step directories, never other files.
Saves are synchronous (the step waits for the write).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "ORBAX_VERSION"]

ORBAX_VERSION = getattr(ocp, "__version__", "unknown")


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) if hasattr(x, "shape") else x
        ),
        tree,
    )


class Checkpointer:
    """Step checkpoints in ``directory`` (orbax ``CheckpointManager``, items ``state`` and ``meta``)."""

    def __init__(self, directory: str, keep: int = 3):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1 (checkpoints to keep)")
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def save(self, step: int, tree: Any, meta: dict) -> None:
        self.manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """``(tree, meta)`` of ``step``; ``like`` is a tree of the same structure (arrays or shape structs)."""
        out = self.manager.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()),
        )
        return out["state"], out["meta"]

    def close(self) -> None:
        self.manager.close()
