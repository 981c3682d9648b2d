"""DeepSeek rotary embedding with optional YaRN scaling (docs/model.md §9.6). Kimi models are NoPE and never build
one."""

import math

import torch
from torch import nn


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for `dim` rotary dims. `scaling` is the config's rope_scaling / rope_parameters dict
    (None or type 'default' means plain RoPE)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.dim = dim
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        inv_freq = 1.0 / base
        self.attention_factor = 1.0
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "yarn":
            f = float(scaling["factor"])
            orig = float(scaling["original_max_position_embeddings"])
            beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

            def corr_dim(rot: float) -> float:
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

            lo = max(math.floor(corr_dim(beta_fast)), 0)
            hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
            if lo == hi:
                hi += 0.001
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
            inv_freq = inv_freq / f * ramp + inv_freq * (1 - ramp)
            if scaling.get("attention_factor") is not None:
                self.attention_factor = float(scaling["attention_factor"])
            elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
                self.attention_factor = (_yarn_mscale(f, float(scaling["mscale"]))
                                         / _yarn_mscale(f, float(scaling["mscale_all_dim"])))
            else:
                self.attention_factor = _yarn_mscale(f)
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope type {kind!r}")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, dim/2] cos and sin (attention factor applied) at integer positions."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def softmax_scale_factor(scaling: dict | None) -> float:
    """YaRN's mscale(f, mscale_all_dim)^2 multiplier of the MLA softmax scale (1 without YaRN)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
