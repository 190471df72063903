"""Seeding for the JAX trainer (twin of ``torchref.seed``): one root PRNG key split by purpose.

    keys = seed_all(0)          # {"params": key, "data": key, "dropout": key}; numpy and random seeded too
    model = Llama(config, rngs=nnx.Rngs(params=keys["params"]))

JAX randomness is explicit, so "determinism" is: the same seed gives the same keys, the same data order
(``twincore.data`` seeds its own numpy Generators from the seed) and the same compiled program, hence the
same per-step losses on the same machine. ``deterministic=True`` also asks XLA for deterministic GPU
reductions (``--xla_gpu_deterministic_ops``, read when the backend starts: call this before the first jax op);
CPU XLA is deterministic already.
"""

from __future__ import annotations

import os
import random

import numpy as np

from twincore.seed import check_seed, host_rng_state, set_host_rng_state

__all__ = ["PURPOSES", "seed_all", "host_rng_state", "set_host_rng_state"]

PURPOSES = ("params", "data", "dropout")


def seed_all(seed: int, deterministic: bool = False) -> dict:
    """Seed ``random`` and numpy's global RNG, and return ``{purpose: key}`` split from ``jax.random.key(seed)``."""
    seed = check_seed(seed)
    if deterministic and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    import jax

    random.seed(int(seed))
    np.random.seed(int(seed))
    keys = jax.random.split(jax.random.key(int(seed)), len(PURPOSES))
    return dict(zip(PURPOSES, keys))
