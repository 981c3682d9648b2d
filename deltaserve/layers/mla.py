"""Multi-head latent attention: NoPE (Kimi) or RoPE/YaRN (DeepSeek), optional sigmoid output gate (K3), optional
DSA lightning indexer (DeepSeek-V3.2, K3.1) — docs/model.md §9.

Cache rows per token: [c (kv_lora_rank) | k_pe (rope dim)] and, with an indexer, its key [D_I].
"""

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
from ..ops.indexer import indexer_scores_ref, select_topk, selection_mask
from ..ops.mlapo import MLAWeights
from ..ops.qli import qli_topk
from ..ops.rope import rotate_half_split, rotate_interleaved
from .batch import StepBatch
from .derived import Derived
from .linear import Linear
from .norm import LayerNorm, RMSNorm
from .rope import RotaryEmbedding, softmax_scale_factor


class Indexer(nn.Module):
    """Lightning indexer: one key per token (cached), H_I query heads read from the MLA's c_q. Over a
    tensor-parallel group each rank scores with its share of the heads and the scores are summed over the ranks
    before the top-k (`shard.all_reduce`); the head weights keep the scale of all H_I heads."""

    def __init__(self, config: ModelConfig, shard: Shard = Shard()):
        super().__init__()
        h, dim = shard.part(config.index_n_heads), config.index_head_dim
        self.heads, self.head_dim, self.shard = h, dim, shard
        self.weight_scale = config.index_n_heads ** -0.5
        self.wq_b = Linear(config.q_lora_rank, h * dim)
        self.wk = Linear(config.hidden_size, dim)
        self.k_norm = LayerNorm(dim, config.index_norm_eps)
        self.weights_proj = Linear(config.hidden_size, h)
        self.rope_dim = config.qk_rope_head_dim if config.index_use_rope else 0

    def project(self, x: torch.Tensor, c_q: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [N, H_I, D_I], keys [N, D_I] and head weights [N, H_I] (scaled by H_I^-1/2) for all rows."""
        q = self.wq_b(c_q).view(x.shape[0], self.heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        if self.rope_dim:
            cos, sin = cos_sin
            r = self.rope_dim
            q = torch.cat([rotate_half_split(q[..., :r], cos.unsqueeze(1), sin.unsqueeze(1)).to(q.dtype),
                           q[..., r:]], dim=-1)
            k = torch.cat([rotate_half_split(k[..., :r], cos, sin).to(k.dtype), k[..., r:]], dim=-1)
        w = self.weights_proj(x).float() * self.weight_scale
        return q, k, w


class MLAttention(nn.Module):
    """Over a tensor-parallel group each rank runs its share of the heads (`shard`; the latent, shared by all
    heads, is every rank's whole) and its o_proj output is a partial sum the decoder layer all-reduces."""

    def __init__(self, config: ModelConfig, layer: int, use_indexer: bool, shard: Shard = Shard()):
        super().__init__()
        self.config, self.layer, self.shard = config, layer, shard
        d, H = config.hidden_size, shard.part(config.num_heads)
        self.H, self.n, self.rho, self.v, self.r = (H, config.qk_nope_head_dim, config.qk_rope_head_dim,
                                                   config.v_head_dim, config.kv_lora_rank)
        if config.q_lora_rank is None:
            self.q_proj = Linear(d, H * config.qk_head_dim)
        else:
            self.q_a_proj = Linear(d, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, H * config.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(d, self.r + self.rho)
        self.kv_a_layernorm = RMSNorm(self.r, config.mla_norm_eps)
        self.kv_b_proj = Linear(self.r, H * (self.n + self.v))
        if config.mla_use_output_gate:
            self.g_proj = Linear(d, H * self.v)
        self.o_proj = Linear(H * self.v, d)
        self.indexer = Indexer(config, shard) if use_indexer else None
        self.rotary = (RotaryEmbedding(self.rho, config.rope_theta, config.rope_scaling)
                       if config.uses_rope or (use_indexer and config.index_use_rope) else None)
        self.scale = config.qk_head_dim ** -0.5 * softmax_scale_factor(config.rope_scaling if config.uses_rope else None)
        self._mlapo = Derived()  # the fused MLAPO weights
        self._mlapo_sources: list[torch.Tensor] | None = None
        self._kv_b_split = Derived()  # see _split_kv_b

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        pages = batch.cache.mla_pages(self.layer) if batch.cache is not None else None
        if (self.indexer is not None and batch.index_meta is not None and pages is not None
                and batch.write_rows is not None and self._fusable()):
            return self._fused_sparse(x, pages, batch)
        q_nope, q_pe, latent_rows, c_q, cos_sin = self._project(x, batch)
        iq = ik = iw = None
        if self.indexer is not None:
            iq, ik, iw = self.indexer.project(x, c_q, cos_sin)
        if pages is not None and batch.write_rows is not None:
            batch.cache.write_mla_rows(self.layer, batch.write_rows, latent_rows, ik)
        elif batch.cache is not None:
            for i in range(batch.num_seqs):
                rows = batch.rows(i)
                batch.cache.write_mla(self.layer, batch.handle(i), batch.context_lens[i], latent_rows[rows],
                                      None if ik is None else ik[rows])
        if self.indexer is not None and batch.index_meta is not None and pages is not None:
            out = self._sparse_paged(self._absorb(q_nope), q_pe, iq, iw, pages, batch)
        elif self.indexer is None and pages is not None and batch.ops.name != "reference":
            out = self._dense_paged(q_nope, q_pe, latent_rows, pages[0], batch)
        else:
            out = self._per_sequence(q_nope, q_pe, latent_rows, iq, ik, iw, batch)
        return self._output(out, self.g_proj(x) if self.config.mla_use_output_gate else None)

    def _project(self, x: torch.Tensor, batch: StepBatch):
        """The module chain (docs/model.md §9.1): q_nope [N, H, n], q_pe [N, H, rho] (rotated for RoPE models), the
        cache rows [c | k_pe] [N, r + rho], c_q (for the indexer) and the rotary cos/sin (or None)."""
        N = x.shape[0]
        if self.config.q_lora_rank is None:
            c_q, q = None, self.q_proj(x)
        else:
            c_q = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(c_q)
        q = q.view(N, self.H, self.n + self.rho)
        q_nope, q_pe = q[..., :self.n], q[..., self.n:]
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_pe = self.kv_a_layernorm(ckv[:, :self.r]), ckv[:, self.r:]
        cos_sin = self.rotary.cos_sin(batch.positions) if self.rotary is not None else None
        if self.config.uses_rope:
            cos, sin = cos_sin
            q_pe = rotate_interleaved(q_pe, cos.unsqueeze(1), sin.unsqueeze(1)).to(q.dtype)
            k_pe = rotate_interleaved(k_pe, cos, sin).to(q.dtype)
        return q_nope, q_pe, torch.cat([c, k_pe], dim=-1), c_q, cos_sin

    def _dense_paged(self, q_nope, q_pe, latent_rows, latent_pages, batch: StepBatch) -> torch.Tensor:
        """Fast dense MLA over paged latents: on a decode or verify step every row at once over its own context
        (`StepBatch.context_rows`, the form a decode step takes, so a verify step's rows are its rows decoded one by
        one); otherwise every single-token sequence at once (`_dense_decode`) and chunks per sequence."""
        if batch.context_rows is not None:
            out_lat, _ = batch.ops.qsfa(self._absorb(q_nope), q_pe, latent_pages, batch.context_rows, self.scale)
            return self._unabsorb(out_lat.to(q_pe.dtype))
        single = [batch.rows(i).stop - batch.rows(i).start == 1 for i in range(batch.num_seqs)]
        decode = [i for i, one in enumerate(single) if one]
        out = self._per_sequence(q_nope, q_pe, latent_rows, None, None, None, batch,
                                 [i for i, one in enumerate(single) if not one])
        if decode:
            rows = torch.tensor([batch.query_start[i] for i in decode], device=q_nope.device)
            out[rows] = self._dense_decode(self._absorb(q_nope[rows]), q_pe[rows], latent_pages, decode, batch)
        return out

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o_proj of the heads' outputs [N, H, v], gated by sigmoid(gate) (K3)."""
        o = out.reshape(out.shape[0], self.H * self.v)
        if gate is not None:
            o = (o.float() * torch.sigmoid(gate.float())).to(o.dtype)
        return self.o_proj(o)

    # ---- fast DSA path: MLAPO + QLI + QSFA ----
    def _fusable(self) -> bool:
        """MLAPO needs plain weight matrices (a quantized projection runs through its own module instead), the
        layer's RoPE use (none for Kimi; both MLA and indexer parts for DeepSeek-V3.2) and all the indexer's heads
        (its scores are not summed over ranks)."""
        if self.shard.size > 1:
            return False
        ix = self.indexer
        linears = [self.kv_a_proj_with_mqa, self.kv_b_proj, *([] if ix is None else [ix.wq_b, ix.wk, ix.weights_proj]),
                   *([self.g_proj] if self.config.mla_use_output_gate else []),
                   *([self.q_proj] if self.config.q_lora_rank is None else [self.q_a_proj, self.q_b_proj])]
        return all(isinstance(m, Linear) for m in linears) and (self.rotary is None or self.config.uses_rope)

    def _fused_weights(self) -> MLAWeights:
        """The concatenated MLAPO weights, built once and rebuilt only when a source weight was replaced or
        changed in place (its storage or version counter moved), so they never go stale. The parameter list is
        gathered at the first call (walking the submodules every step is a visible cost at decode): the
        layer's structure is fixed at load."""
        if self._mlapo_sources is None:
            self._mlapo_sources = list(self.parameters(recurse=True))
        return self._mlapo.get(self._mlapo_sources, lambda: MLAWeights.from_layer(self).fuse())

    def _fused_sparse(self, x: torch.Tensor, pages, batch: StepBatch) -> torch.Tensor:
        """One MLAPO call (projections, norms, absorption, indexer q/k/w, page writes at the step's rows), then
        QLI top-k and QSFA over only the selected rows."""
        latent_pages, key_pages, key_scales = pages
        pre = batch.ops.mla_preprocess(x, self._fused_weights(), batch.positions, self.rotary,
                                       self.config.mla_norm_eps, self.config.mla_norm_eps, self.config.index_norm_eps,
                                       batch.write_rows, latent_pages, key_pages, key_scales)
        out = self._sparse_paged(pre.q_lat, pre.q_pe, pre.index_q, pre.index_w, pages, batch)
        return self._output(out, pre.gate)

    def _per_sequence(self, q_nope, q_pe, latent_rows, iq, ik, iw, batch: StepBatch,
                      seqs: list[int] | None = None) -> torch.Tensor:
        """Reference path: per sequence (all, or `seqs`), read its latents (and indexer keys), select with the dense
        indexer scores, attend (expanded form for chunks, the op set's decode form for single tokens)."""
        out = q_nope.new_empty(q_nope.shape[0], self.H, self.v)
        for i in range(batch.num_seqs) if seqs is None else seqs:
            rows, ctx = batch.rows(i), batch.context_lens[i]
            n_q = rows.stop - rows.start
            if batch.cache is not None:
                latent, keys = batch.cache.read_mla(self.layer, batch.handle(i), ctx + n_q)
            else:
                latent, keys = latent_rows[rows], None if ik is None else ik[rows]
            S = latent.shape[0]
            pos = batch.positions[rows]
            allowed = torch.arange(S, device=q_nope.device).unsqueeze(0) <= pos.unsqueeze(1)
            if self.indexer is not None and S > self.config.index_topk:
                scores = self.indexer.shard.all_reduce(indexer_scores_ref(iq[rows], keys, iw[rows]))
                allowed = selection_mask(select_topk(scores, pos, self.config.index_topk), S)
            attend = batch.ops.mla_decode if (batch.cache is not None and n_q == 1) else batch.ops.mla_prefill
            out[rows] = attend(q_nope[rows], q_pe[rows], latent[:, :self.r], latent[:, self.r:],
                               self.kv_b_proj.weight, self.v, self.scale, allowed)
        return out

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous W_UK [H, n, r] and W_UV^T [H, r, v] split from kv_b_proj, kept until its weight changes (so
        each absorbed product reads one contiguous matrix per head instead of copying a strided view)."""
        def split():
            w = self._kv_b_heads()
            return w[:, :self.n].contiguous(), w[:, self.n:].transpose(1, 2).contiguous()
        return self._kv_b_split.get([self.kv_b_proj.weight], split)

    def _kv_b_heads(self) -> torch.Tensor:
        """kv_b_proj's weight per head: [H, n + v, r]."""
        return self.kv_b_proj.weight.detach().view(self.H, self.n + self.v, self.r)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_lat [T, H, r] = per head q_nope W_UK, one batched product over the heads."""
        return torch.bmm(q_nope.transpose(0, 1), self._split_kv_b()[0]).transpose(0, 1)

    def _unabsorb(self, out_lat: torch.Tensor) -> torch.Tensor:
        """Heads' values [T, H, v] = per head out_lat W_UV^T (as `_absorb`)."""
        return torch.bmm(out_lat.transpose(0, 1), self._split_kv_b()[1]).transpose(0, 1)

    def _dense_decode(self, q_lat, q_pe, latent_pages, seqs: list[int], batch: StepBatch) -> torch.Tensor:
        """Single-token queries of many sequences at once over their whole context (docs/ops.md §4.5 in the absorbed
        form): each sequence's page rows up to its position are the selected set of QSFA, so the absorption and the
        W_UV map run once for all of them instead of once per sequence."""
        lengths = [batch.context_lens[i] + 1 for i in seqs]
        selected = torch.full((len(seqs), max(lengths)), -1, dtype=torch.long, device=q_lat.device)
        for j, (i, n) in enumerate(zip(seqs, lengths)):
            selected[j, :n] = batch.handle(i).rows[:n]
        out_lat, _ = batch.ops.qsfa(q_lat, q_pe, latent_pages, selected, self.scale)
        return self._unabsorb(out_lat.to(q_pe.dtype))

    def _sparse_paged(self, q_lat, q_pe, iq, iw, pages, batch: StepBatch) -> torch.Tensor:
        """Fast DSA attention over the whole step, from the absorbed queries q_lat [N, H, r]: QLI picks each query's
        top-k page rows (causal bound inside the op, metadata shared by all DSA layers), QSFA attends over only
        those rows; W_UV maps the latent outputs to the heads' values."""
        latent_pages, key_pages, key_scales = pages
        eight = key_scales is not None  # 8-bit keys were rotated and quantised when written; queries follow suit
        selected = qli_topk(iq, iw, key_pages, key_scales, batch.index_meta, quantized=eight, rotate=eight,
                            reduce_scores=self.indexer.shard.all_reduce)
        out_lat, _ = batch.ops.qsfa(q_lat, q_pe, latent_pages, selected, self.scale)
        return self._unabsorb(out_lat.to(q_pe.dtype))

