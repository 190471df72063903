"""Compile for an NVIDIA GPU on a machine without one ("deviceless"): the CUDA plugin check, the target's
devices built from a text-proto target description, and an ahead-of-time compile for them.

    from jaxattn import gpu_target
    devs = gpu_target.devices(open("benchmarks/targets/h100.txtpb").read())     # 1 "NVIDIA H100 80GB HBM3"
    q = gpu_target.place(jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16), devs)
    lowered, compiled = gpu_target.compile(f, q, k, v)      # f's attention picks the GPU path (flash = Triton)

Needs the ``gpu-compile`` extra (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at jaxlib's version, and a
``ptxas`` from the ``nvidia-cuda-nvcc-cu12`` wheel, which jax finds by itself); :func:`unavailable_reason`
says what is missing.  Inputs are placed with a ``NamedSharding`` over a ``Mesh`` of the target's devices:
jax then records the device kind on the traced values' types, so :func:`jaxattn.attention.current_target`
(the dispatcher, ``supports()``, ``interpret=None``) sees a GPU; :func:`compile` also enters
``jaxattn.attention.target_platform`` with the device's compute capability.  A ``SingleDeviceSharding``
would not do: inside a trace it carries no device.

The CUDA plugin refuses to start when no CUDA runtime is found unless ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is
set before jax starts its backends; :func:`devices` sets it and, when jax already started without it,
re-runs the plugin's registration (it failed before registering anything, so this is safe).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import jax

from twincore.packages import installed_version as _version  # module-level: tests monkeypatch it

__all__ = [
    "PLUGIN_DISTRIBUTIONS",
    "unavailable_reason",
    "devices",
    "mesh",
    "place",
    "compile",
    "compute_capability",
    "tool_path",
]

PLUGIN_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def unavailable_reason() -> str | None:
    """None when a deviceless CUDA compile can work here, else why not (what to install)."""
    jaxlib_version = _version("jaxlib")
    for dist in PLUGIN_DISTRIBUTIONS:
        got = _version(dist)
        if got is None:
            return (
                f"{dist} is not installed (pip install -e '.[gpu-compile]', or {dist}=={jaxlib_version} "
                f"to match jaxlib)"
            )
        if got != jaxlib_version:
            return f"{dist} {got} does not match jaxlib {jaxlib_version}: install {dist}=={jaxlib_version}"
    if tool_path("ptxas") is None:
        return "no ptxas found (pip install nvidia-cuda-nvcc-cu12, or put a CUDA ptxas on PATH)"
    return None


def tool_path(name: str) -> str | None:
    """Path of a CUDA tool (``ptxas``, ``cuobjdump``, ``nvdisasm``): from the NVIDIA pip wheels
    (``nvidia-cuda-nvcc-cu12`` -> ``nvidia/cuda_nvcc/bin``, ``nvidia-cuda-cuobjdump`` / ``-nvdisasm`` ->
    ``nvidia/cu13/bin``), else ``PATH``, else ``/usr/local/cuda/bin``; None when not found."""
    try:
        nvidia = importlib.import_module("nvidia")
        roots = [
            os.path.join(p, sub, "bin")
            for p in nvidia.__path__
            for sub in ("cuda_nvcc", "cu13", "cuda_cuobjdump", "cuda_nvdisasm")
        ]
    except ImportError:
        roots = []
    for root in roots:
        path = os.path.join(root, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")


def _register_cuda_plugin() -> None:
    os.environ.setdefault(_SKIP_CHECK, "1")
    from jax._src import xla_bridge as xb  # private: jax has no public "is this platform registered"

    xb._discover_and_register_pjrt_plugins()  # noqa: SLF001 - what jax does on first use
    if "cuda" in xb._topology_factories:  # noqa: SLF001
        return
    try:  # jax started its backends before the variable was set: the plugin bailed out before registering
        plugin = importlib.import_module("jax_plugins.xla_cuda12")
    except ImportError as e:
        raise RuntimeError(f"the CUDA PJRT plugin is not importable ({e}); {unavailable_reason()}") from e
    plugin.initialize()
    if "cuda" not in xb._topology_factories:  # noqa: SLF001
        raise RuntimeError("the CUDA PJRT plugin did not register (see the log above)")


@functools.lru_cache(maxsize=8)
def _devices(target_config: str, topology: str) -> tuple[Any, ...]:
    _register_cuda_plugin()
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("", "cuda", topology=topology, target_config=target_config)
    return tuple(topo.devices)


def devices(target_config: str, topology: str = "1x1x1") -> tuple[Any, ...]:
    """The devices of a deviceless GPU topology: ``target_config`` is the text of a
    ``stream_executor.GpuTargetConfigProto`` (e.g. ``benchmarks/targets/h100.txtpb``), ``topology``
    ``"slices x hosts x devices"`` (``"1x1x8"`` for 8 GPUs in one host).  Cached per (text, topology)."""
    if not isinstance(target_config, str) or "gpu_device_info" not in target_config:
        raise ValueError(
            "target_config must be the text of a GpuTargetConfigProto (with a gpu_device_info "
            f"block), got {type(target_config).__name__} {str(target_config)[:60]!r}"
        )
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot compile for a GPU without one: {reason}")
    return _devices(target_config, topology)


def compute_capability(device) -> tuple[int, int] | None:
    """``(major, minor)`` of a (possibly deviceless) GPU device, or None."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


