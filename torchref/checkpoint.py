"""Training checkpoints for the torch trainer with ``torch.save``, in a run directory of ``twincore.rundir``
(twin of ``jaxattn.checkpoint``).

    ckpt = Checkpointer("runs/a", keep=3, run={"seed": 0, ...})
    ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), ..., "meta": {...}})
    payload = ckpt.load(ckpt.latest_step())

One file per step, ``torchref-step-<8 digits>.pt`` (model, optimizer, scheduler, GradScaler, RNG states, ``meta``),
written to a temporary name, fsynced and renamed (``twincore.atomic``): a kill leaves the previous steps whole. The run
marker records each step before it is written and its sha256 after, so ``keep`` deletes only this run's steps
(and temporary files of processes that no longer run), :meth:`latest_step` is the newest step whose checksum
matches, and a corrupt file is never unpickled. Files are loaded with ``weights_only=True``."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from twincore.atomic import atomic_path, temp_pid
from twincore.rundir import StepCheckpointer

__all__ = ["Checkpointer", "PREFIX"]

PREFIX = "torchref-step-"
_FINAL = re.compile(rf"{PREFIX}(\d{{8}})\.pt")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Checkpointer(StepCheckpointer):
    """Step checkpoints of one run in ``directory``: ``keep``, ``run``, ``resume``, ``overwrite``, ``writer`` are
    ``twincore.rundir.StepCheckpointer``'s (the writer is rank 0)."""

    FRAMEWORK = "torch"

    def name(self, step: int) -> str:
        return f"{PREFIX}{int(step):08d}.pt"

    def path(self, step: int) -> str:
        return os.path.join(self.directory, self.name(step))

    def save(self, step: int, payload: dict[str, Any]) -> str:
        self.run_dir.begin(step, [self.name(step)])
        final = self.path(step)
        try:
            with atomic_path(final) as tmp, open(tmp, "wb") as f:  # then fsync + os.replace: the commit
                torch.save(payload, f)
        except BaseException:
            self.run_dir.abort(step)
            raise
        self.run_dir.commit(step)
        self.run_dir.prune(self.keep)
        self._prune_temps()
        return final

    def _prune_temps(self) -> None:
        for name in os.listdir(self.directory):
            pid = temp_pid(name, _FINAL.pattern)
            if pid is not None and pid != os.getpid() and not _alive(pid):
                os.unlink(os.path.join(self.directory, name))

    def load(self, step: int, map_location: Any = "cpu") -> dict[str, Any]:
        why = self.run_dir.verify(step)
        if why is not None:
            raise FileNotFoundError(
                f"no valid checkpoint for step {step} in {self.directory!r}: {why} (valid steps {self.all_steps()})"
            )
        return torch.load(self.path(step), map_location=map_location, weights_only=True)
