"""MLAPO: fused MLA preprocess + latent / indexer-key cache write (docs/ops.md §2; docs/model.md §9.1, §9.3, §9.4).

One call per MLA/DSA layer per step replaces the chain

    q_a_proj → q_a_layernorm → q_b_proj   (or q_proj when q_lora_rank is None)
    kv_a_proj_with_mqa → kv_a_layernorm(first r dims) | k_pe (the remaining ρ dims)
    W_UK absorption of q_nope (q_lat = q_nopeᵀ W_UK per head)
    indexer: wq_b(c_q), k_norm(wk x), weights_proj(x) · H_I^-1/2            (DSA layers only)
    (K3) MLA output-gate logits g_proj(x)                                    (optional)
    scatter of [c | k_pe] and the indexer key into paged caches at flat rows

The fast path :func:`mla_preprocess` runs every projection that reads ``x`` (q_a_proj or q_proj,
kv_a_proj_with_mqa, g_proj, indexer wk and weights_proj) as **one** GEMM on a weight concatenated once by
:meth:`MLAWeights.fuse`, absorbs W_UK with one batched GEMM over heads and writes the cache rows directly; the
per-head expanded keys/values (kv_b_proj on the latent) are never formed; it is plain torch and never calls the
native library. :func:`mla_preprocess_native` is the same computation with the products of a few bf16 rows on the
native kernels, over packed copies of the fused weights (:meth:`MLAWeights.pack_native`, built on its first call), and
the RMSNorms of bf16 rows on the native norm; any other input runs :func:`mla_preprocess`.
:func:`mla_preprocess_ref` is the plain chain with one linear per weight, in the rounding order of
:mod:`deltaserve.layers.mla` / ``layers.norm``.

RoPE: Kimi models (K3, K3.1, Kimi-Linear) are NoPE and pass ``rotary=None``. With a ``rotary``
(:class:`deltaserve.layers.rope.RotaryEmbedding`, DeepSeek V3/V3.2) q_pe and k_pe are rotated in the layer's
interleaved form, and the indexer's first ``MLAWeights.index_rope_dim`` dims in the half-split form, both at
``positions``; this mirrors the layer but is only lightly tested.

Cache write at ``out_rows [N]`` int64 flat rows ``block · B + offset``; rows < 0 are skipped (docs/ops.md §0). Every
PagePool format: ``latent_cache`` is a float tensor ``[num_blocks, B, r+ρ]`` (or flat rows) or a ``C8Latent``
(quantised per 128-value tile on write); ``index_cache [num_blocks, B, D_I]`` holds float keys, or 8-bit keys
(Hadamard-rotated and quantised per token) when ``index_scales`` is given. The writers are the shared cache-format
writers of :mod:`.qsfa` and :mod:`.qli`.

The engine runs the op set's ``mla_preprocess`` in DSA layers (``layers/mla.py``), with the fused weights built
once per layer and rebuilt only when a source weight changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native
from .native_contract import LINEAR_MAX_ROWS
from .qli import write_index_keys
from .qsfa import write_latent
from .rope import rotate_half_split, rotate_interleaved

__all__ = ["MLAWeights", "MLAPreOut", "mla_preprocess_ref", "mla_preprocess", "mla_preprocess_native"]


@dataclass
class MLAWeights:
    """Weights of one MLA/DSA layer in checkpoint layout ([out, in]); ``fuse()`` adds the concatenated forms,
    ``pack_native()`` the native kernels' packed copies of them."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    kv_lora_rank: int
    v_head_dim: int
    kv_a_proj: Tensor                   # [r + ρ, d]
    kv_a_norm: Tensor                   # [r]
    kv_b_proj: Tensor                   # [H (n + v), r]
    q_a_proj: Tensor | None = None      # [r_q, d]      (q_lora_rank set)
    q_a_norm: Tensor | None = None      # [r_q]
    q_b_proj: Tensor | None = None      # [H (n + ρ), r_q]
    q_proj: Tensor | None = None        # [H (n + ρ), d] (q_lora_rank None)
    g_proj: Tensor | None = None        # [H v, d]      (K3 MLA output gate)
    index_wq_b: Tensor | None = None    # [H_I D_I, r_q]
    index_wk: Tensor | None = None      # [D_I, d]
    index_k_norm_weight: Tensor | None = None   # [D_I]
    index_k_norm_bias: Tensor | None = None     # [D_I]
    index_weights_proj: Tensor | None = None    # [H_I, d]
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_dim: int = 0             # DeepSeek-V3.2 only; 0 for K3.1
    # built by fuse()
    w_a: Tensor | None = field(default=None, repr=False)      # [r_q | H(n+ρ), r+ρ, (H v), (D_I), (H_I)] × d
    w_uk: Tensor | None = field(default=None, repr=False)     # [H, n, r]
    split_a: tuple[int, ...] = field(default=(), repr=False)  # output widths of w_a's blocks
    # built by pack_native(), bf16 on the CPU: w_a, q_b_proj, index_wq_b and W_UK^T [H, r, n] packed for the
    # native kernels, which take the products of a few rows (oneDNN re-lays an unpacked weight out on every call:
    # most of a decode step's MLAPO time)
    packed: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def has_indexer(self) -> bool:
        return self.index_wk is not None

    @property
    def q_lora(self) -> bool:
        return self.q_a_proj is not None

    def fuse(self) -> "MLAWeights":
        """Concatenate every weight that reads x into ``w_a`` and split ``W_UK`` out of ``kv_b_proj`` (once, at
        load time), in plain torch. Drops any native packs (they were copies of the previous forms). Returns self."""
        first = self.q_a_proj if self.q_lora else self.q_proj
        if first is None:
            raise ValueError("MLAWeights needs q_a_proj (+ q_a_norm, q_b_proj) or q_proj")
        blocks = [first, self.kv_a_proj]
        if self.g_proj is not None:
            blocks.append(self.g_proj)
        if self.has_indexer:
            blocks += [self.index_wk, self.index_weights_proj]
        self.w_a = torch.cat([b.detach() for b in blocks], dim=0).contiguous()
        self.split_a = tuple(b.shape[0] for b in blocks)
        H, n, v = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        self.w_uk = self.kv_b_proj.detach().view(H, n + v, -1)[:, :n].contiguous()
        self.packed = {}
        return self

    def pack_native(self) -> "MLAWeights":
        """Build ``packed`` (fusing first if needed) when the native kernels take these weights (bf16 on the CPU,
        library built); kept until the next ``fuse()``. Returns self."""
        if self.w_a is None:
            self.fuse()
        if not self.packed and native.native_usable(self.w_a.dtype, self.w_a.device):
            named = {"w_a": self.w_a, "q_b_proj": self.q_b_proj, "index_wq_b": self.index_wq_b,
                     "w_uk_t": self.w_uk.transpose(1, 2)}
            self.packed = {name: native.pack_rows(w) for name, w in named.items() if w is not None}
        return self

    @classmethod
    def from_layer(cls, layer) -> "MLAWeights":
        """Copy (reference, no clone) the weights of a :class:`deltaserve.layers.mla.MLAttention`."""
        c = layer.config
        lora = c.q_lora_rank is not None
        ix = layer.indexer
        return cls(
            num_heads=layer.H, qk_nope_head_dim=layer.n, qk_rope_head_dim=layer.rho, kv_lora_rank=layer.r,
            v_head_dim=layer.v,
            kv_a_proj=layer.kv_a_proj_with_mqa.weight.detach(), kv_a_norm=layer.kv_a_layernorm.weight.detach(),
            kv_b_proj=layer.kv_b_proj.weight.detach(),
            q_a_proj=layer.q_a_proj.weight.detach() if lora else None,
            q_a_norm=layer.q_a_layernorm.weight.detach() if lora else None,
            q_b_proj=layer.q_b_proj.weight.detach() if lora else None,
            q_proj=None if lora else layer.q_proj.weight.detach(),
            g_proj=layer.g_proj.weight.detach() if c.mla_use_output_gate else None,
            index_wq_b=None if ix is None else ix.wq_b.weight.detach(),
            index_wk=None if ix is None else ix.wk.weight.detach(),
            index_k_norm_weight=None if ix is None else ix.k_norm.weight.detach(),
            index_k_norm_bias=None if ix is None else ix.k_norm.bias.detach(),
            index_weights_proj=None if ix is None else ix.weights_proj.weight.detach(),
            index_n_heads=0 if ix is None else ix.heads, index_head_dim=0 if ix is None else ix.head_dim,
            index_rope_dim=0 if ix is None else ix.rope_dim,
        )


