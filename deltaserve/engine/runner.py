"""ModelRunner: turns a StepPlan into one StepBatch, runs the model once over the flattened tokens of every
scheduled request, and returns fp32 logits for the requests whose last scheduled token is their newest token."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cache.paged_cache import PagedCache
from ..layers.batch import StepBatch
from ..models.base import CausalLM
from ..ops.opset import OpSet
from .request import Request
from .scheduler import StepPlan


class ForwardOutput(NamedTuple):
    sampled: list[Request]  # requests that get a new token this step, in row order of `logits`
    logits: torch.Tensor  # [len(sampled), vocab] fp32


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedCache, ops: OpSet):
        self.model, self.cache, self.ops = model, cache, ops
        self.device = next(model.parameters()).device

    def build_batch(self, plan: StepPlan) -> tuple[torch.Tensor, StepBatch, list[int], list[Request]]:
        ids: list[int] = []
        positions: list[int] = []
        query_start, context_lens, handles = [0], [], []
        sample_rows, sampled = [], []
        for req, n in plan.chunks:
            start = req.num_computed_tokens
            ids.extend(req.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            query_start.append(query_start[-1] + n)
            context_lens.append(start)
            handles.append(self.cache.handle(req.block_ids, req.state_slot, start + n))
            if start + n == req.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sampled.append(req)
        batch = StepBatch(torch.tensor(positions, dtype=torch.long, device=self.device), query_start, context_lens,
                          self.cache, handles, list(plan.snapshots), self.ops)
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch, sample_rows, sampled

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> ForwardOutput:
        ids, batch, rows, sampled = self.build_batch(plan)
        h = self.model(ids, batch)
        return ForwardOutput(sampled, self.model.compute_logits(h[rows]))
