"""Model families by `model_type`. Each family is the shared CausalLM; what differs between families (AttnRes,
latent MoE, KDA gates, DSA, RoPE) is switched on by config keys, so every feature is testable on its own."""

from ..config import ModelConfig
from .base import CausalLM


class KimiK3ForCausalLM(CausalLM):
    """Kimi K3 and K3.1 Pro text model: KDA + (gated) MLA or DSA, AttnRes, latent MoE, SiTU."""


class KimiLinearForCausalLM(CausalLM):
    """Kimi-Linear: KDA + NoPE MLA, ordinary residual, SiLU MoE."""


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 (MLA with RoPE/YaRN) and V3.2 (plus the lightning indexer)."""


MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "kimi_k3": KimiK3ForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    return MODEL_CLASSES[config.family]
