"""Pipeline stages, framework-neutral: the schedule names, the split checks and GPipe's idle fraction, shared by
``jaxattn.pipeline`` and ``torchref.pipeline``.

    check_pipeline(n_layers=32, stages=8, batch=16, microbatches=8)   # ValueError naming the argument otherwise
    bubble_fraction(8, 8)                                             # 7 / 15
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "bubble_fraction", "check_pipeline"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")  # torchref's; jaxattn runs gpipe


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's idle fraction per device: ``(p - 1) / (m + p - 1)`` (GPipe §2.2; 1F1B has the same bubble)."""
    return (stages - 1) / (microbatches + stages - 1)


def check_pipeline(n_layers: int, stages: int, batch: int, microbatches: int, schedule: str = "gpipe") -> None:
    """ValueError naming the argument when the layers do not split into ``stages`` equal stages, the batch into
    ``microbatches`` equal micro-batches, or ``schedule`` is not one of :data:`SCHEDULES`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, v in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if n_layers % stages:
        raise ValueError(f"stages: {n_layers} layers do not split into {stages} equal stages")
    if batch % microbatches:
        raise ValueError(f"microbatches: a batch of {batch} rows does not split into {microbatches} micro-batches")
