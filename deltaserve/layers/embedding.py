"""The token embedding, vocabulary-parallel over a tensor-parallel group (docs/parallel.md §2)."""

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import Shard


class VocabEmbedding(nn.Embedding):
    """`embed_tokens`. Over a tensor-parallel group (`shard`) each rank holds a contiguous slice of the vocabulary,
    looks up the tokens that fall in it (zero rows for the others) and the ranks' rows are summed: each token's row
    comes from exactly one rank."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard = Shard()):
        super().__init__(shard.part(vocab_size), dim)
        self.shard, self.first_token = shard, shard.span(vocab_size).start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return super().forward(ids)
        local = ids - self.first_token
        held = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(held, local, 0), self.weight).masked_fill(~held.unsqueeze(-1), 0)
        return self.shard.all_reduce(rows)