class MLAPreOut(NamedTuple):
    q_lat: Tensor                  # [N, H, r]   W_UK-absorbed q_nope
    q_pe: Tensor                   # [N, H, ρ]   (rotated when rotary is given)
    latent: Tensor                 # [N, r + ρ]  [RMSNorm(c) | k_pe]
    c_q: Tensor | None             # [N, r_q]    post-norm (None without q_lora)
    index_q: Tensor | None         # [N, H_I, D_I]
    index_k: Tensor | None         # [N, D_I]    post-LayerNorm
    index_w: Tensor | None         # [N, H_I]    fp32, scaled by H_I^-1/2
    gate: Tensor | None = None     # [N, H v]    pre-sigmoid MLA output gate (K3)


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """layers.norm.RMSNorm order: w * round(x_f32 * rsqrt(mean x² + eps))."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm_native(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """`_rms_norm` through the native kernel for bf16 rows and weight (one call where the torch form is five
    ops, whose fixed cost per op outweighs the arithmetic at decode sizes), else `_rms_norm`."""
    if (x.dtype == w.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and w.is_contiguous()
            and native.native_library() is not None):
        return native.rmsnorm_bf16(x, w, eps)
    return _rms_norm(x, w, eps)


def _layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), eps).to(x.dtype)


def _rope(q_pe: Tensor, k_pe: Tensor, iq: Tensor | None, ik: Tensor | None, weights: MLAWeights,
          positions: Tensor | None, rotary) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    if rotary is None:
        return q_pe, k_pe, iq, ik
    if positions is None:
        raise ValueError("rotary needs positions")
    cos, sin = rotary.cos_sin(positions)
    q_pe2 = rotate_interleaved(q_pe, cos.unsqueeze(1), sin.unsqueeze(1)).to(q_pe.dtype)
    k_pe2 = rotate_interleaved(k_pe, cos, sin).to(q_pe.dtype)
    r = weights.index_rope_dim
    if iq is not None and r:
        iq = torch.cat([rotate_half_split(iq[..., :r], cos.unsqueeze(1), sin.unsqueeze(1)).to(iq.dtype),
                        iq[..., r:]], dim=-1)
        ik = torch.cat([rotate_half_split(ik[..., :r], cos, sin).to(ik.dtype), ik[..., r:]], dim=-1)
    return q_pe2, k_pe2, iq, ik


def mla_preprocess_ref(x: Tensor, weights: MLAWeights, positions: Tensor | None = None, rotary=None,
                       eps_q: float = 1e-6, eps_kv: float = 1e-6, eps_index: float = 1e-5,
                       out_rows: Tensor | None = None, latent_cache=None, index_cache: Tensor | None = None,
                       index_scales: Tensor | None = None) -> MLAPreOut:
    """Plain chain (one linear per weight) for ``x [N, d]``; see the module docstring for the outputs.

    When ``out_rows`` is given, ``latent`` rows go to ``latent_cache`` and ``index_k`` rows to ``index_cache``
    (if both exist), skipping rows < 0.
    """
    W = weights
    N = x.shape[0]
    H, n, rho, r = W.num_heads, W.qk_nope_head_dim, W.qk_rope_head_dim, W.kv_lora_rank
    if W.q_lora:
        c_q = _rms_norm(F.linear(x, W.q_a_proj), W.q_a_norm, eps_q)
        q = F.linear(c_q, W.q_b_proj)
    else:
        c_q, q = None, F.linear(x, W.q_proj)
    q = q.view(N, H, n + rho)
    q_nope, q_pe = q[..., :n], q[..., n:]
    ckv = F.linear(x, W.kv_a_proj)
    c, k_pe = _rms_norm(ckv[:, :r], W.kv_a_norm, eps_kv), ckv[:, r:]
    iq = ik = iw = None
    if W.has_indexer:
        iq = F.linear(c_q, W.index_wq_b).view(N, W.index_n_heads, W.index_head_dim)
        ik = _layer_norm(F.linear(x, W.index_wk), W.index_k_norm_weight, W.index_k_norm_bias, eps_index)
        iw = F.linear(x, W.index_weights_proj).float() * W.index_n_heads ** -0.5
    q_pe, k_pe, iq, ik = _rope(q_pe, k_pe, iq, ik, W, positions, rotary)
    w_uk = W.kv_b_proj.view(H, n + W.v_head_dim, r)[:, :n]
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    latent = torch.cat([c, k_pe], dim=-1)
    gate = F.linear(x, W.g_proj) if W.g_proj is not None else None
    if out_rows is not None:
        _write_caches(latent, ik, out_rows, latent_cache, index_cache, index_scales)
    return MLAPreOut(q_lat, q_pe.contiguous(), latent, c_q, iq, ik, iw, gate)


def mla_preprocess(x: Tensor, weights: MLAWeights, positions: Tensor | None = None, rotary=None,
                   eps_q: float = 1e-6, eps_kv: float = 1e-6, eps_index: float = 1e-5,
                   out_rows: Tensor | None = None, latent_cache=None, index_cache: Tensor | None = None,
                   index_scales: Tensor | None = None) -> MLAPreOut:
    """Fast twin of :func:`mla_preprocess_ref` (same contract), plain torch: one input GEMM on ``weights.w_a``
    (built by :meth:`MLAWeights.fuse`, called lazily on first use), batched W_UK absorption, one vectorised scatter
    per cache."""
    if weights.w_a is None:
        weights.fuse()
    return _preprocess(x, weights, positions, rotary, eps_q, eps_kv, eps_index, out_rows, latent_cache, index_cache,
                       index_scales, on_native=False)


def mla_preprocess_native(x: Tensor, weights: MLAWeights, positions: Tensor | None = None, rotary=None,
                          eps_q: float = 1e-6, eps_kv: float = 1e-6, eps_index: float = 1e-5,
                          out_rows: Tensor | None = None, latent_cache=None, index_cache: Tensor | None = None,
                          index_scales: Tensor | None = None) -> MLAPreOut:
    """:func:`mla_preprocess` with the products of up to ``LINEAR_MAX_ROWS`` bf16 rows on the native kernels over
    ``weights.packed`` (built by :meth:`MLAWeights.pack_native` on first use; above that many rows, F.linear as the
    torch form) and the RMSNorms of bf16 rows on the native norm. Weights the kernels do not take (not bf16, not on
    the CPU, no library) get no packs, and every product runs as in the torch form."""
    if weights.w_a is None or not weights.packed:
        weights.pack_native()
    return _preprocess(x, weights, positions, rotary, eps_q, eps_kv, eps_index, out_rows, latent_cache, index_cache,
                       index_scales, on_native=True)


def _preprocess(x: Tensor, W: MLAWeights, positions: Tensor | None, rotary, eps_q: float, eps_kv: float,
                eps_index: float, out_rows: Tensor | None, latent_cache, index_cache: Tensor | None,
                index_scales: Tensor | None, on_native: bool) -> MLAPreOut:
    """The body of both forms on fused weights; `on_native` False never touches the native library."""
    rms_norm = _rms_norm_native if on_native else _rms_norm
    N = x.shape[0]
    H, n, rho, r = W.num_heads, W.qk_nope_head_dim, W.qk_rope_head_dim, W.kv_lora_rank
    # column blocks of the fused output are strided views; elementwise kernels on strided views run several
    # times slower on CPU than one copy of the (small) activation, so make each block contiguous
    parts = [p.contiguous() for p in torch.split(_product(x, W, "w_a", on_native), W.split_a, dim=-1)]
    first, ckv = parts[0], parts[1]
    rest = parts[2:]
    gate = rest.pop(0) if W.g_proj is not None else None
    if W.q_lora:
        c_q = rms_norm(first, W.q_a_norm, eps_q)
        q = _product(c_q, W, "q_b_proj", on_native)
    else:
        c_q, q = None, first
    q = q.view(N, H, n + rho)
    q_nope, q_pe = q[..., :n], q[..., n:]
    c, k_pe = rms_norm(ckv[:, :r], W.kv_a_norm, eps_kv), ckv[:, r:]
    iq = ik = iw = None
    if W.has_indexer:
        k_raw, w_raw = rest
        iq = _product(c_q, W, "index_wq_b", on_native).view(N, W.index_n_heads, W.index_head_dim)
        ik = _layer_norm(k_raw, W.index_k_norm_weight, W.index_k_norm_bias, eps_index)
        iw = w_raw.float() * W.index_n_heads ** -0.5
    q_pe, k_pe, iq, ik = _rope(q_pe, k_pe, iq, ik, W, positions, rotary)
    if on_native and _few_native_rows(q_nope, W, "w_uk_t"):  # per head q_nope W_UK, one native call over the heads
        q_lat = native.linear_heads(q_nope, W.packed["w_uk_t"], r)
    else:  # one batched GEMM over heads: [H, N, n] × [H, n, r] -> [H, N, r]
        q_lat = torch.bmm(q_nope.transpose(0, 1), W.w_uk).transpose(0, 1)
    latent = torch.cat([c, k_pe], dim=-1)
    if out_rows is not None:
        _write_caches(latent, ik, out_rows, latent_cache, index_cache, index_scales)
    return MLAPreOut(q_lat, q_pe.contiguous(), latent, c_q, iq, ik, iw, gate)


def _few_native_rows(x: Tensor, W: MLAWeights, name: str) -> bool:
    return (name in W.packed and x.dtype == torch.bfloat16 and 0 < x.shape[0] <= LINEAR_MAX_ROWS
            and x.stride(-1) == 1)


def _product(x: Tensor, W: MLAWeights, name: str, on_native: bool) -> Tensor:
    """x @ W.<name>^T: with `on_native`, the native kernel on the packed copy for a few bf16 rows; else F.linear."""
    if on_native and _few_native_rows(x, W, name) and x.dim() == 2:
        return native.linear_packed(x, W.packed[name], getattr(W, name).shape[0])
    return F.linear(x, getattr(W, name))


def _write_caches(latent: Tensor, ik: Tensor | None, out_rows: Tensor, latent_cache, index_cache: Tensor | None,
                  index_scales: Tensor | None) -> None:
    rows = torch.as_tensor(out_rows, dtype=torch.long, device=latent.device)
    if latent_cache is not None:
        write_latent(latent, rows, latent_cache)
    if index_cache is not None and ik is not None:
        eight = index_scales is not None
        write_index_keys(ik, rows, index_cache, index_scales, quantized=eight, rotate=eight)
