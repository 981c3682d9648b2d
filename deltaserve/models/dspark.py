"""The DSpark drafter (docs/serving.md §9.4): a small dense stack that drafts a block of `block_size` tokens at once,
and a low-rank Markov head that makes each draft depend on the one before it.

* Context: the target's pre-norm final state at every position before the anchor, projected and normalised
  (`context`: H = RMSNorm(W_c h)). Each layer turns H into MLA latent rows [c | k_pe] (`latents`, RoPE at the
  context position): these are the keys and values every block query sees, and serving keeps them in the drafter's
  own pages.
* Block: the anchor (the newest token, at position P) and `block_size - 1` mask tokens at P + 1 ..., embedded with
  the target's embedding; slot k's output predicts the token at P + k + 1. Attention inside a block is not causal
  (every slot sees every slot) and sees the whole context before P.
* Layers: pre-norm residual, MLA with RoPE (q_lora, kv_lora; the plain, non-absorbed form: this stack is small) and
  a SiLU-gated MLP.
* Logits: the target's LM head over the final norm (U_k), plus the Markov bias W2 W1[x_{k-1}] of the token before
  slot k's target (x_{-1} = the anchor): slot k's distribution is conditioned on the draft before it, so drafts are
  taken left to right and each one's corrected distribution is its draft probability q_k.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..ops.rope import rotate_interleaved

MODEL_TYPE = "k3_dspark"


@dataclass(frozen=True)
class DSparkConfig:
    """A drafter's config.json (`model_type` k3_dspark). `context_dim`: the width of the target state it reads;
    `vocab_size` must be the target's (it shares the target's embedding and LM head)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    context_dim: int
    block_size: int
    mask_token_id: int
    markov_rank: int
    rope_theta: float = 50000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, raw: dict) -> "DSparkConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"a DSpark drafter's config.json has model_type {MODEL_TYPE!r}, got "
                              f"{raw.get('model_type')!r}")
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names if n not in raw and n not in ("rope_theta", "rms_norm_eps"))
        if missing:
            raise ConfigError(f"the DSpark drafter's config.json lacks {missing}")
        config = cls(**{n: raw[n] for n in names if n in raw})
        if config.block_size < 1 or config.markov_rank < 0 or not 0 <= config.mask_token_id < config.vocab_size:
            raise ConfigError("DSpark config: block_size must be >= 1, markov_rank >= 0 and mask_token_id a token id")
        return config

    def to_dict(self) -> dict:
        return {"model_type": MODEL_TYPE, "architectures": ["K3DSparkDrafter"], **asdict(self)}


