"""Per-device peak FLOP/s for MFU: the dense bf16 tensor-core peaks and the lookup every suite uses.

    peak, why = peak_flops("NVIDIA H100 80GB HBM3")   # (989e12, None)
    mfu(flops_per_token, tokens_per_s, peak)           # None when peak is None

MFU is quoted against the dense bf16 peak whatever the run's precision (the usual convention); a CPU or an
unknown device has no peak: MFU is None and the reason says why.
"""

from __future__ import annotations

__all__ = ["PEAK_BF16_TFLOPS", "peak_tflops", "peak_flops", "mfu"]

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), keyed by a substring of the device name; for MFU.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "A10G": 70.0,
}


def peak_tflops(device_name: str) -> float | None:
    """The :data:`PEAK_BF16_TFLOPS` entry whose key the device name contains (first match), or None."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_name.lower():
            return value
    return None


def peak_flops(device_name: str | None) -> tuple[float | None, str | None]:
    """``(dense bf16 peak in FLOP/s, None)`` for a known accelerator, else ``(None, reason)``."""
    name = device_name or ""
    if not name or name.lower().startswith("cpu"):
        return None, f"no peak FLOP/s for a CPU ({name or 'unknown'}): MFU not computed"
    tf = peak_tflops(name)
    if tf is None:
        return None, f"device {name!r} not in benchmarks.suites.peaks.PEAK_BF16_TFLOPS: MFU not computed"
    return tf * 1e12, None


def mfu(flops_per_token: float, tokens_per_s: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation = flops_per_token * tokens_per_s / peak (None without a peak or a rate)."""
    if not peak or not tokens_per_s:
        return None
    return flops_per_token * tokens_per_s / peak
