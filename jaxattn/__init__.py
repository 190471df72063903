"""jaxattn: a Llama transformer in Flax NNX with our own Pallas attention kernels — the JAX twin of ``torchref``.

Public names and submodules are imported lazily, so ``import jaxattn`` is cheap. The framework-neutral core both
twins share is the top-level package ``twincore``; ``torchref`` imports that, never this package.
"""

from twincore.lazy import lazy_attributes

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


__getattr__, __all__ = lazy_attributes(__name__, __path__, _EXPORTS)
