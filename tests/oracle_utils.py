"""Helpers for the pip-oracle tests (spec docs/oracles.md §2–§4).

* `randomize_` — the weight randomisation of docs/oracles.md §3.1 (default HF init hides bugs).
* Tiny configs of docs/oracles.md §3.2/§3.3 (`kimi_linear_config`, `deepseek_v3_config`, `deepseek_v32_config`) and
  `build_hf` to instantiate one in fp32 / eager / eval.
* `capture_indexer_scores` / `dsa_tie_rows` / `find_tie_free_seed` — the DSA tie detector of docs/oracles.md §4: the HF
  indexer's top-k input rows are captured by wrapping `torch.Tensor.topk` while (and only while) a
  `DeepseekV32Indexer.forward` runs; seeds whose rows have `|s_(k) − s_(k+1)| < 1e-4 · row scale` among causally
  valid keys are rejected.
* `load_fla_naive` — FLA's naive KDA loaded by file path (the `fla` package `__init__` needs triton).

Nothing here imports deltaserve: this module is oracle-side only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from types import ModuleType
from typing import Callable, Iterator

import torch

TIE_REL_GAP = 1e-4  # docs/oracles.md §4 rule 2


# ---------------------------------------------------------------------------------------------------------------
# weight randomisation (docs/oracles.md §3.1)

@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """In place: parameters with ndim ≥ 2 ← N(0,1)·fan_in^-1/2 (fan_in = last dim); other parameters whose name
    contains "norm" ← 1 + 0.1·N; every other 1-D parameter ← 0.3·N; buffers named e_score_correction_bias ←
    0.05·N. Deterministic for a given seed (tensors are visited in `named_parameters`/`named_buffers` order)."""
    g = torch.Generator().manual_seed(seed)

    def randn(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)

    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.copy_(randn(p) * p.shape[-1] ** -0.5)
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * randn(p))
        else:
            p.copy_(0.3 * randn(p))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * randn(b))
    return model


# ---------------------------------------------------------------------------------------------------------------
# tiny configs (docs/oracles.md §3.2, §3.3)

def kimi_linear_config(q_lora_rank: int | None = None, **overrides):
    """docs/oracles.md §3.2: 4 layers, KDA at 1-based 1–3, NoPE MLA at 4, dense layer 0, MoE 8×top-2 + 1 shared."""
    from transformers import KimiLinearConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=q_lora_rank,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, routed_scaling_factor=2.446, n_group=1, topk_group=1, first_k_dense_replace=1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                  "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    kw.update(overrides)
    return KimiLinearConfig(**kw)


_DEEPSEEK = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# factor × original length = the config's default max_position_embeddings (163840); with 4 rotary pairs the ramp is
# fractional (pairs 0–1 interpolated, pair 2 half, pair 3 kept); mscale ≠ mscale_all_dim makes the cos/sin
# attention factor ≠ 1 on top of the mscale_all_dim² softmax-scale factor.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def deepseek_v3_config(yarn: bool = False, **overrides):
    """docs/oracles.md §3.3: 3 layers, MLA q_lora 48, pair-interleaved RoPE (optionally YaRN), 4 groups / top-2
    groups."""
    from transformers import DeepseekV3Config

    kw = dict(_DEEPSEEK, rope_interleave=True)
    if yarn:
        kw["rope_parameters"] = dict(YARN)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def deepseek_v32_config(index_topk: int = 6, index_n_heads: int = 8, **overrides):
    """docs/oracles.md §3.3 V3.2: adds the lightning indexer (8 index heads × 16, top-k 6 < T)."""
    from transformers import DeepseekV32Config

    kw = dict(_DEEPSEEK, index_topk=index_topk, index_head_dim=16, index_n_heads=index_n_heads)
    kw.update(overrides)
    return DeepseekV32Config(**kw)


def build_hf(config, seed: int) -> torch.nn.Module:
    """The `*ForCausalLM` of `config`, fp32, eager attention, eval mode, weights randomised with `seed`."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return randomize_(model.float().eval(), seed)


