"""Model configuration: ``ModelConfig`` lives once in ``twincore.config`` (framework-neutral); this is the
mirrored module name of ``torchref.config``.

    from jaxattn.config import ModelConfig
    cfg = ModelConfig.preset("tiny")
"""

from twincore.config import PRESET_NAMES, ModelConfig

__all__ = ["ModelConfig", "PRESET_NAMES"]
