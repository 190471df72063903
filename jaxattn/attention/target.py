"""Where a traced attention call will run: the :class:`Target` (platform, GPU compute capability, device kind).

The dispatcher computes the target once per call (:func:`current_target`) and runs the chosen backend inside
``target_platform(<that target>)``, so every ``supports()`` and kernel reads the same :class:`Target` with one
context-variable lookup instead of inspecting the arrays again.  For compiling a GPU program on a CPU host::

    with target_platform("gpu", compute_capability=(9, 0)):      # an H100, ahead of time
        lowered = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax

__all__ = ["Target", "current_target", "gpu_compute_capability", "platform_of", "target_platform"]


# The target of a trace: where the traced computation will run.  Read, in order, from
#   1. an explicit ``target_platform(...)`` block (the only way to say "compile for an H100" when nothing in the
#      trace names a device, e.g. ``jit(f).lower(lowering_platforms=("cuda",))`` on a CPU host: jax 0.10/0.11
#      pass ``lowering_platforms`` to the lowering, after tracing, so a trace cannot read them);
#   2. the array itself: a committed array's devices, or the sharding jax records on its type
#      (``jax.typeof(x).sharding.mesh.abstract_device``: a ShapeDtypeStruct or array sharded over GPU devices,
#      including a deviceless H100 topology's, carries the platform and device kind into the trace);
#   3. the mesh set by ``jax.sharding.use_mesh`` / ``jax.set_mesh`` (its abstract device);
#   4. jax's default backend.
@dataclasses.dataclass(frozen=True)
class Target:
    """Where a trace will run: ``platform`` ("cpu", "gpu", "tpu"), the GPU's ``compute_capability``
    ``(major, minor)`` (None when unknown or not a GPU) and the ``device_kind`` string when known."""

    platform: str
    compute_capability: tuple[int, int] | None = None
    device_kind: str | None = None


_TARGET: contextvars.ContextVar = contextvars.ContextVar("jaxattn_attention_target", default=None)
_PLATFORMS = ("cpu", "gpu", "tpu")
# device_kind -> compute capability, for the trace-time case where only jax's AbstractDevice (platform and
# device kind, no compute capability) is known.  First matching substring wins.
_KIND_CC = (
    ("H100", (9, 0)),
    ("H200", (9, 0)),
    ("H800", (9, 0)),
    ("H20", (9, 0)),
    ("GH200", (9, 0)),
    ("B200", (10, 0)),
    ("B300", (10, 3)),
    ("GB200", (10, 0)),
    ("A100", (8, 0)),
    ("A800", (8, 0)),
    ("A10", (8, 6)),
    ("A40", (8, 6)),
    ("A6000", (8, 6)),
    ("L40", (8, 9)),
    ("L4", (8, 9)),
    ("RTX 6000 Ada", (8, 9)),
    ("V100", (7, 0)),
    ("T4", (7, 5)),
)


def _canonical_platform(plat: str) -> str:
    plat = str(plat).lower()
    return "gpu" if plat in ("gpu", "cuda", "rocm") else plat


def _parse_cc(cc) -> tuple[int, int] | None:
    if cc is None:
        return None
    if isinstance(cc, str):
        parts = cc.replace("sm_", "").rstrip("a").split(".")
        if len(parts) == 1 and parts[0].isdigit() and len(parts[0]) >= 2:  # "90" / "sm_90a"
            parts = [parts[0][:-1], parts[0][-1]]
        cc = tuple(parts)
    try:
        major, minor = (int(t) for t in tuple(cc)[:2])
    except (TypeError, ValueError):
        raise ValueError(
            f"compute_capability must be (major, minor) ints, 'major.minor' or 'sm_XY', got {cc!r}"
        ) from None
    return major, minor


def _cc_from_kind(kind: str | None) -> tuple[int, int] | None:
    if not kind:
        return None
    for key, cc in _KIND_CC:
        if key in kind:
            return cc
    return None


@contextlib.contextmanager
def target_platform(platform: str, *, compute_capability=None, device_kind: str | None = None) -> Iterator[Target]:
    """Within the block, every trace of an attention call targets ``platform`` ("cpu", "gpu"/"cuda",
    "tpu"), whatever jax's default backend is: the dispatcher's default order, each backend's
    ``supports()`` and the Pallas kernels' ``interpret=None`` follow it.  For compiling a GPU program on a
    CPU host ("deviceless", ahead of time)::

        with target_platform("gpu", compute_capability=(9, 0)):
            lowered = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))

    ``compute_capability``: ``(9, 0)``, ``"9.0"`` or ``"sm_90a"``; default: from ``device_kind`` when it
    names a known GPU, else unknown (backends that need it decline).  A ``contextvars.ContextVar``: per
    thread / asyncio task; nested blocks replace the outer target."""
    if not isinstance(platform, str) or _canonical_platform(platform) not in _PLATFORMS:
        raise ValueError(f"target_platform: platform must be one of {_PLATFORMS} (or 'cuda'), got {platform!r}")
    plat = _canonical_platform(platform)
    cc = _parse_cc(compute_capability)
    if plat != "gpu" and cc is not None:
        raise ValueError(f"target_platform: compute_capability is for platform 'gpu', got platform {platform!r}")
    if plat == "gpu" and cc is None:
        cc = _cc_from_kind(device_kind)
    token = _TARGET.set(Target(plat, cc, device_kind))
    try:
        with _jax_abstract_gpu(device_kind, cc) if plat == "gpu" else contextlib.nullcontext():
            yield _TARGET.get()
    finally:
        _TARGET.reset(token)


def _kind_for(cc: tuple[int, int] | None) -> str | None:
    for key, known in _KIND_CC:
        if known == cc:
            return f"NVIDIA {key}"
    return None


def _jax_abstract_gpu(device_kind: str | None, cc: tuple[int, int] | None):
    """jax >= 0.11 asks the GPU's properties when it lowers a Pallas Triton kernel, and on a CPU host it reads them
    from the abstract device of the mesh in context ("please specify an abstract GPU device using AbstractDevice",
    jax.sharding.use_abstract_mesh); jax 0.10 reads them lazily and ignores it.  A mesh with no axes carries the
    device without fixing a mesh size, so a sharded program inside (whose own mesh jax enters while lowering) is
    unaffected.  Nothing is entered when the mesh in context already names a device (a deviceless topology's)."""
    kind = device_kind or _kind_for(cc)
    sharding = jax.sharding
    if kind is None or not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        return contextlib.nullcontext()
    if getattr(sharding.get_abstract_mesh(), "abstract_device", None) is not None:
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    return sharding.use_abstract_mesh(sharding.AbstractMesh((), (), abstract_device=device))


def _device_target(dev) -> Target:
    plat = _canonical_platform(dev.platform)
    kind = getattr(dev, "device_kind", None)
    cc = None
    if plat == "gpu":
        try:
            cc = _parse_cc(getattr(dev, "compute_capability", None))
        except ValueError:
            cc = None
        cc = cc or _cc_from_kind(kind)
    return Target(plat, cc, kind)


def _abstract_device_target(mesh) -> Target | None:
    ad = getattr(mesh, "abstract_device", None)
    if ad is None:
        return None
    plat = _canonical_platform(ad.platform)
    kind = getattr(ad, "device_kind", None)
    return Target(plat, _cc_from_kind(kind) if plat == "gpu" else None, kind)


def _array_target(x) -> Target | None:
    try:  # a committed jax array; a tracer raises
        return _device_target(next(iter(x.devices())))
    except Exception:
        pass
    sharding = getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer) else None
    if sharding is not None:  # a ShapeDtypeStruct with a concrete sharding
        try:
            return _device_target(next(iter(sharding.device_set)))
        except Exception:
            pass
    try:  # inside a trace: the sharding recorded on the type (abstract mesh with an abstract device)
        typeof = getattr(jax, "typeof", None)
        aval = typeof(x) if typeof is not None else x.aval
        return _abstract_device_target(aval.sharding.mesh)
    except Exception:
        return None


