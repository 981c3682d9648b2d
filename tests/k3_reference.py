"""Independent fp32 reference of the Kimi K3 / K3.1 Pro text model, written from the spec formulas
(docs/model.md §3–§13, docs/oracles.md §2, §7, §8) and the checkpoint tensors alone.

Nothing here imports deltaserve. Tensors are read with `safetensors.safe_open`, the config with `json`.

Pieces:
* KDA core: FLA's `naive_recurrent_kda` loaded by file path (docs/oracles.md §2); short conv, K3 lower-bound gate,
  β, L2 norm and the gated output norm (full-rank `g_proj`) by hand (docs/model.md §8).
* NoPE gated MLA in the expanded form (docs/model.md §9.1–9.2), q_a/kv_a norms with eps 1e-6 (docs/model.md §16), and
  the K3.1 lightning indexer (docs/model.md §9.4–9.5: no RoPE, LayerNorm k_norm with eps = rms_norm_eps, weights ×
  H_I^-1/2, scores × D_I^-1/2, score desc then larger position first, all candidates when n_t ≤ top-k) applied as an
  additive mask over positions 0..t.
* AttnRes: the §5.3 loop with Mix of §5.2.
* SiTU dense MLP (§6), router (§10) and latent MoE (§11.1) with explicit loops over tokens and selected experts.
* Final norm + lm_head (§7); MTP (§13).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import torch

_FLA_NAIVE: ModuleType | None = None


def load_fla_naive_kda() -> ModuleType:
    """`fla/ops/kda/naive.py` executed on its own: importing the `fla` package needs triton (docs/oracles.md §2)."""
    global _FLA_NAIVE
    if _FLA_NAIVE is None:
        spec = importlib.util.find_spec("fla")  # locates the package without executing its __init__
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("flash-linear-attention is not installed (test extra)")
        path = os.path.join(spec.submodule_search_locations[0], "ops", "kda", "naive.py")
        file_spec = importlib.util.spec_from_file_location("k3ref_fla_kda_naive", path)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        _FLA_NAIVE = module
    return _FLA_NAIVE


# ---------------------------------------------------------------------------------------------------------------
# formula helpers (fp32)

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """docs/model.md §3: w ⊙ x·rsqrt(mean(x²)+ε) over the last dim."""
    x = x.float()
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """Standard mean/variance LayerNorm (biased variance) with weight and bias."""
    x = x.float()
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w.float() + b.float()


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, beta_lin: float | None) -> torch.Tensor:
    """docs/model.md §6: [β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)] (up branch identity when β_lin is None)."""
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up = u if beta_lin is None else beta_lin * torch.tanh(u / beta_lin)
    return gate * up


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """docs/model.md §5.2 for sources [N, d]: c = g⊙q, s_i = rsqrt(mean(V_i²)+ε)·(V_i·c), α = softmax_i(s),
    Mix = Σ α_i V_i (raw values). One source returns it unchanged."""
    if len(sources) == 1:
        return sources[0]
    c = norm_w.float() * query.float()
    logits = []
    for v in sources:
        vf = v.float()
        logits.append(torch.rsqrt(vf.pow(2).mean(-1) + eps) * (vf * c).sum(-1))
    alpha = torch.softmax(torch.stack(logits, dim=0), dim=0)  # over sources
    out = torch.zeros_like(sources[0], dtype=torch.float32)
    for a, v in zip(alpha, sources):
        out = out + a.unsqueeze(-1) * v.float()
    return out


def hand_topk(row: list[float], n_valid: int, topk: int) -> list[int]:
    """docs/model.md §9.5 for one query row: all candidates 0..n_valid-1 if n_valid ≤ topk, else the topk largest
    with ties broken by larger position first (+0.0 == −0.0)."""
    cand = list(range(n_valid))
    if n_valid <= topk:
        return cand
    return sorted(cand, key=lambda s: (-(row[s] + 0.0), -s))[:topk]


def short_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """docs/model.md §8.2: y_t[c] = SiLU(Σ_j w[c, j]·x_{t−W+1+j}[c]), zero before the sequence start. w [P, 1, W]."""
    w = w.float().reshape(w.shape[0], -1)
    T, W = x.shape[0], w.shape[1]
    y = torch.zeros_like(x, dtype=torch.float32)
    for t in range(T):
        for j in range(W):
            tau = t - W + 1 + j
            if tau >= 0:
                y[t] = y[t] + w[:, j] * x[tau].float()
    return torch.nn.functional.silu(y)


def l2_norm_heads(x: torch.Tensor) -> torch.Tensor:
    """docs/model.md §8.4: x·rsqrt(Σ_c x² + 1e-6) per head (eps inside the sqrt)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint

