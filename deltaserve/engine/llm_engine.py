"""LLMEngine: add / step / abort over the scheduler, the paged caches, the runner and the sampler."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..cache.page_pool import PagePool
from ..cache.paged_cache import PagedCache
from ..cache.state_slots import StateSlots
from ..errors import ConfigError
from ..models.loader import DTYPES, load_model
from ..tokenizer import load_tokenizer
from .config import EngineArgs
from .detokenizer import StopChecker
from .outputs import CompletionOutput, RequestOutput
from .request import Request, RequestStatus
from .runner import ModelRunner
from .sampler import Sampler, SamplingState
from .sampling_params import InvalidRequestError, SamplingParams
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from ..default_model import default_model_path

        self.args = args
        self.model_path = Path(args.model) if args.model else default_model_path()
        self.model = load_model(self.model_path, dtype=args.dtype)
        self.tokenizer = load_tokenizer(self.model_path)
        config = self.model.config
        self.config = config
        self.pages, self.states = _size_pools(config, args, DTYPES[args.dtype])
        self.max_model_len = _resolve_max_model_len(args, config, self.pages.num_blocks * args.block_size)
        self.scheduler = Scheduler(self.pages, self.states, min(args.max_num_seqs, self.states.num_slots),
                                   args.max_num_batched_tokens, args.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, PagedCache(self.pages, self.states))
        self.sampler = Sampler(seed=args.seed)
        self.eos_ids = set(self.tokenizer.stop_token_ids(config.eos_token_ids))
        self._groups: dict[str, _Group] = {}

    # ---- requests ----
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue a request. Raises InvalidRequestError naming the problem; nothing is allocated then."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"the prompt has {len(ids)} tokens; max_model_len is "
                                                f"{self.max_model_len} (at least one token must be generated)")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        group = _Group(text, ids, params)
        self._groups[request_id] = group
        first = self._new_request(request_id, ids, params, max_tokens, index=0)
        first.siblings_pending = params.n - 1
        group.requests.append(first)
        self.scheduler.add(first)

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, max_tokens: int,
                     index: int) -> Request:
        if index and params.seed is not None:
            params = params.clone()
            params.seed = params.seed + index  # each of the n samples draws its own stream
        req = Request(request_id, list(ids), params, max_tokens, sampling=None, index=index)
        req.sampling = SamplingState(params, req.prompt_ids, req.output_ids, self.eos_ids)
        req.stop_checker = StopChecker(self.tokenizer, params)
        return req

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for req in group.requests:
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                req.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, update. Returns outputs of requests that changed this step."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("cannot schedule any request: the page pool is too small for the next chunk")
            return []
        fwd = self.runner.forward(plan)
        for req, n in plan.chunks:
            req.num_computed_tokens += n
        rows, reqs = self._fork_siblings(fwd.sampled)
        sample = self.sampler.sample(fwd.logits[rows], [r.sampling for r in reqs])
        changed: dict[str, None] = {}
        for req, token, lp in zip(reqs, sample.token_ids, sample.logprobs):
            self._append_token(req, token, lp)
            changed[req.request_id] = None
        return [self._output(rid) for rid in changed]

    def _fork_siblings(self, sampled: list[Request]) -> tuple[list[int], list[Request]]:
        """n > 1: once a prompt is computed, the other n - 1 samples share its pages and copy its KDA state, and all
        draw their first token from the same logits row."""
        rows, reqs = [], []
        for row, req in enumerate(sampled):
            rows.append(row)
            reqs.append(req)
            while req.siblings_pending:
                req.siblings_pending -= 1
                index = self._groups[req.request_id].params.n - 1 - req.siblings_pending
                child = self._new_request(req.request_id, req.prompt_ids, self._groups[req.request_id].params,
                                          req.max_tokens, index)
                self._groups[req.request_id].requests.append(child)
                if self._share_prefix(req, child):
                    rows.append(row)
                    reqs.append(child)
                else:
                    self.scheduler.add(child)  # no room to fork now: it recomputes the prompt later
        return rows, reqs

    def _share_prefix(self, parent: Request, child: Request) -> bool:
        pages, states = self.pages, self.states
        partial = parent.num_computed_tokens % pages.block_size != 0
        if len(self.scheduler.running) >= self.scheduler.max_num_seqs or not states.can_allocate() \
                or not pages.can_allocate(int(partial)):
            return False
        child.state_slot = states.allocate()
        states.copy(parent.state_slot, child.state_slot)
        full = parent.block_ids[:-1] if partial else list(parent.block_ids)
        pages.share(full)
        child.block_ids = full
        if partial:  # the last block is still being written: copy it so both can append
            (block,) = pages.allocate(1)
            pages.copy_block(parent.block_ids[-1], block)
            child.block_ids = full + [block]
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.scheduler.running.append(child)
        return True

    def _append_token(self, req: Request, token: int, logprob) -> None:
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        p = req.params
        past_min = len(req.output_ids) >= p.min_tokens
        stop_token = past_min and ((not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids)
        # vLLM: an eos / stop_token_ids token ends the completion without its own text (unless
        # include_stop_str_in_output); its id stays in token_ids.
        stop_str = None
        if not stop_token or p.include_stop_str_in_output:
            stop_str = req.stop_checker.append(token, check_stops=past_min)
        status = None
        if stop_str is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif past_min and not p.ignore_eos and token in self.eos_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif past_min and token in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.stop_checker.finish()
            self.scheduler.finish(req, status)
            req.finish_reason = status.value

    def _output(self, request_id: str) -> RequestOutput:
        group = self._groups[request_id]
        outs = []
        for req in sorted(group.requests, key=lambda r: r.index):
            cum = sum(lp.logprob for lp in req.logprobs) if req.logprobs else None
            outs.append(CompletionOutput(req.index, req.stop_checker.text, list(req.output_ids), cum,
                                         list(req.logprobs) if req.params.logprobs is not None else None,
                                         req.finish_reason, req.stop_reason,
                                         req.stop_checker.delta(req.is_finished)))
        finished = len(group.requests) == group.params.n and all(r.is_finished for r in group.requests)
        if finished:
            del self._groups[request_id]
        return RequestOutput(request_id, group.prompt, group.prompt_ids, outs, finished)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


class _Group:
    """The n completions of one request id."""

    def __init__(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams):
        self.prompt, self.prompt_ids, self.params = prompt, prompt_ids, params
        self.requests: list[Request] = []


def _resolve_max_model_len(args: EngineArgs, config, pool_tokens: int) -> int:
    """An explicit --max-model-len must fit the checkpoint and one sequence must fit the page pool; the default
    (the checkpoint's max_position_embeddings) is lowered to what the pool holds, with a warning."""
    limit = config.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > limit:
            raise ConfigError(f"max_model_len {args.max_model_len} exceeds the checkpoint's max_position_embeddings "
                              f"{limit}")
        if args.max_model_len > pool_tokens:
            raise ConfigError(f"max_model_len {args.max_model_len} does not fit the page pool ({pool_tokens} tokens "
                              f"with kv_cache_memory={args.kv_cache_memory}); raise kv_cache_memory or lower "
                              f"max_model_len")
        return args.max_model_len
    if limit > pool_tokens:
        log.warning("max_model_len lowered from %d to %d tokens, what the page pool holds", limit, pool_tokens)
    return min(limit, pool_tokens)


def _size_pools(config, args: EngineArgs, dtype: torch.dtype) -> tuple[PagePool, StateSlots]:
    """Give KDA state slots for max_num_seqs first (bounded by the budget), the rest to pages."""
    budget = args.kv_cache_memory_bytes
    slot_bytes = StateSlots.bytes_per_slot(config)
    block_bytes = PagePool.bytes_per_token(config, dtype) * args.block_size
    num_slots = args.max_num_seqs if slot_bytes == 0 else min(args.max_num_seqs, budget // slot_bytes)
    num_blocks = (budget - num_slots * slot_bytes) // max(block_bytes, 1)
    if num_slots < 1 or num_blocks < 1:
        raise ConfigError(f"kv_cache_memory of {budget} bytes is too small: one KDA state slot needs {slot_bytes} "
                          f"bytes and one page of {args.block_size} tokens needs {block_bytes} bytes")
    log.info("cache: %d KDA state slots (%d B each), %d pages of %d tokens = %d tokens (%d B per token)",
             num_slots, slot_bytes, num_blocks, args.block_size, num_blocks * args.block_size,
             block_bytes // args.block_size)
    return (PagePool(config, num_blocks, args.block_size, dtype),
            StateSlots(config, num_slots))
