from .base import CausalLM
from .loader import load_config, load_model

__all__ = ["CausalLM", "load_config", "load_model"]
