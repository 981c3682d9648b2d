"""Router (noaux_tc, sigmoid or softmax, expert groups) and the MoE block, plain or K3 latent (docs/model.md §10–11).

Experts are stored stacked ([E, I, in] for w1/w3, [E, in, I] for w2) and run once per expert over all the tokens of
the flattened batch that picked it; there is no per-request loop.
"""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .derived import Derived
from .linear import Linear
from .mlp import MLP, glu_activation
from .norm import RMSNorm


class Routing(NamedTuple):
    experts: torch.Tensor  # [N, k] int64 expert ids
    weights: torch.Tensor  # [N, k] fp32 combine weights (scaling factor applied once)


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        E = config.num_experts
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self._f32 = Derived()

    def weight_f32(self) -> torch.Tensor:
        """The router weight in fp32, converted once and again only when the weight changes (the logits are fp32
        on every path; converting [E, hidden] per call cost more than the product at decode)."""
        return self._f32.get([self.weight], lambda: self.weight.detach().float())

    def bias_f32(self) -> torch.Tensor:
        return self.e_score_correction_bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> Routing:
        """fp32 scores from the same x on every path; ties rank (score desc, expert id asc)."""
        c = self.config
        logits = torch.nn.functional.linear(x.float(), self.weight_f32())
        scores = torch.sigmoid(logits) if c.router_activation == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores + self.e_score_correction_bias.float()
        if c.num_expert_group > 1:
            grouped = choice.view(choice.shape[0], c.num_expert_group, -1)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = _stable_topk(group_score, c.topk_group)
            group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view_as(choice)
        idx = _stable_topk(choice, c.num_experts_per_token)
        w = scores.gather(1, idx)
        if c.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return Routing(idx, w * c.routed_scaling_factor)


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


class Experts(nn.Module):
    """E gated MLPs of width I over inputs of width `dim`, stacked (unquantised; `layers/quantized.py` holds the
    MX variant with the same forward)."""

    def __init__(self, config: ModelConfig, num_experts: int, dim: int, width: int):
        super().__init__()
        self.config = config
        self.w1 = nn.Parameter(torch.empty(num_experts, width, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, width, dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, width))  # down

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return dispatch_experts(x, routing, self.w1.shape[0], self.run_expert)

    def run_expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        """Expert e over its tokens xe [n, dim] -> [n, dim] in xe's dtype."""
        return F.linear(glu_activation(self.config, F.linear(xe, self.w1[e]), F.linear(xe, self.w3[e])), self.w2[e])


def dispatch_experts(x: torch.Tensor, routing: Routing, num_experts: int,
                     run_expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j w_j * expert_j(x): each selected expert runs once over all its tokens. The (token, choice) pairs are
    sorted by expert and the tokens gathered once, so expert e reads a contiguous slice and writes its outputs (in
    x's dtype) to a contiguous slice; one scatter puts them back in (token, choice) order, and each token's k outputs
    are weighted and summed in fp32 in routing order (the same order whatever else is in the batch), cast once."""
    T, k = routing.experts.shape
    flat_experts = routing.experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=num_experts).tolist()
    xs = x[order // k]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = run_expert(e, xs[start:start + n])
            start += n
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(T, k, -1).float() * routing.weights.unsqueeze(-1)).sum(1).to(x.dtype)


class MoE(nn.Module):
    """Routed experts + shared experts. With `routed_expert_hidden_size` set it is K3's latent MoE:
    experts run in latent space between `routed_expert_down_proj` and `routed_expert_up_proj`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden_size
        self.gate = Router(config)
        self.latent = config.routed_expert_hidden_size
        expert_in = self.latent or d
        self.experts = Experts(config, config.num_experts, expert_in, config.moe_intermediate_size)
        if self.latent:
            self.routed_expert_down_proj = Linear(d, self.latent)
            self.routed_expert_up_proj = Linear(self.latent, d)
            self.routed_expert_norm = RMSNorm(self.latent, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.shared_experts = (MLP(config, d, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.gate(x)
        if self.latent:
            r = self.experts(self.routed_expert_down_proj(x), routing)
            if self.routed_expert_norm is not None:
                r = self.routed_expert_norm(r)
            out = self.routed_expert_up_proj(r)
        else:
            out = self.experts(x, routing)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