class DSparkAttention(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.H, self.n, self.rho, self.v, self.r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                                   c.v_head_dim, c.kv_lora_rank)
        d = c.hidden_size
        self.q_a_proj = Linear(d, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = Linear(c.q_lora_rank, self.H * (self.n + self.rho))
        self.kv_a_proj_with_mqa = Linear(d, self.r + self.rho)
        self.kv_a_layernorm = RMSNorm(self.r, c.rms_norm_eps)
        self.kv_b_proj = Linear(self.r, self.H * (self.n + self.v))
        self.o_proj = Linear(self.H * self.v, d)
        self.rotary = RotaryEmbedding(self.rho, c.rope_theta, None)
        self.scale = (self.n + self.rho) ** -0.5

    def latents(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Latent rows [c | k_pe] [N, r + rho] of `x` (its rope part rotated at `positions`)."""
        ckv = self.kv_a_proj_with_mqa(x)
        cos, sin = self.rotary.cos_sin(positions)
        k_pe = rotate_interleaved(ckv[:, self.r:], cos, sin).to(x.dtype)
        return torch.cat([self.kv_a_layernorm(ckv[:, :self.r]), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """Queries `x` [Q, d] at `positions` over latent rows `keys` [K, r + rho] (context rows, then the block's own
        from `latents`), `visible` [Q, K] saying which keys each query sees."""
        Q = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(Q, self.H, self.n + self.rho)
        cos, sin = self.rotary.cos_sin(positions)
        q_pe = rotate_interleaved(q[..., self.n:], cos.unsqueeze(1), sin.unsqueeze(1)).to(x.dtype)
        kv = self.kv_b_proj(keys[:, :self.r]).view(-1, self.H, self.n + self.v)
        k = torch.cat([kv[..., :self.n], keys[:, self.r:].unsqueeze(1).expand(-1, self.H, -1)], dim=-1)
        qk = torch.cat([q[..., :self.n], q_pe], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", qk.float(), k.float()) * self.scale
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., self.n:].float()).to(x.dtype)
        return self.o_proj(out.reshape(Q, self.H * self.v))

    def forward_absorbed(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                         num_context: torch.Tensor) -> torch.Tensor:
        """`forward` for B blocks at once, in MLA's absorbed form (serving's twin; tests hold them together): block
        b's queries `x[b]` [G, d] at `positions[b]` see its keys `keys[b]` [T + G, r + rho] (padded context rows,
        then its own block rows) except context rows at or past `num_context[b]`. The queries move into latent
        space through kv_b_proj's key half and the output leaves it through the value half, so context rows are
        read as stored, never expanded per head."""
        B, G, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, G, self.H, self.n + self.rho)
        cos, sin = self.rotary.cos_sin(positions)
        q_pe = rotate_interleaved(q[..., self.n:], cos.unsqueeze(2), sin.unsqueeze(2)).to(x.dtype)
        w = self.kv_b_proj.weight.view(self.H, self.n + self.v, self.r).float()
        q_latent = torch.einsum("bghn,hnr->bghr", q[..., :self.n].float(), w[:, :self.n])
        query = torch.cat([q_latent, q_pe.float()], dim=-1).view(B, G * self.H, -1) * self.scale
        keys = keys.float()
        scores = torch.bmm(query, keys.transpose(1, 2))  # [B, G * H, T + G]
        T = keys.shape[1] - G
        columns = torch.arange(T + G)
        unseen = (columns < T) & (columns.unsqueeze(0) >= num_context.unsqueeze(1))  # [B, T + G]
        scores.masked_fill_(unseen.unsqueeze(1), float("-inf"))
        out_latent = torch.bmm(scores.softmax(-1), keys[..., :self.r]).view(B * G, self.H, self.r)
        out = torch.einsum("qhr,hvr->qhv", out_latent, w[:, self.n:]).to(x.dtype)
        return self.o_proj(out.reshape(B, G, self.H * self.v))


class DSparkLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DSparkAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """The block rows `x` [Q, d] over this layer's context latent rows `context` [T, r + rho]; `visible`
        [Q, T + Q] (context columns, then the block's)."""
        normed = self.input_layernorm(x)
        keys = torch.cat([context, self.self_attn.latents(normed, positions)])
        return self._mlp(x + self.self_attn(normed, positions, keys, visible))

    def forward_blocks(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                       num_context: torch.Tensor) -> torch.Tensor:
        """`forward` for B blocks `x` [B, G, d] at `positions` [B, G], block b over its padded context rows
        `context[b]` [T, r + rho] (the first `num_context[b]` are its own) and its own rows."""
        normed = self.input_layernorm(x)
        own = self.self_attn.latents(normed.flatten(0, 1), positions.flatten()).view(*x.shape[:2], -1)
        return self._mlp(x + self.self_attn.forward_absorbed(normed, positions, torch.cat([context, own], dim=1),
                                                             num_context))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DSparkDrafter(nn.Module):
    """The drafter's own weights; the target's embedding and LM head are passed in (shared, never stored)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = c = config
        self.context_proj = Linear(c.context_dim, c.hidden_size)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(c) for _ in range(c.num_hidden_layers))
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.markov_rank:
            self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
            self.markov_w2 = Linear(c.markov_rank, c.vocab_size)

    def context_latents(self, target_states: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the latent rows [T, r + rho] of the target's states [T, context_dim] at `positions`."""
        h = self.context_norm(self.context_proj(target_states))
        return [layer.self_attn.latents(h, positions) for layer in self.layers]

    def block_states(self, embeds: torch.Tensor, positions: torch.Tensor, contexts: list[torch.Tensor],
                     visible: torch.Tensor) -> torch.Tensor:
        """Final-normed states [Q, d] of the block rows (their embeddings at `positions`) over each layer's context
        rows; `visible` [Q, T + Q]."""
        x = embeds
        for layer, context in zip(self.layers, contexts):
            x = layer(x, positions, context, visible)
        return self.final_norm(x)

    def block_states_batched(self, embeds: torch.Tensor, positions: torch.Tensor, contexts: list[torch.Tensor],
                           num_context: torch.Tensor) -> torch.Tensor:
        """`block_states` for B blocks (serving's form): `embeds` [B, G, d] at `positions` [B, G]; per layer the
        blocks' context rows padded to one length, [B, T, r + rho], of which block b sees the first
        `num_context[b]`. Returns [B, G, d]."""
        x = embeds
        for layer, context in zip(self.layers, contexts):
            x = layer.forward_blocks(x, positions, context, num_context)
        return self.final_norm(x)

    def markov_bias(self, previous: torch.Tensor) -> torch.Tensor | float:
        """W2 W1[x] [.., vocab] for the tokens `previous` before each slot's target (0 without a Markov head)."""
        if not self.config.markov_rank:
            return 0.0
        return self.markov_w2(self.markov_w1(previous)).float()


def block_visibility(context_ends: torch.Tensor, num_context: int, block_size: int) -> torch.Tensor:
    """[A * block_size, num_context + A * block_size] bool: block a's rows see the context positions before
    `context_ends[a]` (its anchor) and every row of block a."""
    A = context_ends.shape[0]
    rows = torch.arange(A).repeat_interleave(block_size)
    context = torch.arange(num_context).unsqueeze(0) < context_ends[rows].unsqueeze(1)
    blocks = rows.unsqueeze(1) == torch.arange(A).repeat_interleave(block_size).unsqueeze(0)
    return torch.cat([context, blocks], dim=1)


def load_drafter(path, target_config, dtype: torch.dtype) -> DSparkDrafter:
    """A drafter folder (config.json + model.safetensors) for a target with `target_config`, in `dtype`. Its
    vocabulary, context width and latent rows must be the target's (it shares the embedding and LM head, and its
    latent rows live in the target's page pool)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the DSpark drafter's config.json ({exc})") from exc
    config = DSparkConfig.from_dict(raw)
    t = target_config
    mismatched = [name for name, mine, theirs in (
        ("vocab_size", config.vocab_size, t.vocab_size), ("context_dim", config.context_dim, t.hidden_size),
        ("hidden_size", config.hidden_size, t.hidden_size), ("kv_lora_rank", config.kv_lora_rank, t.kv_lora_rank),
        ("qk_rope_head_dim", config.qk_rope_head_dim, t.qk_rope_head_dim)) if mine != theirs]
    if mismatched:
        raise ConfigError(f"{path}: the drafter's {mismatched} differ from the target's")
    drafter = DSparkDrafter(config)
    want = drafter.state_dict()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        if names != set(want):
            raise CheckpointError(f"{path}: drafter tensors missing {sorted(set(want) - names)[:5]}, unexpected "
                                  f"{sorted(names - set(want))[:5]}")
        loaded = {n: f.get_tensor(n) for n in names}
    for n, t_ in loaded.items():
        if tuple(t_.shape) != tuple(want[n].shape):
            raise CheckpointError(f"{path}: drafter tensor {n} has shape {tuple(t_.shape)}, expected "
                                  f"{tuple(want[n].shape)}")
    drafter.load_state_dict(loaded)
    return drafter.to(dtype).eval()
