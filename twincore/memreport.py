"""The text table of labelled memory snapshots that both ``MemoryTracker`` twins print (no jax, no torch).

print(format_memory_report([{"index": 0, "label": "init", "source": "host RSS", "host_peak_rss_bytes": 2**30}]))
"""

from __future__ import annotations

__all__ = ["format_memory_report"]


def _mib(x) -> str:
    return "" if x is None else f"{x / 2**20:.1f}"


def format_memory_report(snapshots: list[dict], title: str = "memory") -> str:
    """One line per snapshot, in the order taken: label, bytes in use, peak, compiled total, host peak RSS (MiB;
    blank where that source gave nothing) and the source the numbers came from."""
    lines = [
        title,
        f"{'#':>3}  {'label':<24}{'in use MiB':>12}{'peak MiB':>10}{'compiled MiB':>14}{'host RSS MiB':>14}  source",
    ]
    for s in snapshots:
        comp = (s.get("compiled") or {}).get("total")
        lines.append(
            f"{s['index']:>3}  {s['label']:<24}{_mib(s.get('bytes_in_use')):>12}"
            f"{_mib(s.get('peak_bytes')):>10}{_mib(comp):>14}{_mib(s.get('host_peak_rss_bytes')):>14}"
            f"  {s['source']}"
        )
    return "\n".join(lines)
