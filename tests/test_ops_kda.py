"""KDA core ops and the short convolution against FLA's naive KDA and transformers (docs/oracles.md §2, §3.5).

Tolerance: ≤ 1e-5 absolute on unit-scale fp32 data (the references agree among themselves to ~2e-6).
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Callable

import pytest
import torch

from deltaserve.ops.conv import short_conv, short_conv_ref, short_conv_update
from deltaserve.ops.kda import (
    kda_chunk,
    kda_chunk_ref,
    kda_gate,
    kda_recurrent,
    kda_recurrent_ref,
    l2_normalize,
)

TOL = 1e-5
H, K, V = 3, 16, 24          # K != V so that a transposed state layout cannot pass by accident
KDA_FNS: list[Callable] = [kda_recurrent_ref, kda_recurrent, kda_chunk_ref, kda_chunk]
GATES = [None, -5.0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is fastest and immune to oversubscription on a busy machine
    (measured 4.5 s vs 0.09 s for a split test under load); restored afterwards for other modules."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _fp32_deterministic():
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def naive() -> ModuleType:
    """FLA's naive KDA, loaded by file path: importing the ``fla`` package needs triton (docs/oracles.md §2)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention not installed")
    path = os.path.join(spec.submodule_search_locations[0], "ops", "kda", "naive.py")
    file_spec = importlib.util.spec_from_file_location("kda_naive", path)
    mod = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(mod)
    return mod


def _hf_kimi() -> ModuleType:
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _unwrap(fn: Callable) -> Callable:
    """transformers wraps its torch fallbacks in a hub/FLA dispatcher; call the pure-PyTorch function itself."""
    return getattr(fn, "__wrapped__", fn)


def make_inputs(T: int, lower_bound: float | None, seed: int = 0, raw: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen)
    if not raw:
        q, k = l2_normalize(q), l2_normalize(k)
    v = torch.randn(T, H, V, generator=gen)
    u = torch.randn(T, H, K, generator=gen)
    A_log = 0.3 * torch.randn(H, generator=gen)
    g = kda_gate(u, A_log, lower_bound)
    beta = torch.rand(T, H, generator=gen)
    S0 = torch.randn(H, K, V, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------------------------
# KDA core vs FLA naive and transformers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("T", [1, 100, 128])
@pytest.mark.parametrize("fn", KDA_FNS, ids=lambda f: f.__name__)
def test_vs_fla_naive_recurrent(naive, fn, T, lower_bound):
    x = make_inputs(T, lower_bound)
    S0 = x["initial_state"].clone()
    o, S = fn(**x)
    o_ref, S_ref = naive.naive_recurrent_kda(
        x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None],
        initial_state=x["initial_state"][None], output_final_state=True)
    assert o.shape == (T, H, V) and S.shape == (H, K, V)
    assert o.dtype == S.dtype == torch.float32
    assert _maxdiff(o, o_ref[0]) <= TOL
    assert _maxdiff(S, S_ref[0]) <= TOL
    assert torch.equal(x["initial_state"], S0), "initial_state modified in place"


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("fn", KDA_FNS, ids=lambda f: f.__name__)
def test_vs_fla_naive_chunk(naive, fn, lower_bound):
    x = make_inputs(128, lower_bound, seed=1)
    o, S = fn(**x)
    o_ref, S_ref = naive.naive_chunk_kda(
        x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None],
        initial_state=x["initial_state"][None], output_final_state=True, chunk_size=64)
    assert _maxdiff(o, o_ref[0]) <= TOL
    assert _maxdiff(S, S_ref[0]) <= TOL


