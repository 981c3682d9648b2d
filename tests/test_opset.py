"""`--ops reference` swaps every op for its readable twin; the engine's greedy output is the same either way."""

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.layers.kda import KimiDeltaAttention
from deltaserve.layers.mla import MLAttention
from deltaserve.ops.opset import OP_SETS, get_ops
from engine_utils import assert_pools_free, assert_same_greedy, make_llm, new_stats


def test_reference_set_is_made_of_twins():
    fast, ref = get_ops("fast"), get_ops("reference")
    for name in ("kda_chunk", "kda_recurrent", "short_conv", "attn_res_mix", "kda_decode_batched",
                 "short_conv_decode_batched"):
        assert getattr(ref, name).__name__ == getattr(fast, name).__name__ + "_ref", name
    assert set(OP_SETS) == {"fast", "reference"}
    with pytest.raises(ValueError, match="unknown op set"):
        get_ops("turbo")


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_engine_greedy_output_is_the_same_with_reference_ops(make_checkpoint, preset, monkeypatch):
    path = make_checkpoint(preset)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 700, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 28, 55)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    batched_rows = []
    original = KimiDeltaAttention._decode_batched

    def spy(self, q_in, *args):
        batched_rows.append(q_in.shape[0])
        return original(self, q_in, *args)

    monkeypatch.setattr(KimiDeltaAttention, "_decode_batched", spy)
    sparse_calls = []
    original_sparse = MLAttention._sparse_paged

    def sparse_spy(self, *args):
        sparse_calls.append(self.layer)
        return original_sparse(self, *args)

    monkeypatch.setattr(MLAttention, "_sparse_paged", sparse_spy)
    fast_llm = make_llm(path, max_num_batched_tokens=48)
    fast = fast_llm.generate(prompts, params, use_tqdm=False)
    assert max(batched_rows) > 1  # decode tokens of several sequences went through one batched op
    # K3.1: every DSA layer ran QLI + QSFA over the pages (fast set); the reference set never does
    assert bool(sparse_calls) == (fast_llm.engine.config.has_dsa)
    sparse_calls.clear()
    ref_llm = make_llm(path, max_num_batched_tokens=48, ops="reference")
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    assert ref_llm.engine.runner.ops.name == "reference" and fast_llm.engine.runner.ops.name == "fast"
    assert not sparse_calls
    stats = new_stats(f"ops fast vs reference {preset}")
    for p, a, b in zip(prompts, fast, ref):
        assert_same_greedy(a.outputs[0].token_ids, p, fast_llm.engine.model, stats)
        assert_same_greedy(b.outputs[0].token_ids, p, ref_llm.engine.model, stats)
        if a.outputs[0].token_ids != b.outputs[0].token_ids:
            stats.near_ties.append("fast != reference")
    stats.assert_rare()
    assert_pools_free(fast_llm.engine)
    assert_pools_free(ref_llm.engine)
