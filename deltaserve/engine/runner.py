"""ModelRunner: turns a StepPlan into one StepBatch, runs the model once over the flattened tokens of every
scheduled request, and returns fp32 logits for the requests whose last scheduled token is their newest token (with
speculative drafts: the newest token's row and every draft's, docs/serving.md §9.1), and the prompt logprobs of the
prompt rows of requests that asked for them.

Failures while building one request's rows raise RequestFault naming it (nothing has been computed yet, so the core
can drop that request and run the others); a failure inside the model call belongs to the whole batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cache.paged_cache import PagedCache
from ..backends import Backend
from ..layers.batch import StepBatch
from ..models.base import CausalLM
from ..ops.qli import StepIndexMeta, build_index_meta
from .faults import FaultInjector, RequestFault
from .request import Request
from .sampler import TokenLogprobs, score_tokens
from .scheduler import StepPlan
from .step_timer import StepTimer

# Prompt rows whose logits are materialised at once: a long chunk times a large vocabulary would not fit otherwise.
SCORE_ROWS = 256


class PromptRows(NamedTuple):
    """Rows of the step's hidden states whose logits score prompt tokens: rows first, first + 1, ... predict
    `targets` (the request's next prompt tokens)."""

    request: Request
    first: int
    targets: list[int]


class ForwardOutput(NamedTuple):
    sampled: list[Request]  # requests that get a new token this step, in row order of `logits`
    logits: torch.Tensor  # [sum(num_rows), vocab] fp32
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]] = []  # reports of prompt tokens scored this step
    # rows of `logits` per sampled request: 1, or 1 + its drafts on a verify step (the newest token's row, then
    # one per draft)
    num_rows: list[int] = []
    hidden: torch.Tensor | None = None  # [N, d] every row's pre-norm final state, when the runner keeps them
    sample_rows: list[int] = []  # the row of `hidden` each row of `logits` was computed from


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedCache, backend: Backend, timer: StepTimer | None = None,
                 faults: FaultInjector | None = None, keep_hidden: bool = False):
        self.model, self.cache, self.backend, self.ops = model, cache, backend, backend.ops
        self.keep_hidden = keep_hidden  # a drafter reads the target's states (spec_decode: reads_hidden)
        self.timer = timer or StepTimer()
        self.faults = faults
        self.device = next(model.parameters()).device

    def build_batch(self, plan: StepPlan) -> tuple[torch.Tensor, StepBatch, list[int], list[Request], list[int],
                                                   list[PromptRows]]:
        ids: list[int] = []
        positions: list[int] = []
        query_start, context_lens, handles = [0], [], []
        sample_rows, sampled, num_rows, scored = [], [], [], []
        for req, n in plan.chunks:
            start = req.num_computed_tokens
            known = min(start + n, req.num_tokens)  # then the drafts the scheduler kept
            try:  # this request's pieces first, so a failure leaves the batch lists as they were
                if self.faults is not None:
                    self.faults.check("forward", req.request_id, req.prompt_ids)
                tokens = req.token_slice(start, known) + req.spec_token_ids[:start + n - known]
                handle = self.cache.handle(req.block_ids, req.state_slot, start + n)
            except Exception as exc:
                raise RequestFault(req.request_id, exc) from exc
            ids.extend(tokens)
            positions.extend(range(start, start + n))
            query_start.append(query_start[-1] + n)
            context_lens.append(start)
            handles.append(handle)
            if start + n >= req.num_tokens:  # the newest token's row, then each draft's
                rows = start + n - req.num_tokens + 1
                sample_rows.extend(range(query_start[-1] - rows, query_start[-1]))
                sampled.append(req)
                num_rows.append(rows)
            if req.scores_prompt:  # the row at position p predicts prompt token p + 1
                lo, hi = max(start, len(req.prompt_logprobs) - 1), min(start + n, req.prompt_len - 1)
                if hi > lo:
                    scored.append(PromptRows(req, query_start[-2] + lo - start, req.prompt_ids[lo + 1:hi + 1]))
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        write_rows = torch.cat([h.rows[c:] for h, c in zip(handles, context_lens)]) if handles else None
        batch = StepBatch(positions_t, query_start, context_lens, self.cache, handles, list(plan.snapshots), self.ops,
                          self._index_meta(plan, positions_t, query_start), write_rows)
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch, sample_rows, sampled, num_rows, scored

    def _index_meta(self, plan: StepPlan, positions: torch.Tensor, query_start: list[int]) -> StepIndexMeta | None:
        """DSA metadata for the fast sparse path, built once per step and shared by every DSA layer."""
        config = self.model.config
        if not config.has_dsa or self.ops.name == "reference":
            return None
        tables = [torch.tensor(req.block_ids, dtype=torch.long) for req, _ in plan.chunks]
        ctx_lens = [req.num_computed_tokens + n for req, n in plan.chunks]
        seq_ids = torch.repeat_interleave(torch.arange(len(plan.chunks)),
                                          torch.tensor([n for _, n in plan.chunks]))
        return build_index_meta(tables, ctx_lens, seq_ids, positions, self.cache.pages.block_size,
                                config.index_topk)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> ForwardOutput:
        with self.timer.phase("prepare"):
            ids, batch, rows, sampled, num_rows, scored = self.build_batch(plan)
        with self.timer.phase("model"):
            h = self.backend.forward(self.model, ids, batch)
            if self.faults is not None:
                for req, _ in plan.chunks:
                    self.faults.check("model", req.request_id, req.prompt_ids)
            logits = self.model.compute_logits(h[rows])
        with self.timer.phase("sample"):
            return ForwardOutput(sampled, logits, [(p.request, self._score(h, p)) for p in scored], num_rows,
                                 h if self.keep_hidden else None, rows)

    def _score(self, h: torch.Tensor, rows: PromptRows) -> list[TokenLogprobs]:
        num_top = rows.request.params.prompt_logprobs
        reports: list[TokenLogprobs] = []
        for k in range(0, len(rows.targets), SCORE_ROWS):
            targets = rows.targets[k:k + SCORE_ROWS]
            first = rows.first + k
            reports += score_tokens(self.model.compute_logits(h[first:first + len(targets)]), targets, num_top)
        return reports