@pytest.mark.parametrize("fn", KDA_FNS, ids=lambda f: f.__name__)
def test_zero_initial_state_default(fn):
    x = make_inputs(70, -5.0, seed=2)
    zero = dict(x, initial_state=torch.zeros(H, K, V))
    x.pop("initial_state")
    o_a, S_a = fn(**x)
    o_b, S_b = fn(**zero)
    assert _maxdiff(o_a, o_b) == 0 and _maxdiff(S_a, S_b) == 0


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("T", [1, 100, 128])
@pytest.mark.parametrize("fn", KDA_FNS, ids=lambda f: f.__name__)
def test_vs_transformers(fn, T, lower_bound):
    hf = _hf_kimi()
    x = make_inputs(T, lower_bound, seed=3, raw=True)   # HF normalises q, k itself (use_qk_l2norm_in_kernel)
    o, S = fn(l2_normalize(x["q"]), l2_normalize(x["k"]), x["v"], x["g"], x["beta"],
              initial_state=x["initial_state"])
    args = (x["q"][None], x["k"][None], x["v"][None])
    kw = dict(g=x["g"][None], beta=x["beta"][None], initial_state=x["initial_state"][None].clone(),
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    for ref in (hf.recurrent_kimi_delta_attention, hf.chunk_kimi_delta_attention):
        o_ref, S_ref = _unwrap(ref)(*args, **kw)
        assert _maxdiff(o, o_ref[0]) <= TOL, ref.__name__
        assert _maxdiff(S, S_ref[0]) <= TOL, ref.__name__


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("fn", KDA_FNS, ids=lambda f: f.__name__)
def test_split_consistency(fn, lower_bound):
    """A prefix then the rest with the carried state equals one pass (any split; chunk boundaries move)."""
    T = 130
    x = make_inputs(T, lower_bound, seed=4)
    o_full, S_full = fn(**x)
    seq = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    for split in (1, 63, 64, 65, 100, 129):
        o1, S1 = fn(**{n: t[:split] for n, t in seq.items()}, initial_state=x["initial_state"])
        o2, S2 = fn(**{n: t[split:] for n, t in seq.items()}, initial_state=S1)
        assert _maxdiff(torch.cat([o1, o2]), o_full) <= TOL, split
        assert _maxdiff(S2, S_full) <= TOL, split


def test_chunk_prefill_then_recurrent_decode():
    x = make_inputs(96, -5.0, seed=5)
    o_full, S_full = kda_recurrent_ref(**x)
    seq = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    o_pre, S = kda_chunk(**{n: t[:80] for n, t in seq.items()}, initial_state=x["initial_state"])
    outs = [o_pre]
    for t in range(80, 96):
        o_t, S = kda_recurrent(**{n: v[t:t + 1] for n, v in seq.items()}, initial_state=S)
        outs.append(o_t)
    assert _maxdiff(torch.cat(outs), o_full) <= TOL
    assert _maxdiff(S, S_full) <= TOL


def _recurrent_fp64(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain fp64 transcription of docs/model.md §8.5, the ground truth for precision checks."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    q = q * q.shape[-1] ** -0.5
    S = x["initial_state"].double().clone()
    o = torch.empty_like(v)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        S = S + k[t][..., None] * (beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S)))[:, None]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


@pytest.mark.parametrize("fn", KDA_FNS, ids=lambda f: f.__name__)
def test_strong_mixed_decay_precision(fn):
    """Very negative gates mixed with weak ones (the Kimi gate is unbounded below): chunked forms must stay
    finite and as precise as the recurrence. Γ_i − Γ_j taken as a difference of two long cumsums would lose
    ~|Γ|·eps (seen: 1.8e-5 on the state); deltaserve sums the segments directly."""
    T = 128
    x = make_inputs(T, None, seed=6)
    gen = torch.Generator().manual_seed(60)
    strong = torch.rand(T, H, K, generator=gen) < 0.5
    x["g"] = torch.where(strong, -40.0 * torch.rand(T, H, K, generator=gen),
                         -0.05 * torch.rand(T, H, K, generator=gen))
    o_64, S_64 = _recurrent_fp64(x)
    o, S = fn(**x)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert _maxdiff(o, o_64) <= 1e-6 and _maxdiff(S, S_64) <= 1e-6


def test_chunk_sizes():
    x = make_inputs(100, None, seed=7)
    o_ref, S_ref = kda_recurrent_ref(**x)
    for C, B in ((32, 8), (64, 16), (64, 64), (16, 16)):
        o, S = kda_chunk(**x, chunk_size=C, sub_chunk=B)
        assert _maxdiff(o, o_ref) <= TOL and _maxdiff(S, S_ref) <= TOL, (C, B)
    o, S = kda_chunk_ref(**x, chunk_size=32)
    assert _maxdiff(o, o_ref) <= TOL and _maxdiff(S, S_ref) <= TOL


# ----------------------------------------------------------------------------------------------------------------
# Gates and the L2 norm
# ----------------------------------------------------------------------------------------------------------------


def test_l2_normalize_formula():
    x = torch.randn(5, H, K)
    ref = x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    assert _maxdiff(l2_normalize(x), ref) <= 1e-6
    assert l2_normalize(torch.zeros(2, K)).abs().max() == 0   # eps inside the sqrt: no NaN on zero vectors


def test_lower_bound_gate_hand_formula():
    lam = -5.0
    u = torch.randn(50, H, K)
    A_log = 0.5 * torch.randn(H)
    g = kda_gate(u, A_log, lam)
    assert g.dtype == torch.float32 and g.shape == u.shape
    assert (g < 0).all() and (g > lam).all()
    a = A_log.double().exp().view(1, H, 1)
    ref = lam / (1.0 + torch.exp(-a * u.double()))
    assert _maxdiff(g, ref) <= 2e-6


