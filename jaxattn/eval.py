"""Perplexity of a checkpoint in JAX: ``python -m jaxattn.eval`` and :func:`evaluate` (twin of ``torchref.eval``).

    python -m jaxattn.eval --init ckpt --data notes.txt [--seq-len 128 --batch-size 8 --dtype bf16]
    result = evaluate(model, eval_batches(docs, seq_len=128, batch_size=8, vocab_size=256))
    result.loss, result.perplexity                    # mean token loss (nats), exp of it

The batches and the result are ``twincore.eval``'s (each token but a document's first scored once). One jitted
pure function of ``(params, rest, batch)`` sums the next-token cross-entropy (``train_step.loss_fn``, denominator 1)
and counts the targets; the host adds the per-batch sums in float64. Under a precision policy the float32 masters
are cast to the compute dtype inside, as in the train step. The trainer's ``--eval-data`` uses
:func:`make_eval_step` on its own state (and mesh).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twincore.eval import EvalResult, eval_batches, eval_cli

from . import hf
from .precision import Policy, get_policy
from .train_step import loss_fn, loss_weights

__all__ = ["EvalResult", "eval_batches", "make_eval_step", "evaluate", "run_eval", "main"]

PROG = "python -m jaxattn.eval"


def make_eval_step(graphdef: nnx.GraphDef, *, policy: str | Policy | None = None, sharding=None) -> Callable:
    """``sums(params, rest, batch) -> (loss_sum, targets)``, float32 0-d arrays: the summed next-token loss and the
    number of scored targets of one batch. ``policy``: a precision policy whose compute dtype the params are cast
    to (None: computed in the params' own dtype). ``sharding``: the train step's ``jaxattn.sharding.TrainSharding``
    (the results come back replicated and the model's activation constraints apply while it traces)."""
    policy = None if policy is None else get_policy(policy)

    def pure(params, rest, batch):
        model = nnx.merge(graphdef, params if policy is None else policy.cast_to_compute(params), rest)
        return loss_fn(model, batch, denominator=jnp.float32(1.0)), jnp.sum(loss_weights(batch))

    if sharding is None:
        jitted, tracing = jax.jit(pure), contextlib.nullcontext
    else:
        replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        jitted, tracing = jax.jit(pure, out_shardings=(replicated, replicated)), sharding.tracing

    def sums(params, rest, batch):
        with tracing():
            return jitted(params, rest, batch)

    sums.jitted = jitted
    return sums


def run_eval(sums: Callable, params, rest, batches: Iterable[Mapping[str, np.ndarray]], place=None) -> EvalResult:
    """:class:`EvalResult` of ``sums`` (:func:`make_eval_step`) over host ``batches``, each moved by ``place``
    (default ``jax.device_put``); every batch is dispatched before the first result is read."""
    place = jax.device_put if place is None else place
    out = [sums(params, rest, place(b)) for b in batches]
    host = np.asarray(jax.device_get(out), np.float64).reshape(-1, 2)
    return EvalResult(loss_sum=float(host[:, 0].sum()), tokens=int(round(host[:, 1].sum())))


def evaluate(model: nnx.Module, batches: Iterable[Mapping[str, np.ndarray]], *, policy=None) -> EvalResult:
    """Mean token loss and perplexity of ``model`` over ``batches`` (``twincore.eval.eval_batches``); ``policy``: see
    :func:`make_eval_step`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return run_eval(make_eval_step(graphdef, policy=policy), params, rest, batches)


def main(argv: Sequence[str] | None = None) -> int:
    return eval_cli(PROG, "jax", lambda args: hf.from_pretrained(args.init, dtype=args.dtype), evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
