"""Training checkpoints for the JAX trainer with orbax, in a run directory of ``twincore.rundir`` (twin of
``torchref.checkpoint``).

    ckpt = Checkpointer("runs/a", keep=3, run={"seed": 0, ...})
    ckpt.save(step, {"train": state, "rng": key_data}, meta={"step": step, "data_position": step, ...})
    tree, meta = ckpt.restore(ckpt.latest_step(), like={"train": state, "rng": key_data})

A checkpoint holds the whole ``TrainState`` pytree, the root PRNG key data and a JSON ``meta``, in ``step_<N>/``.
orbax writes it into a temporary directory and renames it when complete, so a kill leaves the previous steps whole.
orbax's own pruning and step discovery are off: the run marker (``twincore.rundir``) records each step before it is
written and its files' sha256 after, so ``keep`` deletes only steps this run wrote and :meth:`latest_step` is the
newest step whose checksums match (a corrupt one is skipped with a warning). Saves are synchronous. The writer holds
the directory's lock from construction (a directory in use is refused before orbax's manager is built) to
:meth:`close` or the end of :meth:`locked`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from twincore.rundir import RunDir

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


class Checkpointer:
    """Step checkpoints of one run in ``directory`` (see the module docstring). ``run``: the run-defining flags
    (``twincore.rundir.RUN_FLAGS``); ``resume``: continue the run recorded there (else a new run: another run's
    checkpoints are refused unless ``overwrite``); ``writer``: this process writes the marker (process 0)."""

    def __init__(
        self,
        directory: str,
        keep: int = 3,
        *,
        run: Mapping[str, Any] | None = None,
        resume: bool = False,
        overwrite: bool = False,
        writer: bool = True,
    ):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1 (checkpoints to keep)")
        self.directory, self.keep, self.writer = os.path.abspath(directory), keep, writer
        # the lock before anything is read, and before orbax's manager deletes the temporary directories it finds (a
        # live trainer's in-flight step): held until close() or the end of locked() (process 0 only: the others
        # share its run, and orbax cleans on process 0 only)
        self.run_dir = RunDir(self.directory, "jax", run or {}, resume=resume, overwrite=overwrite, lock=writer)
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
        self.problems: list[str] = []

    def locked(self):
        """The directory's lock (taken at construction) held for the block, released at its end (process 0 only)."""
        return self.run_dir.locked() if self.writer else contextlib.nullcontext()

    def latest_step(self) -> int | None:
        """The newest step of this run whose files match their checksums; why newer ones were skipped is in
        :attr:`problems`."""
        step, self.problems = self.run_dir.latest_valid()
        return step

    def path(self, step: int) -> str:
        """The folder of ``step``'s checkpoint."""
        return os.path.join(self.directory, f"{STEP_PREFIX}_{int(step)}")

    def all_steps(self) -> list[int]:
        return self.run_dir.complete_steps()

    def save(self, step: int, tree: Any, meta: dict) -> None:
        step = int(step)
        if self.writer:
            self.run_dir.begin(step, [f"{STEP_PREFIX}_{step}"])
        try:
            self.manager.reload()
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
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
        """``(tree, meta)`` of ``step``; ``like`` is a tree of the same structure (arrays or shape structs)."""
        self.manager.reload()
        out = self.manager.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()),
        )
        return out["state"], out["meta"]

    def close(self) -> None:
        """Close orbax's manager and let the directory's lock go."""
        try:
            self.manager.close()
        finally:
            self.run_dir.release()
