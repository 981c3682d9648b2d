"""ModelRunner: turns a StepPlan into one StepBatch, runs the model once over the flattened tokens of every
scheduled request, and returns fp32 logits for the requests whose last scheduled token is their newest token (with
speculative drafts: the newest token's row and every draft's, docs/serving.md §9.1), and the prompt logprobs of the
prompt rows of requests that asked for them.

The step is first written as a `StepLayout` (integers only: tokens, positions, page tables, slots, snapshots, the
rows whose logits are taken), from which `batch_of` builds the StepBatch: over a tensor-parallel group rank 0 sends
the layout to the other ranks (engine/workers.py), which build the same batch over their own pools.

Failures while building one request's rows raise RequestFault naming it (nothing has been computed yet, so the core
can drop that request and run the others); a failure inside the model call belongs to the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from ..cache.paged_cache import PagedCache
from ..backends import Backend
from ..layers.batch import StepBatch, StepLayout
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
    """`send_step` (tensor parallelism: engine/workers.py) is called with each step's layout before rank 0 runs it,
    so that every rank runs the same step."""

    def __init__(self, model: CausalLM, cache: PagedCache, backend: Backend, timer: StepTimer | None = None,
                 faults: FaultInjector | None = None, keep_hidden: bool = False,
                 send_step: Callable[[StepLayout], None] | None = None,
                 image_features: Mapping[str, torch.Tensor] | None = None):
        self.model, self.cache, self.backend, self.ops = model, cache, backend, backend.ops
        self.keep_hidden = keep_hidden  # a drafter reads the target's states (spec_decode: reads_hidden)
        self.timer = timer or StepTimer()
        self.faults = faults
        self.send_step = send_step
        self.image_features = image_features  # an image's features by digest (filled by the engine before a step)
        self.device = next(model.parameters()).device

    def layout(self, plan: StepPlan) -> tuple[StepLayout, list[Request], list[int], list[PromptRows]]:
        """The step's layout, the requests sampled (in row order) with their row counts, and the prompt rows
        scored."""
        ids: list[int] = []
        positions: list[int] = []
        query_start, context_lens, slots, tables = [0], [], [], []
        sample_rows, sampled, num_rows, scored = [], [], [], []
        for req, n in plan.chunks:
            start = req.num_computed_tokens
            known = min(start + n, req.num_tokens)  # then the drafts the scheduler kept
            try:  # this request's pieces first, so a failure leaves the batch lists as they were
                if self.faults is not None:
                    self.faults.check("forward", req.request_id, req.prompt_ids)
                tokens = req.token_slice(start, known) + req.spec_token_ids[:start + n - known]
            except Exception as exc:
                raise RequestFault(req.request_id, exc) from exc
            ids.extend(tokens)
            positions.extend(range(start, start + n))
            query_start.append(query_start[-1] + n)
            context_lens.append(start)
            slots.append(req.state_slot)
            tables.append(req.block_ids)
            if start + n >= req.num_tokens:  # the newest token's row, then each draft's
                rows = start + n - req.num_tokens + 1
                sample_rows.extend(range(query_start[-1] - rows, query_start[-1]))
                sampled.append(req)
                num_rows.append(rows)
            if req.scores_prompt:  # the row at position p predicts prompt token p + 1
                lo, hi = max(start, len(req.prompt_logprobs) - 1), min(start + n, req.prompt_len - 1)
                if hi > lo:
                    scored.append(PromptRows(req, query_start[-2] + lo - start, req.prompt_ids[lo + 1:hi + 1]))
        layout = StepLayout(ids, positions, query_start, context_lens, slots, tables, list(plan.snapshots),
                            sample_rows, [(p.first, len(p.targets)) for p in scored])
        return layout, sampled, num_rows, scored

    def batch_of(self, layout: StepLayout) -> tuple[torch.Tensor, StepBatch]:
        """The step's token ids and StepBatch over this runner's cache."""
        q = layout.query_start
        handles = [self.cache.handle(table, slot, ctx + q[i + 1] - q[i])
                   for i, (table, slot, ctx) in enumerate(zip(layout.tables, layout.slots, layout.context_lens))]
        positions = torch.tensor(layout.positions, dtype=torch.long, device=self.device)
        write_rows = torch.cat([h.rows[c:] for h, c in zip(handles, layout.context_lens)]) if handles else None
        batch = StepBatch(positions, q, layout.context_lens, self.cache, handles, layout.snapshots, self.ops,
                          self._index_meta(layout, positions), write_rows)
        return torch.tensor(layout.ids, dtype=torch.long, device=self.device), batch

    def _index_meta(self, layout: StepLayout, positions: torch.Tensor) -> StepIndexMeta | None:
        """DSA metadata for the fast sparse path, built once per step and shared by every DSA layer."""
        config = self.model.config
        if not config.has_dsa or self.ops.name == "reference":
            return None
        q = layout.query_start
        counts = [q[i + 1] - q[i] for i in range(len(layout.slots))]
        tables = [torch.tensor(table, dtype=torch.long) for table in layout.tables]
        ctx_lens = [c + n for c, n in zip(layout.context_lens, counts)]
        seq_ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        return build_index_meta(tables, ctx_lens, seq_ids, positions, self.cache.pages.block_size,
                                config.index_topk)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> ForwardOutput:
        with self.timer.phase("prepare"):
            layout, sampled, num_rows, scored = self.layout(plan)
            if self.send_step is not None:
                self.send_step(layout)
            ids, batch = self.batch_of(layout)
            batch.input_embeds = self._image_rows(plan, layout)
        with self.timer.phase("model"):
            h = self.backend.forward(self.model, ids, batch)
            if self.faults is not None:
                for req, _ in plan.chunks:
                    self.faults.check("model", req.request_id, req.prompt_ids)
            logits = self.model.compute_logits(h[layout.sample_rows])
        with self.timer.phase("sample"):
            return ForwardOutput(sampled, logits, [(p.request, self._score(h, p)) for p in scored], num_rows,
                                 h if self.keep_hidden else None, layout.sample_rows)

    def _image_rows(self, plan: StepPlan, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, features) of the step's rows that are image pad positions: each chunk takes the slice of each
        image's features its positions reach (a chunk may start or end inside a pad run); None without a tower."""
        if self.image_features is None:
            return None
        rows, values = [], []
        for (req, n), first_row in zip(plan.chunks, layout.query_start):
            start = req.num_computed_tokens
            for first, count, image in req.images:
                lo, hi = max(first, start), min(first + count, start + n)
                if lo < hi:
                    rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
                    values.append(self.image_features[image.digest][lo - first:hi - first])
        return (torch.cat(rows), torch.cat(values)) if rows else None

    def _score(self, h: torch.Tensor, rows: PromptRows) -> list[TokenLogprobs]:
        num_top = rows.request.params.prompt_logprobs
        reports: list[TokenLogprobs] = []
        chunks = self.score_logits(h, rows.first, len(rows.targets))
        for k, logits in zip(range(0, len(rows.targets), SCORE_ROWS), chunks):
            reports += score_tokens(logits, rows.targets[k:k + SCORE_ROWS], num_top)
        return reports

    @torch.inference_mode()
    def run_layout(self, layout: StepLayout) -> None:
        """Another rank's part of a step rank 0 runs: the forward and every logits product (their vocabulary
        slices are gathered: each rank takes part in the same ones, in the same order)."""
        ids, batch = self.batch_of(layout)
        h = self.backend.forward(self.model, ids, batch)
        self.model.compute_logits(h[layout.sample_rows])
        for first, count in layout.score_rows:
            for _ in self.score_logits(h, first, count):
                pass

    def score_logits(self, h: torch.Tensor, first: int, count: int):
        """The logits of rows first .. first + count - 1, SCORE_ROWS at a time (a long chunk times a large
        vocabulary would not fit at once)."""
        for k in range(0, count, SCORE_ROWS):
            yield self.model.compute_logits(h[first + k:first + min(count, k + SCORE_ROWS)])

