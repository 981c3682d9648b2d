"""Router (noaux_tc, sigmoid or softmax, expert groups) and the MoE block, plain or K3 latent (docs/model.md §10–11).

Experts are stored stacked ([E, I, in] for w1/w3, [E, in, I] for w2) and run once per expert over all the tokens of
the flattened batch that picked it; there is no per-request loop.
"""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
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
    are weighted and summed in fp32 in routing order (the same order whatever else is in the batch), cast once. A
    choice of expert -1 (one another expert-parallel rank holds) adds nothing."""
    T, k = routing.experts.shape
    flat_experts = routing.experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    elsewhere = int((flat_experts < 0).sum())  # sorted first
    if elsewhere:
        order = order[elsewhere:]
    counts = torch.bincount(flat_experts[order] if elsewhere else flat_experts, minlength=num_experts).tolist()
    xs = x[order // k]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = run_expert(e, xs[start:start + n])
            start += n
    y = torch.zeros(T * k, x.shape[-1], dtype=ys.dtype, device=x.device) if elsewhere else torch.empty_like(ys)
    y[order] = ys
    return (y.view(T, k, -1).float() * routing.weights.unsqueeze(-1)).sum(1).to(x.dtype)


class MoE(nn.Module):
    """Routed experts + shared experts. With `routed_expert_hidden_size` set it is K3's latent MoE:
    experts run in latent space between `routed_expert_down_proj` and `routed_expert_up_proj`.

    Over a tensor-parallel group (`shard`, docs/parallel.md) a rank holds each expert's share of the width, or with
    expert parallelism whole experts `first_expert ..` (the router, whole on every rank, picks among all of them);
    the shared experts' width is split. Its output is a partial sum the decoder layer all-reduces; the latent MoE
    first all-reduces the routed experts' latent output (its norm needs all of it), and its up projection reads the
    rank's slice of the normed latent."""

    def __init__(self, config: ModelConfig, shard: Shard = Shard()):
        super().__init__()
        d, E, I = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.shard = shard
        self.gate = Router(config)
        self.latent = config.routed_expert_hidden_size
        expert_in = self.latent or d
        self.expert_parallel = shard.expert_parallel and shard.size > 1
        held = shard.span(E) if self.expert_parallel else range(E)
        self.first_expert, self.num_held = held.start, len(held)
        self.experts = Experts(config, self.num_held, expert_in, I if self.expert_parallel else shard.part(I))
        if self.latent:
            self.routed_expert_down_proj = Linear(d, self.latent)
            self.routed_expert_up_proj = Linear(shard.part(self.latent), d)
            self.routed_expert_norm = RMSNorm(self.latent, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.shared_experts = (MLP(config, d, I * config.num_shared_experts, shard)
                               if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.gate(x)
        if self.latent:
            r = self.shard.all_reduce(self._routed(self.routed_expert_down_proj(x), routing))
            if self.routed_expert_norm is not None:
                r = self.routed_expert_norm(r)
            if self.shard.size > 1:
                span = self.shard.span(self.latent)
                r = r[:, span.start:span.stop]
            out = self.routed_expert_up_proj(r)
        else:
            out = self._routed(x, routing)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' output; on an expert-parallel rank only the choices of the experts it holds count
        (the others' are expert -1 in the dispatch, which leaves them out)."""
        if not self.expert_parallel:
            return self.experts(x, routing)
        local = routing.experts - self.first_expert
        held = (local >= 0) & (local < self.num_held)
        return dispatch_experts(x, Routing(torch.where(held, local, -1), routing.weights), self.num_held,
                                self.experts.run_expert)
