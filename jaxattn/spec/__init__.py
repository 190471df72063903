"""Framework-neutral code shared by both twins: it imports neither jax nor torch (numpy only).

Hugging Face keeps one ``configuration_llama.py`` for its PyTorch and Flax models; this subpackage is ours.
It is the only part of ``jaxattn`` that ``torchref`` imports (``parity_tests/test_packaging.py`` proves it).

    from jaxattn.spec import ModelConfig
    cfg = ModelConfig.preset("tiny")

Modules: ``config`` (``ModelConfig``, presets, HF ``config.json``), ``hf_format`` (the HF checkpoint directory),
``dtypes`` (dtype and precision-preset names), ``batch`` (the training batch format and token-id checks).
"""
from .config import PRESET_NAMES, ModelConfig

__all__ = ["ModelConfig", "PRESET_NAMES"]
