"""Compile for a TPU on a machine without one ("deviceless"): libtpu's topology descriptions of v5e / v5p / v6e
slices, and an ahead-of-time compile for their chips, the TPU twin of :mod:`jaxattn.gpu_target`.

    from jaxattn import tpu_target
    devs = tpu_target.devices("v5e")                       # 4 "TPU v5 lite" chips (a 2x2 host), no TPU needed
    q = tpu_target.place(jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16), devs[:1])
    lowered, compiled = tpu_target.compile(f, q, k, v)     # f's attention picks splash (Mosaic TPU kernels)

Needs the ``tpu-compile`` extra (``libtpu`` at the version the installed jax names; :func:`unavailable_reason`
says what is missing). ``jax.experimental.topologies.get_topology_desc`` builds the chips from a topology name
(``"v5p:4x4x4"``: 64 chips); inputs placed with a ``NamedSharding`` carry the TPU device kind into the trace, so
:func:`jaxattn.attention.current_target` sees a TPU, and :func:`compile` also enters ``target_platform("tpu")``.
libtpu prints a few lines about the missing accelerator environment when it builds a topology: harmless here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
from collections.abc import Callable
from typing import Any

import jax

from twincore.packages import installed_version as _version  # module-level: tests monkeypatch it

from .gpu_target import mesh, place  # framework-neutral: a Mesh of any devices, ShapeDtypeStructs placed on it

__all__ = ["CHIPS", "Chip", "unavailable_reason", "devices", "mesh", "place", "compile", "refused_for_memory"]

# libtpu's refusal of a program larger than the chip: "... HLO temporaries (40.60G) exceeds available HBM (15.75G)"
_OOM = re.compile(r"memory required for HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation: its topology name prefix, the smallest host topology, HBM per chip, jax's device kind."""

    name: str
    prefix: str
    host: str
    hbm_gib: float
    device_kind: str

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)


# Public figures (Cloud TPU documentation): HBM per chip. The host topology is libtpu's smallest valid one.
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "v5e", "2x2", 16, "TPU v5 lite"),
    "v5p": Chip("v5p", "v5p", "2x2x1", 95, "TPU v5"),
    "v6e": Chip("v6e", "v6e", "2x2", 32, "TPU v6 lite"),
}


def _libtpu_wanted() -> str | None:
    """The libtpu requirement the installed jax's ``tpu`` extra names (``"==0.0.42.*"``), None if it names none."""
    try:
        reqs = importlib.metadata.requires("jax") or []
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - jax is imported above
        return None
    for req in reqs:
        m = re.match(r"libtpu\s*([=<>!~][^;]*);.*extra\s*==\s*['\"]tpu['\"]", req)
        if m:
            return m.group(1).strip()
    return None


def unavailable_reason() -> str | None:
    """None when a deviceless TPU compile can work here, else why not (what to install): libtpu absent, or not the
    version the installed jax's ``tpu`` extra names (a jax upgrade moves both)."""
    have = _version("libtpu")
    fix = f"pip install 'jax[tpu]=={jax.__version__}'"
    if have is None:
        return f"libtpu is not installed (pip install -e '.[tpu-compile]', or jax[tpu] at the jax installed: {fix})"
    wanted = _libtpu_wanted()
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pragma: no cover - packaging comes with pip's tooling; without it the version goes unchecked
        SpecifierSet = None
    if wanted is not None and SpecifierSet is not None:
        if have not in SpecifierSet(wanted):
            return f"libtpu {have} is installed, jax {jax.__version__} wants libtpu{wanted} ({fix})"
    return None


@functools.cache
def _topology(name: str):
    from jax.experimental import topologies

    # Every jax process on a machine with libtpu starts a TPU client and holds /tmp/libtpu_lockfile while it lives,
    # so a second process (a pytest worker, a benchmark child) could not load libtpu for a topology: libtpu's own
    # switch lets it. Nothing here runs on a TPU, so two processes never share a chip.
    # Only while libtpu loads: a child process (a CLI, a test's subprocess) inheriting the switch would load libtpu
    # beside its parent too, and on a machine without a TPU chip libtpu's start prints errors (host bounds, worker
    # hostnames) where the held lock would have kept it quiet. The environment is left as it was found.
    before = dict(os.environ)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(name, "tpu")
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]


def devices(chip: str, topology: str | None = None) -> tuple[Any, ...]:
    """The chips of a TPU slice: ``chip`` in :data:`CHIPS`, ``topology`` its shape (``"4x4x4"``; default the
    smallest host, e.g. ``"2x2"``). Cached per slice."""
    if chip not in CHIPS:
        raise ValueError(f"chip must be one of {sorted(CHIPS)}, got {chip!r}")
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot compile for a TPU without one: {reason}")
    c = CHIPS[chip]
    return tuple(_topology(f"{c.prefix}:{topology or c.host}").devices)


def compile(fn: Callable | None, *args, jitted: Callable | None = None, compiler_options: dict | None = None):
    """Lower ``fn(*args)`` (or the already-jitted ``jitted``) for the TPU chips ``args`` are placed on (see
    :func:`place`) and compile it; returns ``(lowered, compiled)``. Attention inside traces for the TPU."""
    from jaxattn.attention import target_platform

    dev = next((getattr(x, "sharding", None) for x in jax.tree.leaves(args)), None)
    dev = next(iter(dev.device_set), None) if dev is not None else None
    if dev is None or getattr(dev, "platform", None) != "tpu":
        raise ValueError(
            "compile: place the arguments on TPU chips first (tpu_target.place(args, tpu_target.devices(...))); "
            f"found device {dev!r}"
        )
    f = jitted if jitted is not None else jax.jit(fn)
    with target_platform("tpu", device_kind=getattr(dev, "device_kind", None)):
        lowered = f.trace(*args).lower()
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    return lowered, compiled


def refused_for_memory(error: BaseException) -> tuple[float, float] | None:
    """``(temporaries GiB asked, HBM GiB available)`` when the TPU compiler refused a program for not fitting the
    chip (it does, where a GPU compile would just report the size), else None."""
    m = _OOM.search(str(error))
    return (float(m.group(1)), float(m.group(2))) if m else None
