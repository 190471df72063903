"""The training loss choice both twins share: ``dense`` (full logits, then cross-entropy) or ``fused`` (the LM head and
the cross-entropy in chunks of tokens: ``jaxattn/fused_ce.py``, ``torchref/fused_ce.py``).

    check_loss("fused", 1024)      # ValueError naming the argument otherwise
"""

from __future__ import annotations

__all__ = ["LOSSES", "DEFAULT_CHUNK", "check_loss"]

LOSSES = ("dense", "fused")
DEFAULT_CHUNK = 1024  # tokens per chunk: [1024, 128256] float32 logits = 0.5 GB for Llama 3's vocabulary


def check_loss(loss: str, chunk: int) -> None:
    """ValueError naming ``loss`` / ``loss_chunk`` and what is accepted."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))}, got {loss!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"loss_chunk must be a positive int (tokens per chunk), got {chunk!r}")
