"""Quantisation noise for training (deltaserve/tools/quant_noise.py): a noisy layer computes what the scheme's MX layer
computes, its gradient passes straight through, it shares the original parameters, and which layers are noisy is a
seeded draw."""

import copy

import pytest
import torch
import torch.nn.functional as F

import deltaserve
from deltaserve.default_model import default_model_path
from deltaserve.layers.moe import Routing
from deltaserve.layers.quantized import MXExperts, MXLinear, get_scheme, quantize_model
from deltaserve.ops.mx import E4M3, ScaleMode, fake_quantize_mx
from deltaserve.tools.presets import _TINY, k3_config, k3_text_config
from deltaserve.tools.quant_noise import NoisyExperts, NoisyLinear, QuantNoise
from deltaserve.tools import corpus
from deltaserve.tools.train import build_model, evaluate, step_batch, train

NUM_BPE = 4096 - 256


def _model(seed: int = 0):
    text = k3_text_config(**_TINY, vocab=NUM_BPE + 256, num_bpe=NUM_BPE)
    return build_model(k3_config(text, indexer={"heads": 4, "head_dim": 16, "topk": 16}, num_bpe=NUM_BPE), seed)[0]


def _paths(model, types) -> set[str]:
    return {path for path, m in model.named_modules() if isinstance(m, types)}


def test_attach_replaces_what_the_scheme_quantises_and_shares_the_parameters():
    model = _model()
    before = dict(model.named_parameters())
    quantised = copy.deepcopy(model)
    quantize_model(quantised, get_scheme("mxfp"))
    noise = QuantNoise.attach(model, get_scheme("mxfp"), 0.5, seed=0)
    assert _paths(model, (NoisyLinear, NoisyExperts)) == _paths(quantised, (MXLinear, MXExperts))
    assert len(noise.layers) == len(_paths(quantised, (MXLinear, MXExperts))) > 0
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    only_experts = _model()
    QuantNoise.attach(only_experts, get_scheme("w4a8-mxfp4"), 0.5, seed=0)
    assert _paths(only_experts, NoisyLinear) == set() and _paths(only_experts, NoisyExperts)


def test_noisy_layers_compute_what_the_mx_layers_compute():
    model = _model()
    plain = copy.deepcopy(model)
    noise = QuantNoise.attach(model, get_scheme("mxfp"), 1.0, seed=0)
    assert noise.draw() == len(noise.layers)
    model.train()
    g = torch.Generator().manual_seed(1)
    for path, layer in model.named_modules():
        original = plain.get_submodule(path) if isinstance(layer, (NoisyLinear, NoisyExperts)) else None
        if isinstance(layer, NoisyLinear):
            x = torch.randn(5, layer.in_features, generator=g) * 3
            expected = MXLinear.from_linear(original, get_scheme("mxfp").dense)(x)
            with torch.no_grad():
                assert torch.equal(layer(x), expected), path
                assert not torch.equal(layer(x), F.linear(x, layer.weight)), path
                layer.eval()
                assert torch.equal(layer(x), F.linear(x, layer.weight)), path  # eval: plain
                layer.train()
        elif isinstance(layer, NoisyExperts):
            E, _, dim = layer.w1.shape
            x = torch.randn(6, dim, generator=g)
            experts = torch.tensor([[0, 1], [1, 2], [2, 0], [E - 1, 0], [3 % E, 1], [1, E - 1]])
            routing = Routing(experts, torch.rand(6, 2, generator=g))
            expected = MXExperts.from_experts(original, get_scheme("mxfp").experts)(x, routing)
            with torch.no_grad():
                assert torch.allclose(layer(x, routing), expected, rtol=1e-6, atol=1e-6), path
                assert not torch.allclose(layer(x, routing), original(x, routing), rtol=1e-4, atol=1e-4), path


def test_gradients_pass_straight_through():
    """d/dW and d/dx of a noisy linear are those of the product of the quantised values, as if quantising were the
    identity."""
    model = _model()
    noise = QuantNoise.attach(model, get_scheme("w8a8-mxfp8"), 1.0, seed=0)
    noise.draw()
    layer = noise.layers[0]
    layer.train()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, layer.in_features, generator=g, requires_grad=True)
    upstream = torch.randn(7, layer.out_features, generator=g)
    (layer(x) * upstream).sum().backward()
    xq = fake_quantize_mx(x.detach(), E4M3, ScaleMode.RCEIL).requires_grad_()
    wq = fake_quantize_mx(layer.weight.detach(), E4M3, ScaleMode.FLOOR).requires_grad_()
    (F.linear(xq, wq) * upstream).sum().backward()
    assert torch.allclose(layer.weight.grad, wq.grad) and torch.allclose(x.grad, xq.grad)


def test_draws_are_seeded_and_follow_p():
    a = QuantNoise.attach(_model(), get_scheme("mxfp"), 0.3, seed=5)
    b = QuantNoise.attach(_model(), get_scheme("mxfp"), 0.3, seed=5)
    draws_a, draws_b = [], []
    for _ in range(100):
        a.draw(), b.draw()
        draws_a.append([layer.noisy for layer in a.layers])
        draws_b.append([layer.noisy for layer in b.layers])
    assert draws_a == draws_b
    share = sum(map(sum, draws_a)) / (100 * len(a.layers))
    assert 0.24 < share < 0.36, share


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    return torch.tensor(deltaserve.load_tokenizer(default_model_path()).encode(corpus.validation_text()[:20_000]))


def test_training_with_noise_changes_the_steps_and_still_learns(text):
    """The same run with noise differs (the layers really run quantised) and still lowers the loss; the exported
    parameter names are the plain model's."""
    plain, noisy = _model(), _model()
    names = list(plain.state_dict())
    before = evaluate(noisy, text[:257], seq_len=64, max_tokens=256)
    noise = QuantNoise.attach(noisy, get_scheme("mxfp"), 0.5, seed=0)
    kw = dict(steps=12, batch=2, seq_len=64, lr=1e-2, seed=0, warmup=2, progress=False)
    res_plain = train(plain, text, **kw)
    res_noisy = train(noisy, text, quant_noise=noise, **kw)
    assert res_noisy["losses"] != res_plain["losses"]
    assert evaluate(noisy, text[:257], seq_len=64, max_tokens=256) < before - 0.3
    assert list(noisy.state_dict()) == names
    twin = _model()
    twin.load_state_dict(noisy.state_dict())
    for m in noise.layers:
        m.noisy = True
    noisy.eval(), twin.eval()
    with torch.no_grad():  # in eval mode the noisy layers are plain, whatever the last draw
        assert torch.equal(noisy(text[:64], step_batch(1, 64)), twin(text[:64], step_batch(1, 64)))


def test_a_noisy_run_resumes_exactly(text, tmp_path):
    """The noise's draws are part of the training state: a run interrupted and resumed takes the same steps."""
    kw = dict(steps=10, batch=2, seq_len=64, lr=1e-2, seed=0, warmup=2, progress=False)

    def run(**more):
        model = _model()
        return train(model, text, quant_noise=QuantNoise.attach(model, get_scheme("mxfp"), 0.5, seed=3), **kw, **more)

    full = run()
    state = tmp_path / "state.safetensors"
    run(state_path=state, ckpt_every=3, stop_at=6)
    resumed = run(state_path=state, ckpt_every=3)
    assert resumed["step"] == 10 and resumed["losses"] == full["losses"]
