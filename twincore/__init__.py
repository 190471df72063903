"""The framework-neutral core shared by both twins, ``jaxattn`` and ``torchref``: it imports neither jax nor torch
(numpy only), and importing it changes nothing in the process.

Hugging Face keeps one ``configuration_llama.py`` for its PyTorch and Flax models; this package is ours. torchref
imports it and nothing of jaxattn (``parity_tests/test_packaging.py`` proves both).

    from twincore import ModelConfig
    cfg = ModelConfig.preset("tiny")

Modules: ``config`` (``ModelConfig``, presets, HF ``config.json``), ``hf_format`` (the HF checkpoint directory),
``gguf`` (llama.cpp files), ``dtypes`` (dtype and precision-preset names), ``batch`` (the training batch format and
token-id checks), ``remat`` (policy names), ``optim`` (optimizer names, schedules, 8-bit maps), ``grad_accum``,
``data`` (tokenizer, packing, buckets, sources), ``cli`` (the training flag table), ``trainer`` (the training run
both twins subclass: data, resume checks, the step loop, checkpoints, export, summary), ``runlog``, ``seed``,
``eval`` (evaluation batches, perplexity, the eval flags), ``generate`` (sampling checks, tokenizers, the generate
flags), ``pipeline`` (stage split checks, the bubble), ``tensors`` (the per-layer activations' names: remat tags,
debugger rows), ``lazy`` (the twins' lazy package attributes), ``timing`` and ``memreport`` (profiling tables),
``packages`` (installed distributions' versions).
"""

from .config import PRESET_NAMES, ModelConfig

__all__ = ["ModelConfig", "PRESET_NAMES"]
