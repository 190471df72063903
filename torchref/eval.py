"""Perplexity of a checkpoint in PyTorch: ``python -m torchref.eval`` and :func:`evaluate` (twin of ``jaxattn.eval``).

    python -m torchref.eval --init ckpt --data notes.txt [--seq-len 128 --batch-size 8 --dtype bf16]
    result = evaluate(model, eval_batches(docs, seq_len=128, batch_size=8, vocab_size=256))
    result.loss, result.perplexity                    # mean token loss (nats), exp of it

The batches and the result are ``twincore.eval``'s (each token but a document's first scored once). Under
``torch.no_grad`` (and the policy's autocast, if one is given) each batch's next-token cross-entropy is summed
(``train_step.loss_fn``, denominator 1) and its targets counted; the host adds the sums in float64. The trainer's
``--eval-data`` calls :func:`eval_sums` on its own model (each ``--parallel`` rank on its rows, then summed).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from twincore.eval import EvalResult, eval_batches, eval_cli

from . import hf
from .precision import Policy
from .train_step import loss_fn, loss_weights

__all__ = ["EvalResult", "eval_batches", "eval_sums", "evaluate", "main"]

PROG = "python -m torchref.eval"


@torch.no_grad()
def eval_sums(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], *, policy: str | Policy | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, targets)``, float32 0-d tensors: the summed next-token loss and the number of scored targets of
    one batch (on the model's device). ``policy``: a precision policy whose autocast the forward runs under (None:
    the weights' own dtype)."""
    loss = loss_fn(model, batch, policy="fp32" if policy is None else policy, denominator=torch.tensor(1.0))
    return loss, loss_weights(batch).sum()


def _to(batch: Mapping[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.asarray(v)).to(device) for k, v in batch.items()}


def evaluate(
    model: torch.nn.Module, batches: Iterable[Mapping[str, np.ndarray]], *, policy: str | Policy | None = None
) -> EvalResult:
    """Mean token loss and perplexity of ``model`` over host ``batches`` (``twincore.eval.eval_batches``); ``policy``:
    see :func:`eval_sums`."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = [torch.stack(eval_sums(model, _to(b, device), policy=policy)) for b in batches]
    finally:
        model.train(was_training)
    host = torch.stack(out).double().cpu().numpy()
    return EvalResult(loss_sum=float(host[:, 0].sum()), tokens=int(round(host[:, 1].sum())))


def _load(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return hf.from_pretrained(args.init, dtype=args.dtype).to(device)


def main(argv: Sequence[str] | None = None) -> int:
    return eval_cli(PROG, "torch", _load, evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