def read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, {name without 'language_model.' prefix: fp32 tensor}) for single or sharded files."""
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    files = (sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
             if index.is_file() else [path / "model.safetensors"])
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                key = name[len("language_model."):] if name.startswith("language_model.") else name
                tensors[key] = st.get_tensor(name).float()
    return config, tensors


class K3Reference:
    """fp32 reference forward of one sequence of a kimi_k3 checkpoint (K3, or K3.1 when `dsa_config` is present).

    `use_indexer=False` turns the DSA selection off (dense MLA everywhere), to show that selection matters.
    After `hidden()`, `self.index_records[layer]` holds the indexer score matrix [T, T] (−inf above the
    diagonal) and the selected position lists per row.
    """

    MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (docs/model.md §9.1, §16 default)

    def __init__(self, path: Path, use_indexer: bool = True):
        self.config, self.w = read_checkpoint(path)
        tc = self.config["text_config"]
        self.tc = tc
        self.d = tc["hidden_size"]
        self.L = tc["num_hidden_layers"]
        self.eps = tc["rms_norm_eps"]
        la = tc["linear_attn_config"]
        self.kda_layers0 = {l - 1 for l in la["kda_layers"]}  # 1-based in the config
        self.H_k, self.K = la["num_heads"], la["head_dim"]
        self.W = la["short_conv_kernel_size"]
        self.lam = la.get("gate_lower_bound")
        self.full_rank_gate = la.get("use_full_rank_gate", False)
        self.H = tc["num_attention_heads"]
        self.n, self.rho, self.v = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
        self.r = tc["kv_lora_rank"]
        dsa = tc.get("dsa_config") or self.config.get("dsa_config")
        self.dsa_layers0 = {l - 1 for l in dsa["dsa_layers"]} if dsa else set()
        self.H_I = dsa["index_n_heads"] if dsa else 0
        self.D_I = dsa["index_head_dim"] if dsa else 0
        self.topk = dsa["index_topk"] if dsa else 0
        self.beta, self.beta_lin = tc["activation_situ_beta"], tc.get("activation_situ_linear_beta")
        self.S = tc["attn_res_block_size"]
        self.E, self.k_route = tc["num_experts"], tc["num_experts_per_token"]
        self.rsf = tc.get("routed_scaling_factor", 1.0)
        self.renorm = tc.get("moe_renormalize", True)
        self.first_dense = tc.get("first_k_dense_replace", 0)
        self.latent_norm = tc.get("latent_moe_use_norm", False)
        self.use_indexer = use_indexer
        self.index_records: dict[int, dict] = {}

    def t(self, name: str) -> torch.Tensor:
        return self.w[name]

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x.float() @ self.w[name].t()

    # ---- KDA (docs/model.md §8) -----------------------------------------------------------------------------------
    def kda(self, l: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{l}.self_attn."
        T, H, K = x.shape[0], self.H_k, self.K
        q = short_conv_silu(self.lin(x, p + "q_proj.weight"), self.t(p + "q_conv1d.weight"))
        k = short_conv_silu(self.lin(x, p + "k_proj.weight"), self.t(p + "k_conv1d.weight"))
        v = short_conv_silu(self.lin(x, p + "v_proj.weight"), self.t(p + "v_conv1d.weight"))
        u = self.lin(self.lin(x, p + "f_a_proj.weight"), p + "f_b_proj.weight") + self.t(p + "dt_bias")
        u = u.view(T, H, K)
        a = torch.exp(self.t(p + "A_log").reshape(-1)[:H]).view(1, H, 1)  # narrow to the first H, §8.3
        if self.lam is not None:
            g = self.lam * torch.sigmoid(a * u)  # K3 safe gate
        else:
            g = -a * torch.nn.functional.softplus(u)
        beta = torch.sigmoid(self.lin(x, p + "b_proj.weight"))  # [T, H]
        qh, kh = l2_norm_heads(q.view(T, H, K)), l2_norm_heads(k.view(T, H, K))
        core = self.kda_core(qh, kh, v.view(T, H, K), g, beta)  # [T, H, K]
        if self.full_rank_gate:
            gamma = self.lin(x, p + "g_proj.weight").view(T, H, K)
        else:
            gamma = self.lin(self.lin(x, p + "g_a_proj.weight"), p + "g_b_proj.weight").view(T, H, K)
        o = rms_norm(core, self.t(p + "o_norm.weight"), self.eps) * torch.sigmoid(gamma)  # §8.7, ε = rms_norm_eps
        return self.lin(o.reshape(T, H * K), p + "o_proj.weight")

    @staticmethod
    def kda_core(q, k, v, g, beta) -> torch.Tensor:
        """FLA naive recurrent KDA on [T, H, K] inputs (q, k already L2-normalised), scale K^-1/2."""
        fla = load_fla_naive_kda()
        o, _ = fla.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5)
        return o[0].float()

    # ---- MLA / DSA (docs/model.md §9) -----------------------------------------------------------------------------
    def mla(self, l: int, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        p = f"model.layers.{l}.self_attn."
        T, H, n, rho, vd, r = x.shape[0], self.H, self.n, self.rho, self.v, self.r
        pos = torch.arange(T) if positions is None else positions
        c_q = rms_norm(self.lin(x, p + "q_a_proj.weight"), self.t(p + "q_a_layernorm.weight"), self.MLA_NORM_EPS)
        q = self.lin(c_q, p + "q_b_proj.weight").view(T, H, n + rho)
        ckv = self.lin(x, p + "kv_a_proj_with_mqa.weight")
        c = rms_norm(ckv[:, :r], self.t(p + "kv_a_layernorm.weight"), self.MLA_NORM_EPS)
        k_pe = ckv[:, r:]  # NoPE: no rotation
        kv = self.lin(c, p + "kv_b_proj.weight").view(T, H, n + vd)
        k_nope, v = kv[..., :n], kv[..., n:]
        K_full = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, rho)], dim=-1)  # [T, H, n+ρ]
        tau = (n + rho) ** -0.5
        mask = torch.full((T, T), float("-inf"))
        for t in range(T):
            for s in range(T):
                if pos[s] <= pos[t]:
                    mask[t, s] = 0.0
        if l in self.dsa_layers0 and self.use_indexer:
            mask = mask + self.indexer_mask(l, x, c_q, pos)
        out = torch.empty(T, H, vd)
        for h in range(H):
            scores = tau * (q[:, h] @ K_full[:, h].t()) + mask  # [T, S]
            out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h]
        o = out.reshape(T, H * vd)
        if self.tc.get("mla_use_output_gate", False):
            o = o * torch.sigmoid(self.lin(x, p + "g_proj.weight"))
        return self.lin(o, p + "o_proj.weight")

    def indexer_qkw(self, l: int, x: torch.Tensor, c_q: torch.Tensor):
        """docs/model.md §9.4 (K3.1): q_I = wq_b(c_q) [T, H_I, D_I], k_I = LayerNorm(wk x) with ε = rms_norm_eps,
        w = weights_proj(x)·H_I^-1/2."""
        p = f"model.layers.{l}.self_attn.indexer."
        T = x.shape[0]
        q = self.lin(c_q, p + "wq_b.weight").view(T, self.H_I, self.D_I)
        bias = self.w.get(p + "k_norm.bias", torch.zeros(self.D_I))
        k = layer_norm(self.lin(x, p + "wk.weight"), self.t(p + "k_norm.weight"), bias, self.eps)
        w = self.lin(x, p + "weights_proj.weight") * self.H_I ** -0.5
        return q, k, w

    def indexer_scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """I(t, s) = Σ_h w[t,h]·ReLU(D_I^-1/2 · q[t,h]·k[s]) by explicit loops over heads."""
        T, S = q.shape[0], k.shape[0]
        scores = torch.zeros(T, S)
        for h in range(q.shape[1]):
            scores = scores + w[:, h:h + 1] * torch.relu(self.D_I ** -0.5 * (q[:, h] @ k.t()))
        return scores

    def indexer_mask(self, l: int, x: torch.Tensor, c_q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, w = self.indexer_qkw(l, x, c_q)
        scores = self.indexer_scores(q, k, w)
        T = x.shape[0]
        mask = torch.full((T, T), float("-inf"))
        selected = []
        for t in range(T):
            n_t = int(pos[t]) + 1
            sel = hand_topk(scores[t].tolist(), n_t, self.topk)
            selected.append(sel)
            mask[t, sel] = 0.0
        causal = torch.arange(T)[None, :] <= pos[:, None]
        self.index_records[l] = {"scores": scores.masked_fill(~causal, float("-inf")), "selected": selected,
                                 "positions": pos.clone()}
        return mask

    # ---- FFN (docs/model.md §6, §10, §11) ---------------------------------------------------------------------------
    def dense_mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        g = self.lin(x, prefix + "gate_proj.weight")
        u = self.lin(x, prefix + "up_proj.weight")
        return self.lin(situ(g, u, self.beta, self.beta_lin), prefix + "down_proj.weight")

    def route(self, l: int, x_t: torch.Tensor, rsf: float | None = None,
              bias: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        """docs/model.md §10 for one token: s = σ(W x), select top-k of s + bias by (score desc, id asc), weights from
        the unbiased s, renormalised (+1e-20), times routed_scaling_factor."""
        p = f"model.layers.{l}.block_sparse_moe.gate."
        s = torch.sigmoid(self.t(p + "weight") @ x_t.float())
        b = self.t(p + "e_score_correction_bias") if bias is None else bias
        choice = (s + b).tolist()
        idx = sorted(range(len(choice)), key=lambda e: (-choice[e], e))[:self.k_route]
        w = [float(s[e]) for e in idx]
        if self.renorm:
            tot = sum(w) + 1e-20
            w = [wi / tot for wi in w]
        f = self.rsf if rsf is None else rsf
        return idx, [wi * f for wi in w]

    def moe(self, l: int, x: torch.Tensor, rsf: float | None = None) -> torch.Tensor:
        """docs/model.md §11.1, one token and one selected expert at a time (reference order)."""
        p = f"model.layers.{l}.block_sparse_moe."
        out = torch.zeros(x.shape[0], self.d)
        for t in range(x.shape[0]):
            idx, wts = self.route(l, x[t], rsf)
            z = self.t(p + "routed_expert_down_proj.weight") @ x[t]
            r = torch.zeros_like(z)
            for e, we in zip(idx, wts):
                w1 = self.t(p + f"experts.{e}.w1.weight")
                w2 = self.t(p + f"experts.{e}.w2.weight")
                w3 = self.t(p + f"experts.{e}.w3.weight")
                e_out = w2 @ situ(w1 @ z, w3 @ z, self.beta, self.beta_lin)
                r = r + we * e_out
            if self.latent_norm:
                r = rms_norm(r, self.t(p + "routed_expert_norm.weight"), self.eps)
            out[t] = self.t(p + "routed_expert_up_proj.weight") @ r
        if self.tc.get("num_shared_experts", 0):
            out = out + self.dense_mlp(p + "shared_experts.", x)
        return out

    # ---- layers and the stack ----------------------------------------------------------------------------------
    def attn(self, l: int, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.kda(l, x) if l in self.kda_layers0 else self.mla(l, x, positions)

    def ffn(self, l: int, x: torch.Tensor) -> torch.Tensor:
        if l < self.first_dense:
            return self.dense_mlp(f"model.layers.{l}.mlp.", x)
        return self.moe(l, x)

    def mix(self, sources: list[torch.Tensor], prefix: str) -> torch.Tensor:
        return attn_res_mix(sources, self.t(prefix + "_proj.weight")[0], self.t(prefix + "_norm.weight"), self.eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.t("model.embed_tokens.weight")[ids]

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Pre-norm final h [T, d]: the §5.3 AttnRes loop over all L layers and the output mixture."""
        self.index_records = {}
        h = self.embed(ids)
        B: list[torch.Tensor] = []
        for l in range(self.L):
            pre = f"model.layers.{l}."
            p = h
            x = p if len(B) == 0 else self.mix(B + [p], pre + "self_attention_res")
            if l % self.S == 0:
                B.append(p)
                p = None
            a = self.attn(l, rms_norm(x, self.t(pre + "input_layernorm.weight"), self.eps))
            p = a if p is None else p + a
            y = self.mix(B + [p], pre + "mlp_res")
            m = self.ffn(l, rms_norm(y, self.t(pre + "post_attention_layernorm.weight"), self.eps))
            h = p + m
        return self.mix(B + [h], "model.output_attn_res")

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(rms_norm(h, self.t("model.norm.weight"), self.eps), "lm_head.weight")

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits_from_hidden(self.hidden(ids))

    # ---- MTP (docs/model.md §13) ------------------------------------------------------------------------------------
    @torch.no_grad()
    def mtp_step(self, ids: torch.Tensor, h_prev: torch.Tensor, positions: torch.Tensor,
                 j: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step with MTP layer L+j over a row sequence: returns (pre-norm h_next, logits)."""
        l = self.L + j
        pre = f"model.layers.{l}."
        e = self.embed(ids) * (positions != 0).float().unsqueeze(-1)  # embedding zeroed at position 0
        u = self.lin(torch.cat([rms_norm(e, self.t(pre + "enorm.weight"), self.eps),
                                rms_norm(h_prev, self.t(pre + "hnorm.weight"), self.eps)], dim=-1),
                     pre + "eh_proj.weight")  # embedding first
        a = u + self.attn(l, rms_norm(u, self.t(pre + "input_layernorm.weight"), self.eps), positions)
        h_next = a + self.ffn(l, rms_norm(a, self.t(pre + "post_attention_layernorm.weight"), self.eps))
        logits = self.lin(rms_norm(h_next, self.t(pre + "shared_head.norm.weight"), self.eps),
                          pre + "shared_head.head.weight")
        return h_next, logits


def tie_gaps(record: dict, topk: int) -> list[tuple[int, float, float]]:
    """For each indexer row with n_t > topk: (row, |s_(k) − s_(k+1)|, row scale max|s|) over causally valid keys."""
    out = []
    scores, pos = record["scores"], record["positions"]
    for t in range(scores.shape[0]):
        n_t = int(pos[t]) + 1
        if n_t <= topk:
            continue
        row = sorted(scores[t, :n_t].tolist(), reverse=True)
        out.append((t, row[topk - 1] - row[topk], max(abs(row[0]), abs(row[-1]), 1e-30)))
    return out


__all__ = ["K3Reference", "load_fla_naive_kda", "rms_norm", "layer_norm", "situ", "attn_res_mix", "hand_topk",
           "short_conv_silu", "l2_norm_heads", "read_checkpoint", "tie_gaps"]