def mesh(devs: Sequence[Any], axis_name: str = "d") -> jax.sharding.Mesh:
    """A 1-D ``Mesh`` over ``devs`` (deviceless or real)."""
    return jax.sharding.Mesh(list(devs), (axis_name,))


def place(tree, devs_or_sharding) -> Any:
    """``tree`` of arrays / ShapeDtypeStructs as ShapeDtypeStructs carrying a sharding: a given
    ``jax.sharding.Sharding``, or replicated (``P()``) over a 1-D mesh of the given devices."""
    if isinstance(devs_or_sharding, jax.sharding.Sharding):
        sharding = devs_or_sharding
    else:
        sharding = jax.sharding.NamedSharding(mesh(devs_or_sharding), jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _first_device(args) -> Any | None:
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            try:
                return next(iter(sharding.device_set))
            except Exception:  # pragma: no cover - an abstract sharding
                continue
    return None


def compile(
    fn: Callable,
    *args,
    jit_kwargs: dict | None = None,
    compiler_options: dict | None = None,
    jitted: Callable | None = None,
):
    """Lower ``fn(*args)`` for CUDA and compile it for the devices ``args`` are placed on (see :func:`place`);
    returns ``(lowered, compiled)``.  ``jitted``: an already-jitted function to use instead of
    ``jax.jit(fn, **jit_kwargs)``.  ``compiler_options``: XLA flags for this compile only, e.g.
    ``{"xla_dump_to": DIR}`` to get every kernel's PTX (``xla_dump_emitter_re`` is set to ``"ptx"`` with it
    unless given: jaxlib >= 0.11 dumps the PTX only for emitters that option matches; 0.10's dump is the same
    with or without it).  Attention inside traces for the GPU."""
    from jaxattn.attention import target_platform

    dev = _first_device(args)
    if dev is None or getattr(dev, "platform", None) != "gpu":
        raise ValueError(
            "compile: place the arguments on the target's devices first (gpu_target.place(args, "
            f"gpu_target.devices(...))); found device {dev!r}"
        )
    f = jitted if jitted is not None else jax.jit(fn, **(jit_kwargs or {}))
    with target_platform(
        "gpu", compute_capability=compute_capability(dev), device_kind=getattr(dev, "device_kind", None)
    ):
        lowered = f.trace(*args).lower(lowering_platforms=("cuda",))
    if compiler_options and "xla_dump_to" in compiler_options and "xla_dump_emitter_re" not in compiler_options:
        compiler_options = {**compiler_options, "xla_dump_emitter_re": "ptx"}
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    return lowered, compiled
