"""Framework-neutral code shared by both twins: it imports neither jax nor torch (numpy only).

Hugging Face keeps one ``configuration_llama.py`` for its PyTorch and Flax models; this subpackage is ours.
It is the only part of ``jaxattn`` that ``torchref`` imports (``parity_tests/test_packaging.py`` proves it).

    from jaxattn.spec import ModelConfig
    cfg = ModelConfig.preset("tiny")

Modules: ``config`` (``ModelConfig``, presets, HF ``config.json``), ``hf_format`` (the HF checkpoint directory),
``gguf`` (llama.cpp files), ``dtypes`` (dtype and precision-preset names), ``batch`` (the training batch format and
token-id checks), ``remat`` (policy names), ``optim`` (optimizer names, schedules, 8-bit maps), ``grad_accum``,
``data`` (tokenizer, packing, buckets, sources), ``cli`` (the training flag table), ``runlog``, ``seed``,
``eval`` (evaluation batches, perplexity, the eval flags), ``generate`` (sampling checks, tokenizers, the generate
flags), ``pipeline`` (stage split checks, the bubble), ``timing`` and ``memreport`` (profiling tables),
``cuda_quiet`` (a quiet jax start on a CPU machine with the CUDA plugin installed).
"""

from .config import PRESET_NAMES, ModelConfig

__all__ = ["ModelConfig", "PRESET_NAMES"]
