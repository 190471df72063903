"""Per-device peak FLOP/s for MFU — the one lookup every suite uses.

The table itself is ``benchmarks.common.PEAK_BF16_TFLOPS`` (dense bf16 tensor-core peaks, no sparsity: H100 SXM
and H200 989 TF/s, A100 312 TF/s, ...); this module turns a device name into ``(peak FLOP/s or None, reason)``.
MFU is quoted against the dense bf16 peak whatever the run's precision (the usual convention: fp32 runs then
show how far they are from what the chip can do). A CPU or an unknown device has no peak: MFU is None and the
reason says why.

    peak, why = peak_flops("NVIDIA H100 80GB HBM3")   # (989e12, None)
    mfu(flops_per_token, tokens_per_s, peak)           # None when peak is None
"""
from __future__ import annotations

from typing import Optional

from .common import PEAK_BF16_TFLOPS, peak_tflops

__all__ = ["PEAK_BF16_TFLOPS", "peak_flops", "mfu"]


def peak_flops(device_name: Optional[str]) -> tuple[Optional[float], Optional[str]]:
    """``(dense bf16 peak in FLOP/s, None)`` for a known accelerator, else ``(None, reason)``."""
    name = device_name or ""
    if not name or name.lower().startswith("cpu"):
        return None, f"no peak FLOP/s for a CPU ({name or 'unknown'}): MFU not computed"
    tf = peak_tflops(name)
    if tf is None:
        return None, f"device {name!r} not in benchmarks.common.PEAK_BF16_TFLOPS: MFU not computed"
    return tf * 1e12, None


def mfu(flops_per_token: float, tokens_per_s: Optional[float], peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation = flops_per_token * tokens_per_s / peak (None without a peak or a rate)."""
    if not peak or not tokens_per_s:
        return None
    return flops_per_token * tokens_per_s / peak
