"""torchref: a Llama transformer in PyTorch with the well-known speed tricks — the reference twin of ``jaxattn``.

Public names are imported lazily; nothing here imports jax.
"""

from twincore.lazy import lazy_attributes

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


__getattr__, __all__ = lazy_attributes(__name__, __path__, _EXPORTS)
