"""jaxattn: a Llama transformer in Flax NNX with our own Pallas attention kernels — the JAX twin of ``torchref``.

Public names are imported lazily so that ``import jaxattn`` is cheap and the framework-neutral helpers
(``jaxattn.hf_format``) can be used without initialising jax.
"""
from importlib import import_module

__version__ = "0.1.0"
_EXPORTS = {
    "ModelConfig": "config", "Llama": "model",
    "from_pretrained": "hf", "save_pretrained": "hf", "dot_product_attention": "attention",
    "attention_backend": "attention",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'jaxattn' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
