"""torchref: a Llama transformer in PyTorch with the well-known speed tricks — the reference twin of ``jaxattn``.

Public names are imported lazily; nothing here imports jax.
"""

from importlib import import_module

__version__ = "0.1.0"
_EXPORTS = {
    "ModelConfig": "config",
    "LlamaForCausalLM": "model",
    "Llama": "model",  # the same class under jaxattn's name
    "LlamaModel": "model",
    "from_pretrained": "hf",
    "save_pretrained": "hf",
    "from_gguf": "hf",
    "load_tokenizer": "data",  # a checkpoint's tokenizer (twincore.tokenizer): .gguf, tokenizer.json or bytes
    "dot_product_attention": "attention",
}

_SUBMODULES = (
    "config",
    "model",
    "hf",
    "attention",
    "precision",
    "optim",
    "remat",
    "data",
    "checkpoint",
    "seed",
    "train_step",
    "kv_cache",
    "generate",
    "quant",
    "parallel",
    "train",
    "eval",
)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _SUBMODULES:  # `import torchref; torchref.attention` works without importing the submodule first
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'torchref' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
