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

import contextlib
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from twincore.atomic import atomic_path, temp_pid
from twincore.rundir import RunDir

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


class Checkpointer:
    """Step checkpoints of one run in ``directory``: ``run``, ``resume``, ``overwrite``, ``writer`` as in
    ``jaxattn.checkpoint.Checkpointer`` (the writer is rank 0)."""

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
        # the lock before anything is read (rank 0; held until close() or the end of locked())
        self.run_dir = RunDir(self.directory, "torch", run or {}, resume=resume, overwrite=overwrite, lock=writer)
        self.problems: list[str] = []

    def locked(self):
        return self.run_dir.locked() if self.writer else contextlib.nullcontext()

    def name(self, step: int) -> str:
        return f"{PREFIX}{int(step):08d}.pt"

    def path(self, step: int) -> str:
        return os.path.join(self.directory, self.name(step))

    def all_steps(self) -> list[int]:
        return self.run_dir.complete_steps()

    def latest_step(self) -> int | None:
        """The newest step of this run whose file matches its checksum (why newer ones did not: :attr:`problems`)."""
        step, self.problems = self.run_dir.latest_valid()
        return step

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

    def close(self) -> None:
        """Let the directory's lock go."""
        self.run_dir.release()
