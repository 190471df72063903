"""The same Llama in both frameworks (identical fp32 weights), for the parity tests and the benchmarks.

    tmodel, jmodel = twin_models(ModelConfig.preset("tiny"), seed=0)   # torchref / jaxattn models
    logits = jitted(jmodel)(jnp.asarray(tokens))                        # the JAX model as one jitted function

It lives here because it imports both frameworks: ``jaxattn`` may not import torch and ``torchref`` may import
only ``twincore``, and the benchmarks (an installed package) must not import ``parity_tests``, while the
tests can import ``benchmarks``. The torch model is built first and its state dict is handed to
``jaxattn.hf.from_state_dict``, so both sides hold the very same numbers.
"""

from __future__ import annotations

import dataclasses


def jax_config(tcfg):
    """The ``jaxattn.config.ModelConfig`` with the same field values as a ``torchref`` one."""
    from jaxattn.config import ModelConfig

    return ModelConfig(**{f.name: getattr(tcfg, f.name) for f in dataclasses.fields(tcfg)})


def twin_models(tcfg, seed: int = 0, *, perturb_norms: bool = True):
    """(torch model, jax model) holding identical fp32 weights drawn from ``seed`` (torch model on CPU, in eval
    mode). ``perturb_norms``: norm weights start at 1 and biases (Qwen2's) at 0; add 0.1 * N(0, 1) so a mixed-up
    norm weight or a dropped bias is caught."""
    import torch

    from jaxattn import hf as jhf
    from torchref.hf import to_state_dict
    from torchref.model import LlamaForCausalLM

    torch.manual_seed(seed)
    tmodel = LlamaForCausalLM(tcfg).eval()
    if perturb_norms:
        with torch.no_grad():
            for name, p in tmodel.named_parameters():
                if name.endswith(("norm.weight", ".bias")):
                    p.add_(0.1 * torch.randn_like(p))
    jmodel = jhf.from_state_dict(jax_config(tcfg), {k: v.numpy() for k, v in to_state_dict(tmodel).items()})
    return tmodel, jmodel


def jitted(jmodel):
    """``f(tokens, positions=None, segment_ids=None)`` running ``jmodel`` as one jitted pure function of its
    split state (flax's performance guide: no NNX graph traversal per call)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(jmodel)
    fwd = jax.jit(lambda st, *args: nnx.merge(graphdef, st)(*args))
    return lambda *args: fwd(state, *args)