def random_ids(vocab: int, T: int, seed: int) -> torch.Tensor:
    """Token ids [T] in 3..vocab-1 (clear of pad/bos/eos), from a dedicated generator."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(3, vocab, (T,), generator=g)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
    """Full-sequence fp32 logits [T, vocab] of one sequence (no cache)."""
    pos = torch.arange(ids.shape[0]).unsqueeze(0) + position_offset
    return model(ids.unsqueeze(0), position_ids=pos, use_cache=False).logits[0].float()


# ---------------------------------------------------------------------------------------------------------------
# DSA tie detector (docs/oracles.md §4)

@contextlib.contextmanager
def capture_indexer_scores(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the score tensor every HF `DeepseekV32Indexer` passes to `topk` ([B, S, T], causally masked by HF)
    while the context is open; one entry per indexer call, in call order."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    rows: list[torch.Tensor] = []
    depth = [0]
    original = torch.Tensor.topk

    def topk(self, *args, **kwargs):
        if depth[0]:
            rows.append(self.detach().clone())
        return original(self, *args, **kwargs)

    def enter(module, args, kwargs=None):
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1

    handles = []
    for m in model.modules():
        if isinstance(m, DeepseekV32Indexer):
            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave))
    if not handles:
        raise ValueError("model has no DeepseekV32Indexer")
    torch.Tensor.topk = topk
    try:
        yield rows
    finally:
        torch.Tensor.topk = original
        for h in handles:
            h.remove()


def dsa_tie_rows(scores: torch.Tensor, topk: int, positions: torch.Tensor | None = None,
                 rel_gap: float = TIE_REL_GAP) -> list[tuple[int, float]]:
    """Rows of `scores` [S, T] (query t at absolute position positions[t], default t) whose causally valid keys
    (0..pos) number more than `topk` and whose k-th and (k+1)-th largest valid scores differ by less than
    rel_gap · row scale (row scale = max |valid score|, at least tiny). Returns [(row, gap / scale)]."""
    S, T = scores.shape
    if positions is None:
        positions = torch.arange(S)
    bad = []
    for t in range(S):
        n = int(positions[t]) + 1
        if n <= topk:
            continue  # the whole causal range is selected: no ranking, no tie
        valid = scores[t, :n].double()
        top = torch.sort(valid, descending=True).values
        scale = max(float(valid.abs().max()), 1e-30)
        gap = float(top[topk - 1] - top[topk])
        if not torch.isfinite(top[: topk + 1]).all() or gap < rel_gap * scale:
            bad.append((t, gap / scale))
    return bad


def model_has_dsa_tie(model: torch.nn.Module, ids: torch.Tensor, topk: int, position_offset: int = 0) -> bool:
    """Run the HF model once and report whether any indexer row has a tie at the top-k cut."""
    with capture_indexer_scores(model) as rows:
        hf_logits(model, ids, position_offset)
    if not rows:
        raise AssertionError("the tie detector captured no indexer scores")
    return any(dsa_tie_rows(r[b], topk) for r in rows for b in range(r.shape[0]))


def find_tie_free_seed(build: Callable[[int], torch.nn.Module], ids_for: Callable[[int], torch.Tensor], topk: int,
                       first_seed: int = 0, max_tries: int = 50) -> tuple[int, torch.nn.Module]:
    """The first seed ≥ first_seed (deterministic iteration) whose model/ids have no DSA tie at the cut."""
    for seed in range(first_seed, first_seed + max_tries):
        model = build(seed)
        if not model_has_dsa_tie(model, ids_for(seed), topk):
            return seed, model
    raise AssertionError(f"no tie-free seed in {first_seed}..{first_seed + max_tries - 1}")


# ---------------------------------------------------------------------------------------------------------------
# FLA naive KDA (docs/oracles.md §2)

def load_fla_naive() -> ModuleType:
    """`fla/ops/kda/naive.py` executed on its own (importing the `fla` package needs triton). Provides
    `naive_recurrent_kda` and `naive_chunk_kda`."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flash-linear-attention is not installed (test extra)")
    path = os.path.join(spec.submodule_search_locations[0], "ops", "kda", "naive.py")
    file_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module
