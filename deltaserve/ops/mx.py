"""MX block formats (OCP Microscaling v1.0, docs/ops.md §7): MXFP8 (E4M3, E5M2) and MXFP4 (E2M1) elements in blocks of
32 along the last dim, each block sharing one E8M0 scale stored as a uint8 biased exponent (2^(e-127), 255 = NaN).

Storage: FP8 elements as torch float8 tensors [..., K]; FP4 elements packed two per byte, element 2j in the low
nibble (the compressed-tensors `mxfp4-pack-quantized` layout of docs/ops.md §8 and torch `float4_e2m1fn_x2`);
scales uint8 [..., K/32].

Scale rules (§7.3), chosen by `ScaleMode`: FLOOR (the spec's default; the largest elements saturate), RCEIL
(NVIDIA/cuBLAS: never saturates), CEIL, EVEN (as torchao). Elements are `sat(RNE(v / X))`. A zero block gets the
smallest scale (byte 0) and zero elements; a block holding NaN or ±Inf gets scale byte 255 and zero elements, and
dequantises to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


class ScaleMode(str, Enum):
    FLOOR = "floor"
    RCEIL = "rceil"
    CEIL = "ceil"
    EVEN = "even"


@dataclass(frozen=True)
class ElementFormat:
    name: str
    emax: int             # exponent of the largest normal element
    max_normal: float
    mbits: int            # mantissa bits (EVEN rounds the block max to this precision)
    dtype: torch.dtype    # storage dtype of the element tensor (uint8 = packed FP4 pairs)


E4M3 = ElementFormat("e4m3", 8, 448.0, 3, torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 15, 57344.0, 2, torch.float8_e5m2)
E2M1 = ElementFormat("e2m1", 2, 6.0, 1, torch.uint8)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}

# E2M1 code points, index = 4-bit code (sign in bit 3).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Byte -> its (low, high) element pair: one gather decodes two elements.
_FP4_PAIRS = torch.stack([FP4_VALUES[torch.arange(256) & 15], FP4_VALUES[torch.arange(256) >> 4]], dim=-1)
# Magnitude bucket boundaries between consecutive E2M1 values. A value exactly on a boundary must go to the even code
# (RNE): bucketize(right=False) sends it to the lower bucket, so the boundaries whose tie goes up (0.75 -> 1.0,
# 1.75 -> 2.0, 3.5 -> 4.0) are moved one ulp down.
_FP4_BOUNDS = torch.tensor([0.25, torch.nextafter(torch.tensor(0.75), torch.tensor(0.0)).item(), 1.25,
                            torch.nextafter(torch.tensor(1.75), torch.tensor(0.0)).item(), 2.5,
                            torch.nextafter(torch.tensor(3.5), torch.tensor(0.0)).item(), 5.0])
# E8M0 byte -> scale value; 2^-127 is an fp32 (and bf16) subnormal, still exact.
_E8M0_VALUES = torch.cat([torch.exp2(torch.arange(255, dtype=torch.float64) - E8M0_BIAS).float(),
                          torch.tensor([float("nan")])])


class MXData(NamedTuple):
    data: torch.Tensor   # float8 [..., K], or uint8 [..., K/2] packed FP4
    scale: torch.Tensor  # uint8 [..., K/32] biased E8M0 exponents


def element_format(fmt: str | ElementFormat) -> ElementFormat:
    if isinstance(fmt, ElementFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown MX element format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MX formats need the last dim to be a multiple of {BLOCK}, got shape {list(x.shape)}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2 v) for finite v > 0 (frexp, so no rounding of log2 near powers of two)."""
    return torch.frexp(v).exponent - 1


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(v)
    return exp - (mant == 0.5).to(torch.int32)


