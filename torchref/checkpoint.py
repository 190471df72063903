"""Training checkpoints for the torch trainer with ``torch.save`` (twin of ``jaxattn.checkpoint``).

    ckpt = Checkpointer("runs/a", keep=3)
    ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), ..., "meta": {...}})
    payload = ckpt.load(ckpt.latest_step())

One file per step, ``torchref-step-<8 digits>.pt``, holding what the trainer passes: model, optimizer,
scheduler and GradScaler state dicts, RNG states, and a ``meta`` dict (step, data position, config, flags).
Crash safety: the payload goes to a temporary name in the same directory (``.torchref-step-N.pt.tmp-<pid>-<hex>``),
is fsynced, then atomically renamed (``os.replace``) and the directory fsynced; a kill at any instant leaves the
previous checkpoints whole and the new one either complete or absent. ``keep``: only files matching OUR names
are ever deleted (older steps beyond ``keep``, and temporary files of processes that no longer run); other
files in the directory are left alone. Files are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from jaxattn.spec.atomic import atomic_path, temp_pid

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
    """Step checkpoints in ``directory`` (created if needed)."""

    def __init__(self, directory: str, keep: int = 3):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1 (checkpoints to keep)")
        self.directory = os.path.abspath(directory)
        self.keep = keep

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"{PREFIX}{int(step):08d}.pt")

    def all_steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for m in map(_FINAL.fullmatch, os.listdir(self.directory)) if m)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, payload: dict[str, Any]) -> str:
        os.makedirs(self.directory, exist_ok=True)
        final = self.path(step)
        with atomic_path(final) as tmp, open(tmp, "wb") as f:  # then fsync + os.replace: the commit
            torch.save(payload, f)
        self._prune()
        return final

    def _prune(self) -> None:
        for step in self.all_steps()[: -self.keep]:
            os.unlink(self.path(step))
        for name in os.listdir(self.directory):
            pid = temp_pid(name, _FINAL.pattern)
            if pid is not None and pid != os.getpid() and not _alive(pid):
                os.unlink(os.path.join(self.directory, name))

    def load(self, step: int, map_location: Any = "cpu") -> dict[str, Any]:
        path = self.path(step)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory!r} (have steps {self.all_steps()})"
            )
        return torch.load(path, map_location=map_location, weights_only=True)

    def close(self) -> None:
        pass