def current_target(x=None) -> Target:
    """The :class:`Target` of a trace involving ``x`` (see the rule above this function)."""
    target = _TARGET.get()
    if target is not None:
        return target
    if x is not None:
        target = _array_target(x)
        if target is not None:
            return target
    try:
        target = _abstract_device_target(jax.sharding.get_abstract_mesh())
    except Exception:  # pragma: no cover - an older jax without get_abstract_mesh
        target = None
    if target is not None:
        return target
    plat = _canonical_platform(jax.default_backend())
    if plat != "gpu":
        return Target(plat)
    try:
        return _device_target(jax.devices()[0])
    except Exception:  # pragma: no cover
        return Target(plat)


def platform_of(x=None) -> str:
    """Platform ("cpu", "gpu", "tpu") the computation on ``x`` targets: an active :func:`target_platform`
    block, else ``x``'s devices or sharding, else the mesh in context, else jax's default backend.
    CUDA/ROCm are reported as "gpu"."""
    return current_target(x).platform


def gpu_compute_capability(x=None) -> tuple[int, int] | None:
    """``(major, minor)`` of the GPU the computation on ``x`` targets (same rule as :func:`platform_of`),
    or None when the target is not a GPU or its compute capability is unknown."""
    target = current_target(x)
    return target.compute_capability if target.platform == "gpu" else None
