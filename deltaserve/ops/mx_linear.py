"""Quantized linears over MX weights (docs/ops.md §7.5–7.7), each beside its readable `*_ref` twin (same signature).

  * `linear_w8a8_mxfp8`: MXFP8-E4M3 weight [N, K] + scales [N, K/32]; activations quantised to MXFP8-E4M3 per 32
    along K at run time (FLOOR by default, as the spec's scale rule).
  * `linear_w4a8_mxfp4`: packed MXFP4 weight [N, K/2] + scales; activations quantised to MXFP8-E4M3 (RCEIL by
    default, as NVIDIA SM100 and Ascend do). A deliberate precision change, only ever enabled by configuration.
  * `linear_w4a16_mxfp4`: packed MXFP4 weight, activations as they are (the K3 checkpoint's reference semantics).

An MX GEMM equals `dequant(x) @ dequant(W)^T` accumulated in fp32 (§7.5); the twins compute exactly that. The fast
path runs one GEMM in the activations' dtype over the dequantised weight, which the caller may pass in `dense` (a
per-module cache: MX values are exact in bf16 and fp32, so caching loses nothing). On the CPU a bf16 GEMM is
faster than an fp32 one, and neither `torch._scaled_mm` (far slower, rejects E8M0 block scales) nor an int8
GEMM (block scales along K would split it into K/32 GEMMs) is faster (docs/ops.md §10.2). The fast result therefore
differs from the twin only by summation order and, for bf16 activations, one rounding of the output to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mx import E2M1, E4M3, ElementFormat, ScaleMode, dequantize_mx, fake_quantize_mx


def mx_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_fmt: ElementFormat,
              act_fmt: ElementFormat | None, act_mode: ScaleMode, dense: torch.Tensor | None = None) -> torch.Tensor:
    """Fast path shared by the three linears: x [..., K] -> [..., N] in x's dtype. `dense`, if given, must be
    `dequantize_mx(weight, weight_scale, weight_fmt, x.dtype)`."""
    w = dense if dense is not None else dequantize_mx(weight, weight_scale, weight_fmt, x.dtype)
    xq = fake_quantize_mx(x, act_fmt, act_mode) if act_fmt is not None else x
    return F.linear(xq, w)


def mx_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_fmt: ElementFormat,
                  act_fmt: ElementFormat | None, act_mode: ScaleMode, dense: torch.Tensor | None = None) -> torch.Tensor:
    """Readable twin: dequantise the weight, fake-quantise the activations, matmul in fp32. `dense` is ignored."""
    w = dequantize_mx(weight, weight_scale, weight_fmt, torch.float32)
    xf = x.float()
    if act_fmt is not None:
        xf = fake_quantize_mx(xf, act_fmt, act_mode)
    return (xf @ w.t()).to(x.dtype)


def linear_w8a8_mxfp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      act_mode: ScaleMode = ScaleMode.RCEIL, dense: torch.Tensor | None = None) -> torch.Tensor:
    """weight float8_e4m3fn [N, K], weight_scale uint8 [N, K/32]."""
    return mx_linear(x, weight, weight_scale, E4M3, E4M3, act_mode, dense)


def linear_w8a8_mxfp8_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          act_mode: ScaleMode = ScaleMode.RCEIL, dense: torch.Tensor | None = None) -> torch.Tensor:
    return mx_linear_ref(x, weight, weight_scale, E4M3, E4M3, act_mode, dense)


def linear_w4a8_mxfp4(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                      act_mode: ScaleMode = ScaleMode.RCEIL, dense: torch.Tensor | None = None) -> torch.Tensor:
    """weight_packed uint8 [N, K/2] (element 2j in the low nibble), weight_scale uint8 [N, K/32]."""
    return mx_linear(x, weight_packed, weight_scale, E2M1, E4M3, act_mode, dense)


def linear_w4a8_mxfp4_ref(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                          act_mode: ScaleMode = ScaleMode.RCEIL, dense: torch.Tensor | None = None) -> torch.Tensor:
    return mx_linear_ref(x, weight_packed, weight_scale, E2M1, E4M3, act_mode, dense)


def linear_w4a16_mxfp4(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                       act_mode: ScaleMode = ScaleMode.FLOOR, dense: torch.Tensor | None = None) -> torch.Tensor:
    """As `linear_w4a8_mxfp4` with unquantised activations (`act_mode` is unused; kept for one signature)."""
    return mx_linear(x, weight_packed, weight_scale, E2M1, None, act_mode, dense)


def linear_w4a16_mxfp4_ref(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                           act_mode: ScaleMode = ScaleMode.FLOOR, dense: torch.Tensor | None = None) -> torch.Tensor:
    return mx_linear_ref(x, weight_packed, weight_scale, E2M1, None, act_mode, dense)
