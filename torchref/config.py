"""Model configuration: ``ModelConfig`` lives once in ``twincore.config`` (framework-neutral, no jax
import); this is the mirrored module name of ``jaxattn.config``.

    from torchref.config import ModelConfig
    cfg = ModelConfig.preset("tiny")
"""

from twincore.config import PRESET_NAMES, ModelConfig

__all__ = ["ModelConfig", "PRESET_NAMES"]
