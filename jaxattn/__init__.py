"""jaxattn: a Llama transformer in Flax NNX with our own Pallas attention kernels — the JAX twin of ``torchref``.

Public names and submodules are imported lazily, so ``import jaxattn`` is cheap. The framework-neutral core both
twins share is the top-level package ``twincore``; ``torchref`` imports that, never this package.
"""

from importlib import import_module

from . import cuda_quiet

cuda_quiet.install()  # before the first `import jax`: a CPU machine with the CUDA plugin starts quietly

__version__ = "0.1.0"
_EXPORTS = {
    "ModelConfig": "config",
    "Llama": "model",
    "LlamaForCausalLM": "model",  # the same class under Hugging Face's (and torchref's) name
    "from_pretrained": "hf",
    "save_pretrained": "hf",
    "from_gguf": "hf",
    "load_tokenizer": "data",  # a checkpoint's tokenizer (twincore.tokenizer): .gguf, tokenizer.json or bytes
    "dot_product_attention": "attention",
    "attention_backend": "attention",
}

_SUBMODULES = (
    "config",
    "model",
    "hf",
    "attention",
    "precision",
    "loss_scale",
    "optim",
    "remat",
    "data",
    "checkpoint",
    "seed",
    "train_step",
    "kv_cache",
    "generate",
    "quant",
    "sharding",
    "train",
    "eval",
)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _SUBMODULES:  # `import jaxattn; jaxattn.attention` works without importing the submodule first
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'jaxattn' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
