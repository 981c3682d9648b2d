"""Layer-level oracles (docs/oracles.md §7.4, docs/model.md §9.2–9.5).

(a) Gated MLA: transformers' `KimiLinearAttention` (NoPE MLA) is the oracle up to the attention output (captured at
    its `o_proj` input); the K3 output gate σ(g_proj x) and o_proj are applied here by hand. deltaserve's MLAttention
    with `mla_use_output_gate` gets the same weights and must agree, on the full forward (expanded form) and on
    prefill + token-by-token decode through a cache (absorbed form).
(b) Absorbed vs expanded MLA (`mla_attention_absorbed` vs `mla_attention_ref`) and an explicit per-head loop
    written here, with causal (incl. a cached prefix) and random sparse masks.
(c) DSA selection rule (M§9.5) on constructed ties: score desc, then larger position first; -0.0 == +0.0; whole
    causal range when it holds ≤ k keys; −1 padding; NaN below every finite score.
"""

from __future__ import annotations

import pytest
import torch
from oracle_utils import kimi_linear_config, randomize_

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ModelCache, StepBatch
from deltaserve.layers.mla import MLAttention
from deltaserve.ops.indexer import select_topk, selection_mask
from deltaserve.ops.mla import mla_attention_absorbed, mla_attention_expanded, mla_attention_ref

