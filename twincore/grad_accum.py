"""Gradient-accumulation argument rules, shared by both train steps (``make_train_step(..., grad_accum=k)``).

    from twincore.grad_accum import check_accum_batch
    check_accum_batch({"tokens": np.zeros((8, 17), np.int32)}, 4)    # -> 2 rows per microbatch

Reads only ``batch['tokens'].shape``, so numpy, jax (tracers too) and torch batches all work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_grad_accum(grad_accum: object) -> int:
    """``grad_accum`` if it is an int >= 1, else a TypeError / ValueError naming it."""
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int):
        raise TypeError(
            f"grad_accum must be an int >= 1 (microbatches per step), got {grad_accum!r} ({type(grad_accum).__name__})"
        )
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1 (microbatches per step), got {grad_accum}")
    return grad_accum


def check_accum_batch(batch: Mapping[str, Any], grad_accum: int) -> int:
    """The microbatch size ``B // grad_accum``; ValueError naming grad_accum and the batch size when
    ``grad_accum`` does not divide the batch ``B = batch['tokens'].shape[0]``."""
    n = int(batch["tokens"].shape[0])
    if n % grad_accum:
        raise ValueError(
            f"grad_accum={grad_accum} does not divide the batch size {n} (batch['tokens'] has shape "
            f"{tuple(batch['tokens'].shape)}); pass a batch of grad_accum * microbatch rows"
        )
    return n // grad_accum
