"""MX formats (docs/ops.md §7) bit-for-bit against torchao's MX emulation (an independent implementation), plus the
spec's own rules where torchao departs from them (Inf blocks, the smallest scale)."""

import numpy as np
import pytest
import torch

from deltaserve.ops.mx import (E2M1, E4M3, E5M2, ScaleMode, dequant_mxfp4, dequantize_mx, fake_quantize_mx,
                               quant_mxfp4, quantize_mx, unpack_fp4)

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
MODES = list(ScaleMode)


def _torchao(x: torch.Tensor, fmt: str, mode: ScaleMode):
    t = mx_tensor.MXTensor.to_mx(x, TORCH_DTYPE[fmt], 32,
                                 scaling_mode=mx_tensor.ScaleCalculationMode(mode.value))
    return t.qdata.view(torch.uint8), t.scale.view(torch.uint8), t.dequantize(torch.float32)


def _edge_blocks(fmt) -> torch.Tensor:
    """Blocks of 32 covering the rules: zeros, the element max at several scales, saturation ranges, exact RNE ties
    of E2M1 and E4M3, element subnormals, signed zeros, fp32 extremes."""
    g = torch.Generator().manual_seed(1)
    M = fmt.max_normal
    rows = [torch.zeros(32), -torch.zeros(32),
            torch.full((32,), M), torch.full((32,), -M) * 2.0 ** -20,
            torch.linspace(-M, M, 32) * 2.0 ** 40,
            torch.linspace(0, 1.99, 32) * M,               # (M, 2M): FLOOR saturates, RCEIL/CEIL must not
            torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                          0.1, -0.1, 4.5, 5.5, 2.75, 0.0, -0.0] + [1.0] * 10),  # E2M1 ties with a max of 6
            torch.tensor([448.0, 17.0, 19.0, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -7, 2.0 ** -10, 1.0625, 1.1875]
                         + [0.5] * 23),                   # E4M3 ties and subnormals with a max of 448
            torch.randn(32, generator=g) * 2.0 ** -100,      # tiny but with a normal scale
            torch.randn(32, generator=g) * 2.0 ** 100,
            torch.tensor([3.0e38, -3.0e38] + [1.0] * 30)]    # near fp32 max
    return torch.stack(rows).reshape(1, -1).repeat(2, 1)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_matches_torchao_bit_for_bit(fmt, mode):
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(16, 256, generator=g) * torch.exp2(torch.randint(-60, 60, (16, 1), generator=g).float())
    for x in (rand, _edge_blocks(fmt)):
        q = quantize_mx(x, fmt, mode)
        data, scale, deq = _torchao(x, fmt.name, mode)
        assert torch.equal(q.scale, scale)
        assert torch.equal(q.data.view(torch.uint8), data)
        assert torch.equal(dequantize_mx(q.data, q.scale, fmt), deq)
        assert torch.equal(dequantize_mx(q.data, q.scale, fmt, torch.bfloat16).float(), deq)  # exact in bf16


def test_scale_rule_examples_and_saturation():
    block = torch.tensor([5.0] + [1.0] * 31).reshape(1, 32)
    assert quantize_mx(block, E4M3).scale.item() == 127 - 6  # docs/ops.md §7.3: max 5.0 -> 2^-6 for E4M3
    assert quantize_mx(block, E2M1).scale.item() == 127      # and 2^0 for E2M1
    big = torch.tensor([480.0] + [1.0] * 31).reshape(1, 32)
    floor = quantize_mx(big, E4M3, ScaleMode.FLOOR)
    assert dequantize_mx(floor.data, floor.scale, E4M3)[0, 0].item() == 448.0 * 2.0 ** (floor.scale.item() - 127)
    rceil = quantize_mx(big, E4M3, ScaleMode.RCEIL)
    assert rceil.scale.item() == 127 + 1 and dequantize_mx(rceil.data, rceil.scale, E4M3)[0, 0].item() == 480.0


def test_zero_nan_inf_blocks():
    x = torch.ones(4, 32)
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    x[3, 9] = float("-inf")
    for fmt in (E4M3, E5M2, E2M1):
        for mode in MODES:
            q = quantize_mx(x, fmt, mode)
            assert q.scale[:, 0].tolist() == [0, 255, 255, 255]  # zero block: smallest scale; NaN/Inf: NaN scale
            assert torch.equal(q.data[0].view(torch.uint8), torch.zeros_like(q.data[0].view(torch.uint8)))
            deq = dequantize_mx(q.data, q.scale, fmt)
            assert torch.equal(deq[0], torch.zeros(32)) and deq[1:].isnan().all()
            # torchao agrees on NaN (it maps Inf blocks to a finite scale, which the spec does not)
            assert _torchao(x[:2].contiguous(), fmt.name, mode)[1][:, 0].tolist() == [0, 255]


def test_smallest_scale_is_exact():
    # amax far below 2^-120 gives scale byte 0 (2^-127): elements are scaled by the true 2^127 (torchao clamps its
    # divisor to the smallest normal, 2^-126, so it is not an oracle here).
    x = torch.tensor([2.0 ** -130] * 32).reshape(1, 32)
    q = quantize_mx(x, E4M3, ScaleMode.FLOOR)
    assert q.scale.item() == 0 and q.data.float()[0, 0].item() == 2.0 ** -3
    assert dequantize_mx(q.data, q.scale, E4M3)[0, 0].item() == 2.0 ** -130


def test_fp4_packing_matches_torch_float4_x2():
    """torch.float4_e2m1fn_x2 (and torchao, compressed-tensors): element 2j in the low nibble (docs/ops.md §7.4)."""
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76] * 4], dtype=torch.uint8)
    vals = dequant_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert vals[0, :8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    every = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    theirs = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(every.view(torch.float4_e2m1fn_x2).view(torch.uint8)))
    ours = dequantize_mx(every, torch.full((8, 2), 127, dtype=torch.uint8), E2M1)
    assert torch.equal(ours, theirs.reshape(8, 64))
    assert torch.equal(unpack_fp4(every), kernels.unpack_uint4(every).reshape(8, 64))


def test_fp4_lut_matches_independent_decoder():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=g)
    scale = torch.randint(100, 150, (64, 3), dtype=torch.uint8, generator=g)

    def e2m1(code):
        sign = -1.0 if code & 8 else 1.0
        e, m = (code >> 1) & 3, code & 1
        return sign * (m * 0.5 if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1))

    lut = np.array([e2m1(c) for c in range(16)])
    p = packed.numpy()
    want = lut[np.stack([p & 15, p >> 4], -1).reshape(64, 96)] * np.repeat(2.0 ** (scale.numpy() - 127.0), 32, 1)
    assert np.array_equal(dequant_mxfp4(packed, scale).double().numpy(), want)


def test_legacy_mxfp4_helpers_roundtrip():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    packed, scale = quant_mxfp4(w)
    assert packed.shape == (64, 64) and scale.shape == (64, 4) and packed.dtype == scale.dtype == torch.uint8
    assert torch.equal(dequant_mxfp4(packed, scale), fake_quantize_mx(w, E2M1))
    sqnr = 10 * torch.log10(w.pow(2).sum() / (w - dequant_mxfp4(packed, scale)).pow(2).sum()).item()
    assert 17 < sqnr < 21  # E2M1 on gaussian data is ~18.8 dB (docs/ops.md §10.1)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mx(torch.ones(2, 48), E4M3)
    with pytest.raises(ValueError, match="unknown MX element format"):
        quantize_mx(torch.ones(2, 32), "e3m4")