T = 40
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _fp32():
    torch.set_default_dtype(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# (a) gated MLA vs transformers' kimi_linear MLA + hand gate

def _k3_mla_config(q_lora_rank: int | None) -> ModelConfig:
    """A one-layer kimi_k3 config: NoPE MLA with the K3 output gate, geometry of docs/oracles.md §3.2."""
    return ModelConfig.from_dict({
        "model_type": "kimi_k3",
        "text_config": {
            "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 1,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4,
            "q_lora_rank": q_lora_rank, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "mla_use_nope": True, "mla_use_output_gate": True, "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "linear_attn_config": {"kda_layers": [], "full_attn_layers": [1], "num_heads": 4, "head_dim": 16},
        },
    })


class _DictCache(ModelCache):
    """Minimal MLA cache: one growing latent tensor per (layer, handle)."""

    def __init__(self):
        self.latent: dict = {}

    def kda_state(self, layer, handle):  # pragma: no cover — no KDA layer here
        raise AssertionError("unexpected KDA state request")

    def write_mla(self, layer, handle, start, latent, index_keys):
        old = self.latent.get((layer, handle), latent[:0])
        assert old.shape[0] == start
        self.latent[(layer, handle)] = torch.cat([old, latent])

    def read_mla(self, layer, handle, length):
        rows = self.latent[(layer, handle)]
        assert rows.shape[0] == length
        return rows, None


@pytest.fixture(params=[None, 48], ids=["q_proj", "q_lora"])
def gated_pair(request):
    """(HF KimiLinearAttention, g_proj weight, deltaserve gated MLAttention with the same weights, input x [T, d])."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    q_lora = request.param
    hf_cfg = kimi_linear_config(q_lora_rank=q_lora)
    hf_cfg._attn_implementation = "eager"
    hf = randomize_(KimiLinearAttention(hf_cfg, layer_idx=3).float().eval(), seed=11)
    g = torch.Generator().manual_seed(12)
    w_gate = torch.randn(4 * 16, 64, generator=g) * 64 ** -0.5
    x = torch.randn(T, 64, generator=g)

    ours = MLAttention(_k3_mla_config(q_lora), layer=0, use_indexer=False).eval()
    state = dict(hf.state_dict())
    state["g_proj.weight"] = w_gate
    ours.load_state_dict(state, strict=True)  # names coincide; strict = every tensor copied exactly once
    return hf, w_gate, ours, x


@torch.no_grad()
def _oracle_gated(hf, w_gate: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated output, ungated output) of the HF layer: attention output captured before o_proj, gate by hand."""
    captured = []
    handle = hf.o_proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    mask = torch.full((T, T), -INF).triu(1).view(1, 1, T, T)
    try:
        ungated = hf(x.unsqueeze(0), attention_mask=mask)[0][0]
    finally:
        handle.remove()
    attn = captured[0][0]  # [T, H*v]
    gated = torch.nn.functional.linear(attn * torch.sigmoid(x @ w_gate.t()), hf.o_proj.weight)
    return gated, ungated


def test_gated_mla_matches_oracle_full_forward(gated_pair):
    hf, w_gate, ours, x = gated_pair
    want, ungated = _oracle_gated(hf, w_gate, x)
    with torch.no_grad():
        got = ours(x, StepBatch.single(T))
    assert (want - ungated).abs().max() > 0.05 * ungated.abs().max(), "the gate should change the output"
    err = (got - want).abs().max().item()
    print(f"gated MLA full forward: max |Δ| = {err:.3g}")
    assert err <= 1e-5, f"gated MLA full forward: max |Δ| = {err:.3g}"


def test_gated_mla_matches_oracle_prefill_then_decode(gated_pair):
    """Prefill 17 tokens (expanded form over the cache), then decode one token at a time (absorbed form)."""
    hf, w_gate, ours, x = gated_pair
    want, _ = _oracle_gated(hf, w_gate, x)
    cache, P = _DictCache(), 17
    rows = []
    with torch.no_grad():
        rows.append(ours(x[:P], StepBatch.single(P, cache=cache, handle="s")))
        for t in range(P, T):
            rows.append(ours(x[t:t + 1], StepBatch.single(1, context_len=t, cache=cache, handle="s")))
    got = torch.cat(rows)
    assert cache.latent[(0, "s")].shape == (T, 32 + 8)  # [c | k_pe] per token, one copy for all heads
    err = (got - want).abs().max().item()
    print(f"gated MLA prefill+decode: max |Δ| = {err:.3g}")
    assert err <= 1e-5, f"gated MLA prefill+decode: max |Δ| = {err:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# (b) absorbed vs expanded MLA

H, N_NOPE, RHO, V, R = 4, 16, 8, 16, 32


def _mla_inputs(n_q: int, S: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(n_q, H, N_NOPE, generator=g)
    q_pe = torch.randn(n_q, H, RHO, generator=g)
    latent = torch.randn(S, R, generator=g)
    k_pe = torch.randn(S, RHO, generator=g)
    w_kv_b = torch.randn(H * (N_NOPE + V), R, generator=g) * R ** -0.5
    return [t.to(dtype) for t in (q_nope, q_pe, latent, k_pe, w_kv_b)]


def _mla_loop(q_nope, q_pe, latent, k_pe, w_kv_b, scale, allowed):
    """Explicit per-(query, head) reference of docs/model.md §9.2 in float64."""
    q_nope, q_pe, latent, k_pe, w_kv_b = (t.double() for t in (q_nope, q_pe, latent, k_pe, w_kv_b))
    n_q, S = allowed.shape
    out = torch.zeros(n_q, H, V, dtype=torch.float64)
    for h in range(H):
        w = w_kv_b[h * (N_NOPE + V):(h + 1) * (N_NOPE + V)]
        k_nope, value = latent @ w[:N_NOPE].t(), latent @ w[N_NOPE:].t()
        for t in range(n_q):
            keys = allowed[t].nonzero().flatten()
            s = (k_nope[keys] @ q_nope[t, h] + k_pe[keys] @ q_pe[t, h]) * scale
            out[t, h] = torch.softmax(s, 0) @ value[keys]
    return out


def _masks(n_q: int, S: int, seed: int) -> dict[str, torch.Tensor]:
    pos = torch.arange(S - n_q, S)  # a chunk after a cached prefix of S - n_q tokens
    causal = torch.arange(S).unsqueeze(0) <= pos.unsqueeze(1)
    g = torch.Generator().manual_seed(seed)
    sparse = causal & (torch.rand(n_q, S, generator=g) < 0.3)
    sparse[torch.arange(n_q), pos] = True  # every row keeps at least one key
    return {"causal": causal, "sparse": sparse}


@pytest.mark.parametrize("mask_kind", ["causal", "sparse"])
@pytest.mark.parametrize("n_q,S", [(24, 24), (9, 33), (1, 30)], ids=["prefill", "chunk", "decode"])
def test_absorbed_equals_expanded_fp32(mask_kind, n_q, S):
    args = _mla_inputs(n_q, S, seed=n_q * 100 + S)
    allowed = _masks(n_q, S, seed=S)[mask_kind]
    scale = (N_NOPE + RHO) ** -0.5
    ref = mla_attention_ref(*args, V, scale, allowed)
    absorbed = mla_attention_absorbed(*args, V, scale, allowed)
    fused = mla_attention_expanded(*args, V, scale, allowed)  # the fast prefill twin (fused attention)
    loop = _mla_loop(*args, scale, allowed)
    assert ref.shape == absorbed.shape == fused.shape == (n_q, H, V) and ref.dtype == fused.dtype == torch.float32
    assert (ref.double() - loop).abs().max() <= 1e-5
    assert (absorbed.double() - loop).abs().max() <= 1e-5
    assert (fused.double() - loop).abs().max() <= 1e-5
    assert (absorbed - ref).abs().max() <= 1e-5
    print(f"absorbed vs expanded: {(absorbed - ref).abs().max().item():.3g}")
    if mask_kind == "sparse" and n_q > 1:  # the mask is honoured (not silently causal)
        causal = mla_attention_ref(*args, V, scale, _masks(n_q, S, seed=S)["causal"])
        assert (causal - ref).abs().max() > 1e-2


@pytest.mark.parametrize("n_q,S,kind", [(40, 40, "causal"), (40, 40, "sparse"), (9, 33, "causal")])
def test_expanded_takes_the_kernels_causal_form_only_for_a_plain_causal_chunk(monkeypatch, n_q, S, kind):
    """mla_attention_expanded hands a chunk with no cached prefix under the causal bound to the fused kernel's
    own causal form, bit for bit the masked result (bf16); a sparse mask or a chunk after a prefix keeps the mask."""
    import deltaserve.ops.mla as mla_ops
    args = _mla_inputs(n_q, S, seed=7, dtype=torch.bfloat16)
    allowed = _masks(n_q, S, seed=8)[kind]
    scale = (N_NOPE + RHO) ** -0.5
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(kw["is_causal"]) or sdpa(*a, **kw))
    fast = mla_attention_expanded(*args, V, scale, allowed)
    monkeypatch.setattr(mla_ops.torch, "equal", lambda *a: False)  # force the masked form
    masked = mla_attention_expanded(*args, V, scale, allowed)
    monkeypatch.undo()
    assert seen == [kind == "causal" and n_q == S, False]
    assert torch.equal(fast, masked)


def test_absorbed_and_expanded_bf16_close():
    """bf16 inputs: both forms stay within bf16 rounding of the fp64 loop (docs/model.md §9.3)."""
    n_q, S = 16, 40
    args = _mla_inputs(n_q, S, seed=5, dtype=torch.bfloat16)
    allowed = _masks(n_q, S, seed=6)["sparse"]
    scale = (N_NOPE + RHO) ** -0.5
    loop = _mla_loop(*args, scale, allowed)
    for fn in (mla_attention_ref, mla_attention_absorbed, mla_attention_expanded):
        out = fn(*args, V, scale, allowed)
        assert out.dtype == torch.bfloat16
        rel = ((out.double() - loop).norm() / loop.norm()).item()
        assert rel <= 2e-2, f"{fn.__name__}: relative error {rel:.3g} in bf16"


# ---------------------------------------------------------------------------------------------------------------
# (c) DSA selection rule

def _sel(scores, positions, k) -> list[list[int]]:
    s = torch.tensor(scores, dtype=torch.float32)
    if s.ndim == 1:
        s = s.unsqueeze(0)
    out = select_topk(s, torch.tensor(positions), k)
    assert out.shape == (s.shape[0], k) and out.dtype in (torch.int32, torch.int64)
    return out.tolist()


def test_select_ties_prefer_larger_positions():
    assert _sel([1.0] * 10, [9], 3) == [[9, 8, 7]]
    # ties at the cut only: the strictly larger score first, then the tied group from the largest position
    assert _sel([5.0, 2.0, 2.0, 7.0, 2.0, 2.0, 0.5, 2.0], [7], 4) == [[3, 0, 7, 5]]
    # the same rule for ReLU zeros (the common case, M§9.5)
    assert _sel([0.0, 0.0, 0.3, 0.0, 0.0, 0.0], [5], 2) == [[2, 5]]


def test_select_negative_zero_equals_positive_zero():
    # -0.0 at the larger position must win the tie with +0.0 (a bitwise or sign-aware sort would rank it lower)
    assert _sel([-1.0, -1.0, 0.0, -1.0, -1.0, -0.0, -1.0, -1.0], [7], 1) == [[5]]
    assert _sel([-1.0, -1.0, -0.0, -1.0, -1.0, 0.0, -1.0, -1.0], [7], 1) == [[5]]
    assert _sel([0.0, -0.0, 0.0, -0.0, -1.0], [4], 3) == [[3, 2, 1]]


def test_select_all_when_causal_range_fits_and_pad():
    # row t at position t: positions ≤ t only, all of them once t + 1 ≤ k, whatever the scores (future keys are
    # huge, a valid key is NaN); -1 padding after the valid entries
    scores = [[NAN, 9e9, 9e9, 9e9, 9e9, 9e9],
              [3.0, -2.0, 9e9, 9e9, 9e9, 9e9],
              [-5.0, -6.0, -7.0, 9e9, 9e9, 9e9]]
    got = _sel(scores, [0, 1, 2], 4)
    assert [sorted(r[: t + 1]) for t, r in enumerate(got)] == [[0], [0, 1], [0, 1, 2]]
    assert [r[t + 1:] for t, r in enumerate(got)] == [[-1] * 3, [-1] * 2, [-1]]
    # exactly k candidates: no padding, the full range
    assert sorted(_sel([1.0, 2.0, 3.0, 9e9], [2], 3)[0]) == [0, 1, 2]
    # more candidates than k: only valid positions, k of them
    assert _sel([4.0, 1.0, 3.0, 2.0, 9e9, 9e9], [3], 2) == [[0, 2]]


def test_select_nan_ranks_below_finite():
    # NaN at positions 4 and 1; finite scores first (even very negative ones), then NaNs by the position rule;
    # never a future key (positions 6..9 carry +inf/large scores but lie beyond the query at position 5)
    row = [-1e30, NAN, 2.0, -3.0, NAN, 1.0, INF, 9e9, 9e9, 9e9]
    assert _sel(row, [5], 4) == [[2, 5, 3, 0]]
    assert _sel(row, [5], 5) == [[2, 5, 3, 0, 4]]
    assert _sel(row, [5], 6) == [[2, 5, 3, 0, 4, 1]]  # causal range (6) ≤ k: everything, in rank order


def test_select_rows_are_independent_and_mask_roundtrip():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(7, 12, generator=g)
    pos = torch.tensor([0, 3, 4, 5, 8, 10, 11])
    k = 4
    sel = select_topk(scores, pos, k)
    for t in range(7):
        valid = scores[t, : pos[t] + 1]
        want = torch.sort(valid, descending=True, stable=True).indices[:k].tolist()
        assert sel[t, : len(want)].tolist() == want
        assert (sel[t, len(want):] == -1).all()
    mask = selection_mask(sel, 12)
    assert mask.shape == (7, 12) and mask.sum(-1).tolist() == [min(int(p) + 1, k) for p in pos]
    for t in range(7):
        assert set(mask[t].nonzero().flatten().tolist()) == {s for s in sel[t].tolist() if s >= 0}
