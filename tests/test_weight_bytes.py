"""Weight accounting of a loaded model: bytes by storage format (engine/summary.py, the banner's split) and the
bytes one decode step reads (bench_roofline.weight_bytes_touched, the allowed speed-up of `bench quant`), on
k31-tiny (8 experts, top-2, one MTP layer), unquantised and under each MX scheme."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.summary import weight_bytes, weight_bytes_by_format
from deltaserve.layers.quantized import MXExperts, MXLinear, quantized_tensors
from deltaserve.models.loader import load_model
from deltaserve.server.banner import format_bytes, weights_text
from deltaserve.tools.bench_roofline import weight_bytes_touched


@pytest.fixture(scope="module")
def k31_tiny(make_checkpoint):
    return make_checkpoint("k31-tiny")


def _load(path, quantization=None):
    return load_model(str(path), dtype="bfloat16", quantization=quantization)


def _mx_bytes(model, kind) -> int:
    return sum(b.nbytes for m in model.modules() if isinstance(m, kind) for b in m.buffers())


@pytest.mark.parametrize("quantization", [None, "w8a8-mxfp8", "w4a8-mxfp4", "mxfp"])
def test_bytes_by_format_sum_to_the_total(k31_tiny, quantization):
    model = _load(k31_tiny, quantization)
    by_format = weight_bytes_by_format(model)
    assert sum(by_format.values()) == weight_bytes(model)
    dense = quantization in ("w8a8-mxfp8", "mxfp")
    experts = quantization in ("w4a8-mxfp4", "mxfp")
    assert ("MXFP8" in by_format, "MXFP4" in by_format) == (dense, experts)
    assert by_format.get("MXFP8", 0) == (_mx_bytes(model, MXLinear) if dense else 0)
    assert by_format.get("MXFP4", 0) == (_mx_bytes(model, MXExperts) if experts else 0)
    # the rest is what the model dtype and the fp32 parameters (A_log, dt_bias, ...) hold
    assert set(by_format) - {"MXFP4", "MXFP8"} == {"bfloat16", "float32"}


def test_bytes_by_format_counts_any_mx_subclass_and_shared_storage_once(k31_tiny):
    """A backend's MXLinear subclass with buffers of its own names still counts as MXFP8; a tensor held by two
    modules (tied LM head) counts once, as weight_bytes counts it."""

    class ColumnPacked(MXLinear):
        def __init__(self, source: MXLinear):
            super().__init__(source.in_features, source.out_features, source.scheme)
            del self.weight, self.weight_scale
            self.register_buffer("cols", torch.zeros(source.in_features, source.out_features,
                                                     dtype=torch.float8_e4m3fn))
            self.register_buffer("col_scales", torch.zeros(source.in_features // 32, source.out_features,
                                                           dtype=torch.uint8))

    model = _load(k31_tiny, "w8a8-mxfp8")
    path, linear = next((p, m) for p, m in model.named_modules() if isinstance(m, MXLinear))
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, ColumnPacked(linear))
    untied = weight_bytes_by_format(model)
    assert sum(untied.values()) == weight_bytes(model)
    assert untied["MXFP8"] == _mx_bytes(model, MXLinear)
    model.lm_head.weight = model.embed_tokens.weight
    tied = weight_bytes_by_format(model)
    assert sum(tied.values()) == weight_bytes(model)
    assert tied == untied | {"bfloat16": untied["bfloat16"] - model.embed_tokens.weight.nbytes}


def _touched_by_name(model, batch: int) -> float:
    """The bytes a decode step of `batch` tokens reads, from the tensors' names: routed experts (parameters or MX
    buffers) in the expected share of experts hit, `batch` embedding rows, MTP layers none, everything else once."""
    cfg = model.config
    share = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** batch
    total = 0.0
    for name, t in (dict(model.named_parameters()) | quantized_tensors(model)).items():
        if name.startswith("mtp."):
            continue
        if name.startswith("embed_tokens."):
            total += batch * t.nbytes / t.shape[0]
        else:
            total += t.nbytes * (share if ".ffn.experts." in name else 1)
    return total


@pytest.mark.parametrize("quantization", [None, "mxfp"])
def test_decode_bytes_read_k_of_e_experts_and_one_embedding_row(k31_tiny, quantization):
    model = _load(k31_tiny, quantization)
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_token) == (8, 2) and len(model.mtp) == 1
    # batch 1: k/E of the experts; batch 64: E[share] = 1 - (1 - k/E)^64, nearly all of them
    for batch in (1, 64):
        assert weight_bytes_touched(model, batch) == pytest.approx(_touched_by_name(model, batch), abs=2)
    experts = sum(t.nbytes for n, t in (dict(model.named_parameters()) | quantized_tensors(model)).items()
                  if n.startswith("layers.") and ".ffn.experts." in n)
    assert experts > 0  # the routed experts are there to be counted


def test_decode_bytes_of_a_tied_lm_head_read_the_table_in_full(k31_tiny):
    model = _load(k31_tiny)
    untied = weight_bytes_touched(model, 1)
    row = model.embed_tokens.weight[0].nbytes
    assert model.lm_head.weight.shape == model.embed_tokens.weight.shape
    model.lm_head.weight = model.embed_tokens.weight
    # untied: one row + the LM head; tied: the one table (the LM head's size) in full
    assert weight_bytes_touched(model, 1) == untied - row


def test_mx_schemes_read_fewer_bytes(k31_tiny):
    read = {q: weight_bytes_touched(_load(k31_tiny, q), 1) for q in (None, "w8a8-mxfp8", "w4a8-mxfp4", "mxfp")}
    assert read["mxfp"] < min(read["w8a8-mxfp8"], read["w4a8-mxfp4"])
    assert max(read["w8a8-mxfp8"], read["w4a8-mxfp4"]) < read[None]


def test_banner_weights_text():
    mib = 1 << 20
    assert weights_text(3 * mib, {"bfloat16": 3 * mib}) == "3.0 MiB, all bfloat16"
    assert weights_text(7 * mib, {"bfloat16": 2 * mib, "MXFP4": 4 * mib, "float32": mib}) == (
        "7.0 MiB (MXFP4 4.0 MiB, bfloat16 2.0 MiB, float32 1.0 MiB)")
    assert format_bytes(mib) == "1.0 MiB"
