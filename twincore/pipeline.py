"""Pipeline stages, framework-neutral: the schedule names, the split checks and the idle fraction, shared by
``jaxattn.pipeline`` and ``torchref.pipeline``.

    check_pipeline(n_layers=32, stages=8, batch=16, microbatches=8)   # ValueError naming the argument otherwise
    bubble_fraction(8, 8)                                             # 7 / 15; virtual=2: 7 / 23
"""

from __future__ import annotations

__all__ = ["JAX_SCHEDULES", "SCHEDULES", "bubble_fraction", "check_pipeline", "virtual_stages"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")  # torchref's (torch.distributed.pipelining)
JAX_SCHEDULES = ("gpipe", "interleaved")  # jaxattn's: interleaved is the circular schedule (jaxattn.pipeline)


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction per device: ``(p - 1) / (v m + p - 1)`` — GPipe (§2.2 of Huang et al.; 1F1B has the same) at
    ``v = 1``; with ``v`` virtual stages per device (interleaved 1F1B, Narayanan et al. 2021 §2.2; circular) each
    step is ``1 / v`` of a stage's layers."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def virtual_stages(schedule: str, virtual: int | None) -> int:
    """Virtual stages per device of ``schedule``: ``virtual`` (default 2) for ``interleaved``, else 1 (ValueError
    naming ``virtual`` when it is given for another schedule or is below 2)."""
    if schedule != "interleaved":
        if virtual not in (None, 1):
            raise ValueError(f"virtual={virtual!r}: virtual stages are the interleaved schedule's, not {schedule!r}")
        return 1
    v = 2 if virtual is None else virtual
    if not isinstance(v, int) or isinstance(v, bool) or v < 2:
        raise ValueError(f"virtual must be an int >= 2 for the interleaved schedule, got {v!r}")
    return v


def check_pipeline(
    n_layers: int, stages: int, batch: int, microbatches: int, schedule: str = "gpipe", virtual: int = 1
) -> None:
    """ValueError naming the argument when the layers do not split into ``stages * virtual`` equal stages, the batch
    into ``microbatches`` equal micro-batches, ``schedule`` is not one of :data:`SCHEDULES`, or an interleaved
    schedule has fewer micro-batches than stages (a micro-batch must be back at the first stage for its next round
    only after it has left the last)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, v in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if n_layers % (stages * virtual):
        what = f"{stages} equal stages" if virtual == 1 else f"{stages} stages x {virtual} virtual stages"
        raise ValueError(f"stages: {n_layers} layers do not split into {what}")
    if batch % microbatches:
        raise ValueError(f"microbatches: a batch of {batch} rows does not split into {microbatches} micro-batches")
    if virtual > 1 and microbatches < stages:
        raise ValueError(
            f"microbatches: the interleaved schedule needs at least as many micro-batches as stages "
            f"({microbatches} < {stages})"
        )
