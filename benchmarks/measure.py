"""Measuring on this machine: synchronized timing, peak memory, FLOPs of attention, device and environment.

    t = timeit(fn, x, warmup=3, iters=20)     # {"median_s", "p10_s", "p90_s", "iters"} (twincore.timing)
    pair = timeit_paired({"jax": f, "torch": g})   # interleaved rounds, {"jax": {...}, "torch": {...}, "paired": ...}

The loop and statistics are ``twincore.timing``'s, the synchronisation and peak memory ``jaxattn.profiling``
/ ``torchref.profiling``'s, so trainers and benchmarks time alike (design §9; see benchmarks/NOTES.md).
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from twincore.timing import paired_ratio, time_calls, time_interleaved

_ROWS: list | None = None  # the running suite's record list (records.LiveRows), set by `python -m benchmarks run`


def rows() -> list:
    """The list a suite appends its records to: under ``python -m benchmarks run`` the run's
    ``report.records.LiveRows`` (the suite's JSON rewritten after every row, one progress line each), else a
    plain list (a suite called from a test or a tool)."""
    global _ROWS
    sink, _ROWS = _ROWS, None  # taken once: a suite calling another suite's run() gets a plain list
    return sink if sink is not None else []


def sync(out: Any = None) -> None:
    """Wait for the device work behind ``out`` with the framework that made it: jax arrays in ``out`` (any pytree)
    with ``jaxattn.profiling.synchronize`` (their own readiness), torch tensors with ``torchref.profiling``'s
    (``torch.cuda.synchronize``); ``out`` holding neither (None, a number) is torch's (its queued work has no
    handle). A jax result is not also waited for by torch: ``cudaDeviceSynchronize`` after jax's wait is one more
    host round trip charged to every JAX row of a cross-framework run (the kernel_profile ladder's
    ``jax:dot:both`` measures it). A framework that is not imported is not touched."""
    jax, torch = sys.modules.get("jax"), sys.modules.get("torch")
    leaves = jax.tree.leaves(out) if jax is not None else [out]
    jax_out = jax is not None and any(isinstance(x, jax.Array) for x in leaves)
    if jax_out:
        from jaxattn.profiling import synchronize as jax_sync

        jax_sync(out)
    if torch is not None and (not jax_out or any(isinstance(x, torch.Tensor) for x in leaves)):
        from torchref.profiling import synchronize as torch_sync

        torch_sync(out)


def timeit(fn: Callable, *args, warmup: int = 3, iters: int = 20, **kwargs) -> dict:
    """Median wall time of ``fn(*args, **kwargs)`` over ``iters`` synchronized calls after ``warmup`` calls
    (``twincore.timing.time_calls``, the loop both profiling modules use, closed by :func:`sync`)."""
    return time_calls(fn, *args, warmup=warmup, iters=iters, sync=sync, **kwargs)


def timeit_paired(calls: dict, *, rounds: int = 10, per_round: int = 3, warmup: int = 3) -> dict:
    """JAX and torch (``calls = {"jax": f, "torch": g}``, zero-argument callables) timed alternately in rounds
    (``twincore.timing.time_interleaved``, closed by :func:`sync`): ``{"jax": stats, "torch": stats, "paired":
    paired_ratio(torch rounds / jax rounds)}``, the paired ratio being the JAX speed-up with its interval."""
    if set(calls) != {"jax", "torch"}:
        raise ValueError(f"timeit_paired: calls must be {{'jax': ..., 'torch': ...}}, got {sorted(calls)}")
    t = time_interleaved(calls, rounds=rounds, per_round=per_round, warmup=warmup, sync=sync)
    paired = paired_ratio(t["torch"]["rounds"], t["jax"]["rounds"], cv=(t["jax"]["cv"], t["torch"]["cv"]))
    return {**t, "paired": paired}


def checked_pair(calls: dict, new: str, base: str, tol: float, *, rounds: int, per_round: int, warmup: int):
    """Two ways of one computation (``calls = {base: f, new: g}``, zero-argument callables returning arrays or
    tensors) checked first to give the same output within ``tol`` (absolute), then timed interleaved (closed by
    :func:`sync`): ``(times, paired_ratio(new rounds / base rounds))``."""
    import numpy as np

    first = {}
    for name, call in calls.items():
        out = call()
        first[name] = out.detach().cpu().numpy() if hasattr(out, "detach") else np.asarray(out)
    np.testing.assert_allclose(first[new], first[base], atol=tol, rtol=0, err_msg=f"{new} != {base}")
    times = time_interleaved(calls, rounds=rounds, per_round=per_round, warmup=warmup, sync=sync)
    return times, paired_ratio(times[new]["rounds"], times[base]["rounds"], cv=[t["cv"] for t in times.values()])


def print_paired(times: dict, ratio: dict, label: str, digits: int = 1, extra: dict | None = None) -> None:
    """A paired timing's lines as the tools print them: each call's median and 10th-90th percentile in ms (``times``:
    ``time_interleaved``'s; ``extra[name]``: text appended to that call's line), then ``label``'s per-round ratio
    (``paired_ratio``'s) with its 95% interval, flagged UNSTABLE when its interval is wide."""
    import numpy as np

    for name, t in times.items():
        lo, mid, hi = np.percentile(np.asarray(t["calls"]) * 1e3, [10, 50, 90])
        tail = (extra or {}).get(name, "")
        print(f"  {name}: median {mid:.{digits}f} ms, p10-p90 {lo:.{digits}f}-{hi:.{digits}f} ms{tail}")
    flag = f" UNSTABLE ({ratio['why']})" if ratio["unstable"] else ""
    lo, hi = ratio["ci"]
    print(f"  {label} per round: median {ratio['ratio']:.3f}, 95% interval {lo:.3f}-{hi:.3f}{flag}")


def write_record(out: str | None, name: str, res: dict) -> None:
    """``res`` as ``out/name`` (indented JSON; the folder made if needed), when ``out`` is given."""
    if out:
        import json

        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            json.dump(res, f, indent=1)


def threads() -> dict:
    """The thread settings a CPU timing depends on: torch's intra-/inter-op pools, the CPU count, and the XLA
    flags (XLA's CPU client sizes its pool from the CPU count unless XLA_FLAGS says otherwise)."""
    out = {"cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if "torch" in sys.modules:
        import torch

        out["torch_intra_op"] = torch.get_num_threads()
        out["torch_inter_op"] = torch.get_num_interop_threads()
    return out


def jax_device_name() -> str:
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        return f"cpu ({platform.processor() or platform.machine()})"
    return getattr(d, "device_kind", d.platform)


def jax_peak_memory() -> int | None:
    """Peak bytes in use on the first jax device since start (None where the backend keeps no stats, e.g. CPU)."""
    from jaxattn.profiling import peak_memory_bytes

    return peak_memory_bytes(host_fallback=False)


def jax_compiled_memory(fn: Callable, *args) -> int | None:
    """Bytes XLA assigns to jitted ``fn`` at ``args`` (arguments + outputs + temporaries - aliased), or None."""
    from jaxattn.profiling import compiled_memory

    try:
        ma = compiled_memory(fn, *args)
    except Exception:  # a backend that cannot analyse (or lower) this function: no number, not a failure
        return None
    return None if ma is None else ma["total"]


def torch_reset_peak() -> None:
    from torchref.profiling import reset_peak_memory

    reset_peak_memory()


def torch_peak_memory() -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last :func:`torch_reset_peak` (None on CPU)."""
    from torchref.profiling import peak_memory_bytes

    return peak_memory_bytes(host_fallback=False)


def env_info() -> dict:
    """Device name, host and library versions for a result file."""
    info = {
        "python": platform.python_version(),
        "host": platform.node(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg": list(os.getloadavg()),  # 1, 5, 15 min, when the record was made
    }
    for mod in ("jax", "jaxlib", "flax", "optax", "torch", "triton", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # not installed
            info[mod] = None
    try:
        info["jax_device"] = jax_device_name()
        import jax

        info["jax_backend"] = jax.default_backend()
    except Exception as e:  # pragma: no cover
        info["jax_device"] = f"unavailable: {e}"
    try:
        import torch

        info["torch_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:
        info["torch_device"] = None
    info.update(cudnn_versions())
    info["threads"] = threads()
    return info


def cudnn_versions() -> dict:
    """The cuDNN each framework loads (``91000`` = 9.10.0; None where it has none): the same library reached
    from both sides measured 0.60x apart on an H200, and its version is the first thing to compare."""
    out = {}
    try:
        from jaxattn.attention.cudnn import cudnn_version

        out["cudnn_jax"] = cudnn_version()
    except Exception:  # noqa: BLE001 - jax absent or moved: not known
        out["cudnn_jax"] = None
    try:
        import torch

        out["cudnn_torch"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001
        out["cudnn_torch"] = None
    return out


def device_slug(info: dict) -> str:
    """The results directory name of a device: ``"cpu"`` for any CPU, else the device name made path-safe."""
    name = info.get("jax_device") or "unknown"
    name = "cpu" if name.startswith("cpu") else name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-").lower()
