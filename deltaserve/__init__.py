"""deltaserve: an inference and serving engine for the Kimi K3.1 Pro model family."""

from .config import ModelConfig
from .engine.llm import LLM
from .engine.sampling_params import InvalidRequestError, SamplingParams
from .errors import CheckpointError, ConfigError, DeltaserveError
from .version import __version__


def load_model(path, dtype: str = "float32", device: str = "cpu", quantization: str | None = None):
    """Load a checkpoint folder and return its model (see `deltaserve.models.loader.load_model`)."""
    from .models.loader import load_model as _load

    return _load(path, dtype=dtype, device=device, quantization=quantization)


def load_tokenizer(path):
    """Load a checkpoint folder's tokenizer: tiktoken.model + tokenizer_config.json, else tokenizer.json."""
    from .tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["LLM", "SamplingParams", "InvalidRequestError", "ModelConfig", "ConfigError", "CheckpointError", "DeltaserveError", "load_model", "load_tokenizer"]
