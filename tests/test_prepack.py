"""The torch backend's oneDNN-packed bf16 weights (backends/torch_backend.py, backends/packs.py): the same numbers as
the plain products, never stale, and the engine's tokens do not move when the weights are packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.backends import adopt
from deltaserve.backends.packs import prepack_supported
from deltaserve.backends.torch_backend import PrepackedExperts, PrepackedLinear, TorchBackend
from deltaserve.config import ModelConfig
from deltaserve.layers.linear import Linear
from deltaserve.layers.moe import Experts, Routing
from deltaserve.tools.presets import get_preset
from engine_utils import assert_pools_free, make_llm, random_prompts
from deltaserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not prepack_supported(torch.bfloat16),
                                reason="this torch build or CPU has no oneDNN bf16 path")


def _pack(module: torch.nn.Module) -> int:
    return adopt(module, {Linear: PrepackedLinear, Experts: PrepackedExperts},
                 lambda m: prepack_supported(next(m.parameters()).dtype))


@pytest.mark.parametrize("n_out,n_in", [(64, 32), (300, 128), (1024, 256)])
def test_packed_linear_is_bit_identical_and_never_stale(n_out, n_in):
    g = torch.Generator().manual_seed(n_out)
    lin = Linear(n_in, n_out).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g))
    assert _pack(lin) == 1 and type(lin) is PrepackedLinear
    for m in (1, 3, 8, 33, 200):
        x = torch.randn(m, n_in, generator=g).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    x = torch.randn(5, n_in, generator=g).to(torch.bfloat16)
    before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the packed copy must follow
    assert torch.equal(lin(x), F.linear(x, lin.weight)) and not torch.equal(lin(x), before)
    lin.weight = torch.nn.Parameter(torch.randn(n_out, n_in, generator=g).to(torch.bfloat16))  # replaced
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_fp32_weights_are_not_packed():
    assert _pack(Linear(32, 16)) == 0


def test_packed_experts_are_bit_identical():
    config = ModelConfig.from_dict(get_preset("kimi-linear-tiny").config)
    g = torch.Generator().manual_seed(0)
    experts = Experts(config, 8, 64, 32)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(11, 64, generator=g).to(torch.bfloat16)
    routing = Routing(torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(11)]), torch.rand(11, 3))
    plain = experts(x, routing)
    assert _pack(experts) == 1
    assert torch.equal(experts(x, routing), plain)


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_engine_tokens_and_logprobs_unchanged_by_prepacking(make_checkpoint, monkeypatch, preset):
    """A bf16 engine on the torch backend, with its packs and with the modules as written."""
    prompts = random_prompts([9, 30, 17], seed=5, high=700)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = []
    for packed in (True, False):
        with monkeypatch.context() as m:
            if not packed:
                m.setattr(TorchBackend, "prepare", lambda self, model: "modules as written")
            llm = make_llm(make_checkpoint(preset), dtype="bfloat16", backend="torch")
            assert any(type(x) is PrepackedLinear for x in llm.engine.model.modules()) == packed
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs])
            assert_pools_free(llm.engine)
    assert runs[0] == runs[1]
