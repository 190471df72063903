"""Host RNG state (Python ``random`` and numpy's global RNG) as JSON-able lists, shared by both trainers'
checkpoints (numpy only).

    state = host_rng_state(); ...; set_host_rng_state(state)
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["host_rng_state", "set_host_rng_state", "check_seed"]


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return int(seed)


def host_rng_state() -> dict:
    """``random`` and numpy global RNG states as JSON-able lists."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(internal), gauss_next],
    }


def set_host_rng_state(state: dict) -> None:
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
