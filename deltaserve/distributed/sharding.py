"""How a model's weights split over tensor- and expert-parallel ranks (docs/parallel.md §2): one rule per
parameter, by name. The accounting (`make-model --meta` with parallel sizes) and the loader read the same rules, so
what is printed per rank is what a rank holds.

A rule names the dimension a tensor is cut along into `tensor_parallel_size` equal contiguous parts, rank r holding
part r, or None for a tensor every rank holds whole. Cuts fall on whole heads (attention projections are stored
head-major), whole experts (expert parallel) or whole MX blocks (a packed or scale tensor is cut where its weight
is); `ParallelConfig.check` refuses a layout where one would not.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ConfigError

# The output rows (dim 0) of these are split: one slice of heads, of an MLP's width, or of the vocabulary per rank.
_SPLIT_OUT = re.compile(
    r"(self_attn\.(q_proj|k_proj|v_proj|g_proj|b_proj|f_b_proj|g_b_proj|q_b_proj|kv_b_proj)\.weight"
    r"|self_attn\.[qkv]_conv1d\.weight|self_attn\.(A_log|dt_bias)"
    r"|indexer\.(wq_b|weights_proj)\.weight"
    r"|ffn\.(gate_proj|up_proj)\.weight|shared_experts\.(gate_proj|up_proj)\.weight"
    r"|^embed_tokens\.weight|^lm_head\.weight|shared_head\.head\.weight)$")
# The input columns (dim 1) of these are split: the row-parallel products whose partial sums are all-reduced (the
# latent MoE's up projection reads its rank's slice of the normed latent and joins the shared experts' all-reduce).
_SPLIT_IN = re.compile(r"(self_attn\.o_proj\.weight|ffn\.down_proj\.weight|shared_experts\.down_proj\.weight"
                       r"|ffn\.routed_expert_up_proj\.weight)$")
# Linear weights stored MX keep the layout of their bf16 weight: `weight_packed` / `weight_scale` follow `weight`.
_MX_LEAF = re.compile(r"\.weight_(packed|scale)$")
# Stacked routed experts: w1 / w3 [E, I, in] and w2 [E, in, I] (and their MX `_packed` / `_scale` twins).
_EXPERTS = re.compile(r"\.experts\.(w[123])(_packed|_scale)?$")


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of one engine. `tensor_parallel_size` ranks each hold 1/N of every split weight (heads,
    MLP widths, the vocabulary); with `enable_expert_parallel` the routed experts are instead placed whole across
    the same ranks, a contiguous range of num_experts / N each (vLLM's flag names; the expert-parallel group is the
    tensor-parallel group: deltaserve has no attention data parallelism to make it larger)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def check(self, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
        """ConfigError naming the first count that does not divide by the world size: heads of each kind, widths,
        experts, the vocabulary, or (over `shapes`, the model's parameters) a stored dimension a rule cuts."""
        n = self.world_size
        if n == 1:
            return
        counts = {"num_attention_heads": config.num_heads, "vocab_size": config.vocab_size}
        if any(config.ffn_kind(l) != "moe" for l in range(config.num_layers)):
            counts["intermediate_size"] = config.intermediate_size
        if config.routed_expert_hidden_size:
            counts["routed_expert_hidden_size"] = config.routed_expert_hidden_size
        if config.kda_layers:
            counts["kda num_heads"] = config.kda_num_heads
        if config.dsa_layers and config.index_n_heads:
            counts["index_n_heads"] = config.index_n_heads
        if config.num_experts:
            counts["n_routed_experts" if self.enable_expert_parallel else "moe_intermediate_size"] = (
                config.num_experts if self.enable_expert_parallel else config.moe_intermediate_size)
        for what, count in counts.items():
            if count % n:
                raise ConfigError(f"{what} = {count} does not divide by tensor_parallel_size = {n}")
        for name, shape in shapes.items():
            dim = split_dim(name, self)
            if dim is not None and shape[dim] % n:
                raise ConfigError(f"{name} {list(shape)}: dimension {dim} ({shape[dim]}) does not divide by "
                                  f"tensor_parallel_size = {n} (an MX tensor's blocks would be cut)")


def split_dim(name: str, parallel: ParallelConfig) -> int | None:
    """The dimension parameter `name` (the model's internal name) is cut along over the ranks, or None when every
    rank holds it whole: norms, the routers, the low-rank down projections (q_a, kv_a, f_a, g_a), the indexer's
    key projection, the latent MoE's down projection (every rank's experts read all of the latent), AttnRes and the
    MTP layer's input projection."""
    if parallel.world_size == 1:
        return None
    e = _EXPERTS.search(name)
    if e:
        if parallel.enable_expert_parallel:
            return 0
        return 2 if e.group(1) == "w2" else 1  # each expert's width I
    base = _MX_LEAF.sub(".weight", name)
    if _SPLIT_OUT.search(base):
        return 0
    if _SPLIT_IN.search(base):
        return 1
    return None


def shard(tensor: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole tensor under a rule (`split_dim`): the tensor itself when replicated."""
    if dim is None:
        return tensor
    size = tensor.shape[dim] // world
    return tensor.narrow(dim, rank * size, size)


def local_shape(shape: tuple[int, ...], dim: int | None, world: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(shape)
    return tuple(s // world if i == dim else s for i, s in enumerate(shape))


def component(name: str, config: ModelConfig) -> str:
    """The part of the model a parameter belongs to, for per-rank accounting."""
    if name.startswith("mtp."):
        return "MTP layers"
    if name.startswith("embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "LM head"
    if ".experts." in name:
        return "routed experts"
    if ".shared_experts." in name:
        return "shared experts"
    if ".ffn.gate." in name:
        return "routers"
    if ".ffn.routed_expert_" in name:
        return "latent MoE projections"
    if ".ffn." in name:
        return "dense MLPs"
    if ".indexer." in name:
        return "DSA indexers"
    m = re.match(r"layers\.(\d+)\.self_attn\.", name)
    if m:
        return "KDA attention" if int(m.group(1)) in config.kda_layers else "MLA/DSA attention"
    return "norms and AttnRes"
