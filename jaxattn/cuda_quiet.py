"""Keeps jax's start-up quiet on a machine without an NVIDIA driver when the CUDA plugin is installed.

    import jaxattn          # before jax: installs the hook (jaxattn/__init__.py calls install())
    import jax              # no "Could not find cuda drivers" lines, no "Jax plugin configuration error" traceback

The ``gpu-compile`` extra installs jax's CUDA plugin on CPU machines so that kernels compile for an H100 here.
Without a driver, every jax start then prints three to four C++ log lines ("Could not find cuda drivers on your
machine", each after "All log messages before absl::InitializeLog()...") while the plugin's libraries load, and a
20-line "Jax plugin configuration error" traceback when its CUDA version check fails. Neither jax nor absl offers
a switch for the first (they are logged before logging is configured), so this is log filtering, written by hand:

- only where it applies: the plugin is installed, no NVIDIA kernel driver is present (``/proc/driver/nvidia``),
  jax is not imported yet, and ``JAXATTN_CUDA_QUIET`` is not ``0``;
- ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` is set (unless already set): the version check has nothing to check
  without a driver, and the deviceless compile (``jaxattn.gpu_target``) needs the plugin started without it;
- while jax is imported and its plugins are registered (not started: ``jax.distributed.initialize`` may still
  follow), file descriptor 2 goes to a temporary file; afterwards every line but the known two is written back
  to stderr, in order.

The ``tpu-compile`` extra installs libtpu on machines without a TPU chip, so that programs compile for a TPU here.
jax then starts a TPU client on every first use, and libtpu prints its failed search for a TPU host ("Failed to
find host bounds", "unexpected worker hostname", a source location trace) unless another process holds its lock.
Where no TPU chip is visible (jax's own test, ``hardware_utils``), ``JAX_PLATFORMS`` is unset and
``JAX_FORCE_TPU_INIT`` is not set, the hook also replaces jax's ``tpu`` backend factory after the import by one that
fails at once, quietly (as the TPU backend's registration asks: ``jax.devices("tpu")`` then names the reason): that
backend could not start here, and the deviceless TPU compile (``jaxattn.tpu_target``) builds libtpu's topologies
without it.

``import jax`` in a program that does not import jaxattn first still prints the lines: install the extra in its
own virtual environment if that matters (the README says so).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile

__all__ = ["NOISE", "applies", "install", "filter_lines"]

# the lines the CUDA plugin's libraries log while loading without a driver
NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|\S+ \S+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.)$"
)
_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def applies() -> bool:
    """True where the quiet import is wanted: jax not imported, and a CUDA plugin installed without an NVIDIA driver
    or libtpu installed without a TPU chip."""
    if os.environ.get("JAXATTN_CUDA_QUIET") == "0" or "jax" in sys.modules:
        return False
    cuda = not os.path.exists("/proc/driver/nvidia") and any(importlib.util.find_spec(n) for n in _PLUGINS)
    return cuda or _absent_tpu()


def _absent_tpu() -> bool:
    """libtpu installed, no TPU chip visible, and nothing asks for the TPU backend anyway."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    return not any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))  # jax's hardware_utils looks there


def _no_tpu_chip():
    raise RuntimeError("no TPU chip on this machine (jaxattn.cuda_quiet did not start libtpu's client)")


def _drop_tpu_backend() -> None:
    """No TPU client where no TPU chip is (see the module docstring); checked again with jax's own chip count."""
    try:
        import dataclasses

        from jax._src import hardware_utils, xla_bridge

        factories = xla_bridge._backend_factories  # noqa: SLF001 - jax offers no switch but JAX_PLATFORMS
        if "tpu" in factories and hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
            factories["tpu"] = dataclasses.replace(factories["tpu"], factory=_no_tpu_chip, fail_quietly=True)
    except Exception:  # noqa: BLE001 - an API that moved: the backend starts, lines and all
        pass


def filter_lines(text: str) -> str:
    """``text`` without the :data:`NOISE` lines (the rest kept in order)."""
    return "".join(line for line in text.splitlines(keepends=True) if not NOISE.match(line.rstrip("\r\n")))


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                self.loader.exec_module(module)
                try:  # register the plugins now, inside the filter (registering starts no backend)
                    from jax._src import xla_bridge

                    xla_bridge._discover_and_register_pjrt_plugins()  # noqa: SLF001 - what jax does on first use
                except Exception:  # noqa: BLE001 - an API that moved: jax registers them later, lines and all
                    pass
                if _absent_tpu():
                    _drop_tpu_backend()
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                rest = filter_lines(captured.read().decode("utf-8", "replace"))
                if rest:
                    sys.stderr.write(rest)
                    sys.stderr.flush()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)  # once: the real finders locate jax, we only wrap its loader
        spec = importlib.util.find_spec("jax")
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> bool:
    """Installs the filter for the coming ``import jax`` where :func:`applies`; True if installed."""
    if not applies() or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    sys.meta_path.insert(0, _Finder())
    return True
