"""The causal LM shared by every family: embedding, the decoder stack (models/decoder.py: plain pre-norm residual or
block AttnRes), final norm, LM head and the MTP layers — docs/model.md §4, §5.3, §12."""

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import Shard
from ..layers.batch import StepBatch
from ..layers.embedding import VocabEmbedding
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from .decoder import AttnResQuery, DecoderLayer, Eager, SubBlocks, V
from .mtp import MTPLayer


class CausalLM(nn.Module):
    """Embedding, decoder stack, final norm and LM head; MTP layers are loaded beside it (`mtp`). Built for one
    rank of a tensor-parallel group (`shard`, docs/parallel.md), it holds that rank's part of every layer and its
    logits are gathered from every rank's slice of the vocabulary."""

    def __init__(self, config: ModelConfig, shard: Shard = Shard()):
        super().__init__()
        self.config, self.shard = config, shard
        d = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, d, shard)
        self.layers = nn.ModuleList(DecoderLayer(config, l, shard=shard) for l in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = Linear(d, shard.part(config.vocab_size))
        if config.attn_res_block_size is not None:
            self.output_attn_res = AttnResQuery(d, config.rms_norm_eps)
        self.mtp = nn.ModuleList(MTPLayer(config, config.num_layers + j, shard)
                                 for j in range(config.num_nextn_predict_layers))
        self.mtp_available = config.num_nextn_predict_layers > 0

    def forward(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Pre-norm final hidden state h [N, d] of the flattened tokens (what MTP and drafters consume)."""
        return self.run_layers(self.embed(input_ids, batch), Eager(batch))

    def embed(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The rows' input embeddings: each token's, but where the batch gives a row's embedding (an image's
        features on its placeholder positions)."""
        h = self.embed_tokens(input_ids)
        if batch.input_embeds is None:
            return h
        rows, values = batch.input_embeds
        return h.index_copy(0, rows, values.to(h.dtype))

    def run_layers(self, h: V, blocks: SubBlocks[V]) -> V:
        """The decoder stack over the embedded tokens: plain pre-norm residual layers, or block AttnRes with the
        output mixture."""
        if self.config.attn_res_block_size is None:
            for layer in self.layers:
                h = layer.apply(h, blocks)
            return h
        bank: list = []
        for layer in self.layers:
            h = layer.apply_attn_res(h, bank, blocks)
        return blocks.mix(self.output_attn_res, bank + [h])

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits from pre-norm hidden states."""
        return self.shard.all_gather(self.lm_head(self.norm(h)).float(), -1)

    @torch.no_grad()
    def reference_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain full-sequence forward of one sequence, no cache: LongTensor [T] -> float logits [T, vocab]."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        return self.compute_logits(self(ids, StepBatch.single(ids.shape[0], device=ids.device)))
