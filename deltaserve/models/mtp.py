"""MTP (next-token prediction) layer weights (docs/model.md §13). Loaded with the model; drafting uses it later."""

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
from ..layers.batch import StepBatch
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from .decoder import DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, shard.part(config.vocab_size))


class MTPLayer(nn.Module):
    """Layer index L + j: enorm/hnorm, eh_proj over [embedding ; hidden], an ordinary-residual MLA + FFN block
    (never AttnRes) and its own norm + head."""

    def __init__(self, config: ModelConfig, layer: int, shard: Shard = Shard()):
        super().__init__()
        d = config.hidden_size
        self.layer, self.shard = layer, shard
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d)
        self.block = DecoderLayer(config, layer, attn_res=False, shard=shard)
        self.shared_head = SharedHead(config, shard)

    def forward(self, embeds: torch.Tensor, h_prev: torch.Tensor, positions: torch.Tensor,
                batch: StepBatch) -> torch.Tensor:
        """Pre-norm MTP output h_next [N, d]."""
        return self.block(self.block_input(embeds, h_prev, positions), batch)

    def block_input(self, embeds: torch.Tensor, h_prev: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """u [N, d], what the block reads: eh_proj of the normed embedding (zeroed at position 0 before its norm)
        and the normed previous state."""
        e = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h_prev)], dim=-1))

    def logits(self, h_next: torch.Tensor) -> torch.Tensor:
        return self.shard.all_gather(self.shared_head.head(self.shared_head.norm(h_next)).float(), -1)