def block_scales(blocks: torch.Tensor, fmt: ElementFormat, mode: ScaleMode = ScaleMode.FLOOR) -> torch.Tensor:
    """uint8 E8M0 scale of each block of fp32 `blocks [..., nb, 32]` under `mode` (docs/ops.md §7.3)."""
    amax = blocks.abs().amax(-1)
    finite = torch.isfinite(amax)
    safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    mode = ScaleMode(mode)
    if mode is ScaleMode.FLOOR:
        e = _floor_log2(safe) - fmt.emax
    elif mode is ScaleMode.CEIL:
        e = _ceil_log2(safe) - fmt.emax
    elif mode is ScaleMode.EVEN:
        # round amax's mantissa to the element's precision (half away from zero, as torchao), then FLOOR
        bits = safe.view(torch.int32) + (1 << (22 - fmt.mbits))
        e = ((bits >> 23) & 0xFF) - 127 - fmt.emax
    else:  # RCEIL: smallest power of two X with amax / X <= max_normal, from the fp32 quotient as cuBLAS does
        e = _ceil_log2(safe / fmt.max_normal)
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(finite, e + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)


def _fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to even, saturating at ±6, sign kept for ±0) of fp32 values, as uint8."""
    mag = torch.bucketize(v.abs(), _FP4_BOUNDS)
    return (mag + 8 * torch.signbit(v)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2], element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def quantize_mx(x: torch.Tensor, fmt: str | ElementFormat, mode: ScaleMode = ScaleMode.FLOOR) -> MXData:
    """Quantize `x [..., K]` (K a multiple of 32) in blocks of 32 along the last dim."""
    f = element_format(fmt)
    blocks = _blocks(x)
    scale = block_scales(blocks, f, mode)
    nan_block = (scale == E8M0_NAN).unsqueeze(-1)
    # multiplying by 2^-e (always a normal fp32) is exact, unlike forming the subnormal 2^-127 and dividing
    inv = torch.exp2(E8M0_BIAS - scale.float().clamp(max=254)).unsqueeze(-1)
    scaled = torch.where(nan_block, 0.0, blocks * inv).reshape(x.shape)
    if f.dtype is torch.uint8:
        return MXData(pack_fp4(_fp4_codes(scaled)), scale)
    return MXData(scaled.clamp(-f.max_normal, f.max_normal).to(f.dtype), scale)


def element_values(data: torch.Tensor, fmt: str | ElementFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decoded elements (without the block scale) [..., K] in `dtype`; FP4 through a byte-pair lookup table."""
    f = element_format(fmt)
    if f.dtype is torch.uint8:
        return _FP4_PAIRS.to(dtype)[data.long()].reshape(*data.shape[:-1], -1)
    return data.to(dtype)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, fmt: str | ElementFormat,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MX elements + E8M0 scales -> values [..., K] in `dtype`. Every MX value is exact in fp32, and in bf16 unless
    the block scale is below about 2^-120 (values there underflow bf16's subnormals)."""
    vals = element_values(data, fmt, dtype)
    k = vals.shape[-1]
    blocks = vals.reshape(*vals.shape[:-1], k // BLOCK, BLOCK) * _E8M0_VALUES.to(dtype)[scale.long()].unsqueeze(-1)
    return blocks.reshape(*vals.shape[:-1], k)


def fake_quantize_mx(x: torch.Tensor, fmt: str | ElementFormat, mode: ScaleMode = ScaleMode.FLOOR) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: the values an MX GEMM sees for `x`."""
    q = quantize_mx(x, fmt, mode)
    return dequantize_mx(q.data, q.scale, fmt, x.dtype)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2] + E8M0 uint8 [N, K/32] (4-D scales are squeezed) -> fp32 [N, K]."""
    return dequantize_mx(packed, scale.reshape(scale.shape[0], -1), E2M1)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP FLOOR MXFP4 of a matrix: (packed uint8 [N, K/2], scale uint8 [N, K/32])."""
    q = quantize_mx(w, E2M1, ScaleMode.FLOOR)
    return q.data, q.scale
