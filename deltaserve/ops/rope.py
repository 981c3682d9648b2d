"""Rotary position rotations: stateless ops on q / k given cos and sin tables (docs/model.md §9.6)."""

import torch


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the last dim; the result is laid out [rotated evens | rotated odds]
    (a fixed permutation, applied to q and k alike, so dot products equal the interleaved rotation)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + dim/2) of the last dim (the V3.2 indexer's non-interleaved form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
