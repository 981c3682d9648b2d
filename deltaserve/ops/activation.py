"""Gated activations of the MLPs and experts (docs/model.md §6). Both take the gate and up halves, return act(g, u)."""

import torch


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU: silu(g) * u, in the input dtype (Kimi-Linear, DeepSeek)."""
    return torch.nn.functional.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU: [beta*tanh(g/beta) * sigmoid(g)] * [beta_lin*tanh(u/beta_lin)] in fp32, cast back to the input dtype.

    The sigmoid acts on the raw gate; `linear_beta=None` makes the up branch the identity.
    """
    g, u = gate.float(), up.float()
    gate_f = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up_f = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (gate_f * up_f).to(gate.dtype)
