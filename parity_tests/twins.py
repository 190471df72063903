"""Test helpers: the twin builder (``benchmarks.twins``, shared with the benchmarks) plus test-only helpers."""
from __future__ import annotations

import numpy as np

from benchmarks.twins import jax_config, jitted, twin_models

__all__ = ["jax_config", "jitted", "twin_models", "layer_params", "tokens"]


def layer_params(jmodel, i: int = 0) -> dict:
    """Layer ``i``'s parameters from the stacked JAX layers, as the dict ``decoder_layer`` takes."""
    from jaxattn.model import LAYER_PARAMS

    return {name: getattr(jmodel.layers, name)[...][i] for name in LAYER_PARAMS}


def tokens(rng: np.random.Generator, vocab: int, b: int, s: int) -> np.ndarray:
    return rng.integers(0, vocab, (b, s), dtype=np.int64)