def test_kimi_gate_hand_formula():
    u = 10.0 * torch.randn(50, H, K)             # reaches the u > 20 identity branch
    A_log = 0.5 * torch.randn(H)
    g = kda_gate(u, A_log, None)
    a = A_log.double().exp().view(1, H, 1)
    ud = u.double()
    ref = -a * torch.where(ud > 20, ud, torch.log1p(torch.exp(ud)))
    assert (g <= 0).all()
    assert _maxdiff(g, ref) <= 1e-5 * max(1.0, ref.abs().max().item())


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2 and p.shape[-1] > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _gate_from_module(gate: torch.nn.Module, x: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """deltaserve's gate fed with the module's own weights (A_log narrowed/flattened to [H])."""
    nh, hd = gate.num_heads, gate.head_dim
    u = gate.f_b_proj(gate.f_a_proj(x[0])).float() + gate.dt_bias.float()
    return kda_gate(u.view(-1, nh, hd), gate.A_log.detach().reshape(-1)[:nh], lower_bound)


def test_kimi_gate_vs_transformers():
    hf = _hf_kimi()
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    cfg = KimiLinearConfig(hidden_size=64, num_hidden_layers=4, linear_attn_config={
        "num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    gate = hf.KimiLinearForgetGate(cfg).float().eval()
    _randomise(gate, seed=11)
    with torch.no_grad():
        gate.dt_bias[:8] += 25.0                  # exercise the softplus identity branch
        x = torch.randn(1, 24, 64)
        ref = gate(x)[0]
        g = _gate_from_module(gate, x, None)
    assert _maxdiff(g, ref) <= 1e-5


def test_lower_bound_gate_vs_glm5_next():
    mod = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(
        hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention", "deepseek_sparse_attention"] * 2,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "kda_layers": [0, 2], "full_attn_layers": [1, 3]})
    assert cfg.linear_lower_bound == -5.0
    gate = mod.Glm5NextTextForgetGate(cfg).float().eval()
    _randomise(gate, seed=12)
    with torch.no_grad():
        x = torch.randn(1, 24, 64)
        ref = gate(x)[0]
        g = _gate_from_module(gate, x, -5.0)
    assert _maxdiff(g, ref) <= 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Short convolution
# ----------------------------------------------------------------------------------------------------------------

CONV_FNS: list[Callable] = [short_conv_ref, short_conv, short_conv_update]


@pytest.mark.parametrize("fn", CONV_FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_vs_transformers(fn, dtype):
    hf = _hf_kimi()
    T, C, W = 37, 48, 4
    x = torch.randn(T, C).to(dtype)
    w = torch.randn(C, W) * 0.5
    y, st = fn(x, w, None)
    ref = _unwrap(hf.causal_conv1d_fn)(x.t()[None], w, activation="silu")[0].t()
    assert y.dtype == dtype and st.dtype == torch.float32 and st.shape == (C, W - 1)
    tol = TOL if dtype == torch.float32 else 1e-2   # bf16: at most one rounding step apart
    assert _maxdiff(y, ref) <= tol
    assert torch.equal(st, x[-(W - 1):].float().t())


def test_short_conv_hand_formula():
    T, C, W = 9, 5, 4
    x, w, st = torch.randn(T, C), torch.randn(C, W), torch.randn(C, W - 1)
    hist = torch.cat([st.t(), x])                          # previous W-1 inputs, oldest first, then x
    ref = torch.stack([torch.nn.functional.silu((w.t() * hist[t:t + W]).sum(0)) for t in range(T)])
    for fn in CONV_FNS:
        y, new = fn(x, w, st)
        assert _maxdiff(y, ref) <= TOL, fn.__name__
        assert torch.equal(new, hist[-(W - 1):].t())


@pytest.mark.parametrize("fn", CONV_FNS, ids=lambda f: f.__name__)
def test_short_conv_splits(fn):
    T, C, W = 40, 24, 4
    x, w = torch.randn(T, C), torch.randn(C, W)
    y_full, st_full = short_conv_ref(x, w, None)
    for cuts in ((1,), (2, 3), (5, 17, 18, 39), tuple(range(1, T))):
        st, ys = None, []
        bounds = (0, *cuts, T)
        for a, b in zip(bounds[:-1], bounds[1:]):
            y, st = fn(x[a:b], w, st)
            ys.append(y)
        assert _maxdiff(torch.cat(ys), y_full) <= TOL, cuts
        assert torch.equal(st, st_full)


def test_short_conv_update_vs_transformers_decode():
    """Token-by-token decode against HF's W-wide in-place window (ours keeps W-1, carried functionally)."""
    hf = _hf_kimi()
    T, C, W = 12, 16, 4
    x, w = torch.randn(T, C), torch.randn(C, W)
    prefix = 5
    _, st = short_conv(x[:prefix], w, None)
    hf_state = torch.cat([torch.zeros(C, 1), x[:prefix].t()], dim=1)[:, -W:][None].clone()
    for t in range(prefix, T):
        y, st = short_conv_update(x[t:t + 1], w, st)
        y_hf = _unwrap(hf.causal_conv1d_update)(x[t:t + 1].t()[None], hf_state, w, activation="silu")
        assert _maxdiff(y, y_hf[0].t()) <= TOL
        assert torch.equal(st, hf_state[0, :, 1:])


def test_short_conv_does_not_modify_state():
    x, w, st = torch.randn(3, 8), torch.randn(8, 4), torch.randn(8, 3)
    keep = st.clone()
    for fn in CONV_FNS:
        fn(x, w, st)
        assert torch.equal(st, keep)
