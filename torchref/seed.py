"""Seeding for the torch trainer (twin of ``jaxattn.seed``).

    seed_all(0, deterministic=True)     # random, numpy, torch CPU + every CUDA device; deterministic kernels
    state = rng_state(); ...; set_rng_state(state)     # what a checkpoint saves and a resume restores

``deterministic=True`` is ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic
implementation raises), ``cudnn.deterministic = True``, ``cudnn.benchmark = False`` and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (needed by cuBLAS for deterministic GEMMs, set before the first CUDA call).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from twincore.seed import check_seed, host_rng_state, set_host_rng_state

__all__ = ["seed_all", "rng_state", "set_rng_state"]


def seed_all(seed: int, deterministic: bool = False) -> None:
    """Seed ``random``, numpy, torch (CPU and all CUDA devices); optionally force deterministic algorithms."""
    seed = check_seed(seed)
    random.seed(int(seed))
    np.random.seed(int(seed))
    torch.manual_seed(int(seed))  # seeds every CUDA device too
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(int(seed))
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict:
    """Every RNG state a resumed run needs: torch CPU, each CUDA device, numpy, random."""
    state = {"torch": torch.get_rng_state(), **host_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    set_host_rng_state(state)
