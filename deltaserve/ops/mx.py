"""MXFP4 (OCP E2M1 elements, E8M0 scale per 32) in the compressed-tensors `mxfp4-pack-quantized` layout
(ops.md §8): packed uint8 [N, K/2] with element 2i in the low nibble, scales uint8 [N, K/32] = exponent + 127."""

import torch

BLOCK = 32
# E2M1 code points, index = 4-bit code (sign in bit 3).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_E2M1_EMAX = 2  # largest E2M1 exponent: 6 = 1.5 * 2^2


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2] + E8M0 uint8 [N, K/32] (4-D scales are squeezed) -> fp32 [N, K]."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).long()
    exp = scale.reshape(scale.shape[0], -1).to(torch.int32) - 127
    return FP4_VALUES[codes] * torch.exp2(exp.float()).repeat_interleave(BLOCK, dim=1)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP FLOOR scaling: shared exponent floor(log2(amax)) - 2, elements rounded to nearest E2M1 (ties to even
    code), saturating at ±6. Returns (packed uint8 [N, K/2], scale uint8 [N, K/32])."""
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got {K}")
    blocks = w.float().reshape(N, K // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -127))) - _E2M1_EMAX,
                      torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = (blocks / torch.exp2(exp).unsqueeze(-1)).reshape(N, K)
    mags = FP4_VALUES[:8]
    dist = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - mags).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    even = torch.arange(8) % 2 == 0
    code = (nearest.float() * 2 + (nearest & even).float()).argmax(-1)  # an exact tie goes to the even code
    code = code + 8 * (scaled < 0).long() * (code > 0).long()
    codes = code.to(torch.uint8).reshape(N, K // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, (exp + 127).to(torch.uint8)
