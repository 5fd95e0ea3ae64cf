from mode.model.config import LAYER_KINDS, LMConfig, alternate
from mode.model.lm import LM, LMOutput

__all__ = ["LAYER_KINDS", "LM", "LMConfig", "LMOutput", "alternate"]
