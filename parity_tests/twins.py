"""Helpers for building the same model in both frameworks (imported by the parity tests)."""
from __future__ import annotations

import dataclasses

import numpy as np


def jax_config(tcfg):
    """The ``jaxattn.config.ModelConfig`` with the same field values as a ``torchref`` one."""
    from jaxattn.config import ModelConfig

    return ModelConfig(**{f.name: getattr(tcfg, f.name) for f in dataclasses.fields(tcfg)})


def twin_models(tcfg, seed: int = 0):
    """(torch model, jax model) holding identical fp32 weights drawn from ``seed``."""
    import torch

    from jaxattn import hf as jhf
    from torchref.model import LlamaForCausalLM

    torch.manual_seed(seed)
    tmodel = LlamaForCausalLM(tcfg).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a mixed-up norm weight is caught
        for name, p in tmodel.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    jmodel = jhf.from_state_dict(jax_config(tcfg), {k: v.numpy() for k, v in tmodel.state_dict().items()})
    return tmodel, jmodel


def layer_params(jmodel, i: int = 0) -> dict:
    """Layer ``i``'s parameters from the stacked JAX layers, as the dict ``decoder_layer`` takes."""
    from jaxattn.model import LAYER_PARAMS

    return {name: getattr(jmodel.layers, name)[...][i] for name in LAYER_PARAMS}


def tokens(rng: np.random.Generator, vocab: int, b: int, s: int) -> np.ndarray:
    return rng.integers(0, vocab, (b, s), dtype=np.int64)


def jitted(jmodel):
    """``f(tokens, positions=None, segment_ids=None)`` running ``jmodel`` as one jitted pure function."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(jmodel)
    fwd = jax.jit(lambda st, *args: nnx.merge(graphdef, st)(*args))
    return lambda *args: fwd(state, *args)
