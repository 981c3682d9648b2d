"""EngineCore: the model, the paged caches, the scheduler, the runner and the sampler, stepping over token ids.

It knows nothing about text: it stops a completion on eos / stop token ids / length and reports one CoreOutput per
new token; stop strings are found by the OutputProcessor, which then aborts that completion here. The core runs
in-process for the offline LLM and in its own process behind the server.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..cache.page_pool import PagePool
from ..cache.paged_cache import PagedCache
from ..cache.prefix_cache import PrefixCache
from ..cache.state_slots import StateSlots
from ..distributed import Shard
from ..disagg import KVPayload, cache_format, export_kv, import_kv
from ..disagg.connector import KVConsumer, KVProducer
from ..disagg.payload import model_fingerprint
from ..errors import ConfigError, DeltaserveError, KVTransferError
from ..layers.batch import DraftSlot
from ..backends.select import select_backend
from ..spec_decode import DraftRequest, SpecDecodeStats, TargetStep, build_proposer
from ..models.dspark import load_drafter
from ..models.vision import load_vision
from ..vision import MediaConfig, ProcessedImage
from ..models.loader import DTYPES, load_config, load_model
from ..tokenizer import load_tokenizer
from .config import EngineArgs, resolve_dtype
from .faults import FaultInjector, InjectedFault, RequestFailure, RequestFault, describe
from .grammar import Grammars
from .heap import keep_freed_memory
from .pools import build_pools, drafter_cache_layers, pool_bytes, size_pools
from .request import Request, RequestStatus
from .runner import ForwardOutput, ModelRunner
from .sampler import SampleOutput, Sampler, SamplingState, TokenLogprobs
from .sampling_params import InvalidRequestError, SamplingParams
from .scheduler import Scheduler, StepPlan
from .step_timer import StepTimer
from .workers import RanksOutOfStep, Workers
from .summary import EngineSummary, layer_mix, quantization_text, weight_bytes, weight_bytes_by_format

log = logging.getLogger(__name__)

TRANSFER_WAIT_S = 0.05  # how long an idle step waits for a transfer to end before returning
MAX_CACHED_IMAGES = 64  # image features kept for reuse (a step's images are never evicted by it)


class EngineBrokenError(DeltaserveError, RuntimeError):
    """The engine's cache pools no longer add up; it must be restarted."""


@dataclass
class CoreOutput:
    """One new token of one completion (`index` among the request's n)."""

    request_id: str
    index: int
    token_id: int
    logprob: TokenLogprobs | None
    finish_reason: str | None  # "stop" (eos / stop token id), "length", or None while running
    stop_reason: int | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # With the first token of a request that asked for prompt logprobs: one report per prompt token (None first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With the last token of a prefill instance's request (do_remote_decode): how a decode instance pulls its cache.
    kv_transfer_params: dict | None = None


class SampledRows(NamedTuple):
    """The logits rows a request samples from this step: `count` rows from `first` (1, or 1 + its drafts)."""

    request: Request
    first: int
    count: int


class EngineCore:
    def __init__(self, args: EngineArgs, model_path: Path):
        self.args, self.model_path = args, model_path
        if args.node_rank > 0:
            raise ConfigError(f"node_rank {args.node_rank}: an engine runs on node 0; a further node runs only its "
                              f"ranks (`deltaserve serve|generate|bench ... --node-rank {args.node_rank}`)")
        keep_freed_memory()  # activations stop being faulted in afresh every step (engine/heap.py)
        self.dtype = resolve_dtype(args.dtype, load_config(model_path).torch_dtype)
        self.workers = Workers(args, model_path) if args.tensor_parallel_size > 1 else None
        shard = Shard()
        if self.workers is not None:
            weakref.finalize(self, self.workers.close)  # an engine dropped without close() leaves no processes
            shard = self.workers.shard
        log.info("loading the weights of %s in %s (%s)", model_path, self.dtype.name, self.dtype.reason)
        started = time.monotonic()
        self.model = load_model(model_path, dtype=self.dtype.name, quantization=args.quantization, shard=shard)
        self.weight_bytes = weight_bytes(self.model)
        self.weight_bytes_by_format = weight_bytes_by_format(self.model)
        log.info("loaded %.1f MB of weights in %.1f s", self.weight_bytes / 1e6, time.monotonic() - started)
        self.backend = select_backend(args.backend, args.ops)
        self.backend_prepared = self.backend.prepare(self.model)
        log.info("backend %s (%s): %s", self.backend.name, self.backend.reason, self.backend_prepared)
        config = self.config = self.model.config
        tokenizer = load_tokenizer(model_path)
        self.eos_ids = set(tokenizer.stop_token_ids(config.eos_token_ids))
        self.grammars = Grammars(tokenizer, config.vocab_size, self.eos_ids, num_threads=torch.get_num_threads())
        self.sampler = Sampler(seed=args.seed, grammars=self.grammars)
        self.spec = spec = args.speculative
        k = spec.num_speculative_tokens if spec is not None else 0
        self.drafter = _drafter(spec, self.model, model_path, DTYPES[self.dtype.name])
        drafter_layers = drafter_cache_layers(config, spec, self.drafter)
        sizes = size_pools(config, args, DTYPES[self.dtype.name], drafter_layers, shard)
        self.pages, self.states, self.checkpoints, self.drafts = build_pools(config, args, DTYPES[self.dtype.name],
                                                                             sizes, drafter_layers, shard)
        if self.workers is not None:
            self.workers.share_pools(list(sizes), self.weight_bytes,
                                     pool_bytes(self.pages, self.states, self.checkpoints, self.drafts))
            for pool in (self.pages, self.states, self.checkpoints, self.drafts):
                if pool is not None:
                    pool.journal = self.workers.journal
        self.max_model_len = _resolve_max_model_len(args, config, self.pages.num_blocks * args.block_size)
        self.prefix = (PrefixCache(self.pages, self.states, self.checkpoints, args.state_checkpoint_interval,
                                   str(model_path.resolve())) if self.checkpoints is not None else None)
        cache = PagedCache(self.pages, self.states, self.checkpoints, self.drafts)
        self.proposer = (build_proposer(spec, self.model, cache, self.backend, self.drafter, config.num_layers,
                                        self.sampler.default_generator(),
                                        self.workers.send_draft if self.workers is not None else None)
                         if spec is not None else None)
        if self.proposer is not None:
            log.info("speculative decoding: %s, up to %d drafts a step", spec.method, k)
        self.scheduler = Scheduler(self.pages, self.states, min(args.max_num_seqs, self.states.num_slots),
                                   args.max_num_batched_tokens, args.enable_chunked_prefill, self.prefix,
                                   k if self.drafts is not None else 0,
                                   k if spec is not None and spec.method == "mtp" else 0, self.max_model_len)
        self.spec_stats = SpecDecodeStats(k)
        self.timer = StepTimer()
        # Optional observer of each step's sampled rows: (requests, fp32 logits [rows, vocab]) before sampling.
        # Used by `bench quant` to compare distributions; None costs nothing.
        self.logits_observer: Callable[[list[Request], torch.Tensor], None] | None = None
        self.faults = FaultInjector.parse(args.fault_injection)
        # the vision tower (docs/vision.md), on one process; each image's features, by content, least recent first
        self.vision = load_vision(model_path, DTYPES[self.dtype.name]) if self.workers is None else None
        self.media = MediaConfig.load(model_path) if self.vision is not None else None
        self.image_features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.runner = ModelRunner(self.model, cache, self.backend, self.timer, self.faults,
                                  keep_hidden=self.proposer is not None and self.proposer.reads_hidden,
                                  send_step=self.workers.send_step if self.workers is not None else None,
                                  image_features=self.image_features if self.vision is not None else None)
        self._pending_copies: list[tuple[int, int]] = []  # (source, destination) pages of this step's forks
        self._requests: dict[str, list[Request]] = {}
        self._n: dict[str, tuple[SamplingParams, int, str | None]] = {}  # params, max_tokens, grammar text
        self._failures: dict[str, RequestFailure] = {}
        self._start_kv_transfer(args.kv_transfer, cache)

    def _start_kv_transfer(self, config, cache: PagedCache) -> None:
        """Prefill/decode disaggregation (docs/disaggregation.md): the producer and/or consumer half of the
        connector, per kv_role; the requests waiting for their cache (`_pulling`), and those whose cache has
        arrived and that wait for pages and a slot (`_loaded`)."""
        self.engine_id = uuid.uuid4().hex[:16]
        self.kv_producer = self.kv_consumer = None
        self._pulling: dict[str, Request] = {}
        self._loaded: deque[tuple[Request, KVPayload]] = deque()
        self.kv_transfers_recomputed = 0  # transferred requests computed here after all (their cached pages went)
        self._transfer_times: list[float] = []  # seconds of each pull that arrived since `take_kv_transfer_times`
        if config is None:
            return
        fmt = cache_format(model_fingerprint(self.model_path), cache.pages, cache.states)
        if config.is_producer:
            self.kv_producer = KVProducer(config, fmt, self.engine_id)
        if config.is_consumer:
            self.kv_consumer = KVConsumer(config, fmt)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, client: str | None = None,
                    images: list[ProcessedImage] | None = None) -> None:
        """Validate token ids against the model and queue. Raises InvalidRequestError; nothing is allocated then.
        `client` is the scheduler's fairness key (default: the request id); all n completions share it."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError("prompt", f"token id {bad[0]} is outside the vocabulary "
                                                f"[0, {self.config.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"the prompt has {len(prompt_ids)} tokens; max_model_len is "
                                                f"{self.max_model_len} (at least one token must be generated)")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        kv = params.kv_transfer_params or {}
        pull = self._check_kv_transfer(kv, params, prompt_ids)
        spans = self._image_spans(prompt_ids, images or [], kv)
        remote_decode = len(prompt_ids) - 1 if kv.get("do_remote_decode") else None
        if remote_decode is not None:  # all but the last prompt token, and a token nobody reads: the decode
            prompt_ids, max_tokens = prompt_ids[:-1] or prompt_ids, 1  # instance computes the last one itself
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        first = self._new_request(request_id, list(prompt_ids), params, max_tokens, 0, grammar)
        first.images = spans
        first.cache_salt = cache_salt
        first.client = request_id if client is None else client
        first.siblings_pending = params.n - 1
        first.remote_decode_tokens = remote_decode
        self._requests[request_id] = [first]
        self._n[request_id] = (params, max_tokens, grammar)
        if pull:  # the pages this side has cached already do not travel
            self._pulling[request_id] = first
            cached = self.prefix.cached_pages(first, kv["num_tokens"]) if self.prefix is not None else []
            self.kv_consumer.pull(request_id, kv, len(cached))
        else:
            self.scheduler.add(first)

    def _image_spans(self, prompt_ids: list[int], images: list[ProcessedImage], kv: dict) -> list:
        """(first pad position, pad count, image) of each image: the k-th run of media pad tokens in the prompt is
        the k-th image's and must be exactly its length (InvalidRequestError otherwise)."""
        if self.vision is None:
            if images:
                why = "runs on several ranks" if self.workers is not None else "has no vision tower"
                raise InvalidRequestError("images", f"this engine {why}: it takes no images")
            return []
        pad = self.config.media_placeholder_token_id
        runs, i = [], 0
        while i < len(prompt_ids):
            if prompt_ids[i] == pad:
                j = i
                while j < len(prompt_ids) and prompt_ids[j] == pad:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if [n for _, n in runs] != [image.num_tokens for image in images]:
            raise InvalidRequestError("prompt", f"the prompt's image pad runs {[n for _, n in runs]} do not match the "
                                                f"images' positions {[image.num_tokens for image in images]}")
        return [(start, n, image) for (start, n), image in zip(runs, images)]

    def _check_kv_transfer(self, kv: dict, params: SamplingParams, prompt_ids: list[int]) -> bool:
        """Whether this instance can take a request's kv_transfer_params (InvalidRequestError if not); True when its
        cache is to be pulled from a prefill instance."""
        if kv.get("do_remote_decode"):
            if self.kv_producer is None:
                raise InvalidRequestError("kv_transfer_params", "kv_transfer_params.do_remote_decode: this instance "
                                                                "is not a kv_producer (--kv-transfer-config)")
            if params.n != 1:
                raise InvalidRequestError("n", "a prefill instance's request (do_remote_decode) takes n = 1; the "
                                               "decode instance forks the n completions")
            return False
        if not kv.get("do_remote_prefill") or kv.get("num_tokens", 0) == 0:
            return False
        if self.kv_consumer is None:
            raise InvalidRequestError("kv_transfer_params", "kv_transfer_params.do_remote_prefill: this instance is "
                                                            "not a kv_consumer (--kv-transfer-config)")
        if kv["num_tokens"] >= len(prompt_ids):
            raise InvalidRequestError("kv_transfer_params", f"kv_transfer_params.num_tokens {kv['num_tokens']} must "
                                                            f"be below the prompt's {len(prompt_ids)} tokens")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs", "prompt_logprobs: the prompt's cache comes from the prefill "
                                                         "instance, so its tokens have no logits here")
        return True

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, max_tokens: int,
                     index: int, grammar: str | None) -> Request:
        if index and params.seed is not None:
            params = params.clone()
            params.seed = params.seed + index  # each of the n samples draws its own stream
        req = Request(request_id, ids, params, max_tokens, sampling=None, index=index)
        req.sampling = SamplingState(params, req.prompt_ids, req.output_ids, self.eos_ids)
        if grammar is not None:
            req.sampling.grammar = self.grammars.matcher(grammar)
        return req

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Finish the request (or one completion of it) and free everything it holds. Unknown ids are ignored."""
        self._pulling.pop(request_id, None)
        if self._loaded:
            self._loaded = deque((r, p) for r, p in self._loaded if r.request_id != request_id)
        for req in list(self._requests.get(request_id, [])):
            if index is not None and req.index != index:
                continue
            if not req.is_finished:
                status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_ABORTED
                self.scheduler.finish(req, status)
                req.finish_reason = reason
            if index is None:
                req.siblings_pending = 0
            else:
                self._spawn_unforked(req)  # siblings not forked yet still need the prompt: they compute it
        self._forget_if_done(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step ----
    def step(self) -> list[CoreOutput]:
        """Schedule, run the model once, sample and append one token per sampled completion.

        A failure attributable to one request (see engine/faults.py for the phases) fails that request only: all of
        its completions are finished and freed, and it is reported by `take_failures()`; the others go on. A failure
        that cannot be attributed (inside the batched model call, where every row's KDA state may be half-updated)
        fails every request of the step's batch. Either way the step returns the outputs of the survivors; it raises
        only EngineBrokenError, when the pools no longer add up after failing everything."""
        try:
            with self.timer.phase("schedule"):
                self._load_transferred()
                plan = self._schedule()
        except Exception as exc:  # noqa: BLE001 — the scheduler's own state is suspect: fail what it holds
            self._fail_all("schedule", exc)
            return []
        if not plan.chunks:
            if self._pulling or self._loaded:  # nothing to run until a transfer ends
                self.kv_consumer.wait(TRANSFER_WAIT_S)
            return []
        self.timer.steps += 1
        try:
            return self._run(plan)
        except RanksOutOfStep as exc:  # no step can run on the ranks any more
            self._fail_all("step", exc)
            raise EngineBrokenError(f"{exc}; the engine stops") from exc
        except Exception as exc:  # noqa: BLE001 — not attributable to one request: the whole batch fails
            self._fail_batch(plan, "step", exc)
            return []

    def close(self) -> None:
        """Stop the tensor-parallel workers and the transfer threads (nothing to do for one plain process)."""
        for half in (self.kv_producer, self.kv_consumer):
            if half is not None:
                half.close()
        if self.workers is not None:
            report = self.parallel_report()
            log.info("tensor parallel: %d steps, %.3f s in collectives on rank 0 (%.2f ms a step)",
                     self.timer.steps, self.workers.clock.seconds, 1e3 * report["comm_s_per_step"])
            self.workers.close()

    def parallel_report(self) -> dict | None:
        """Over a tensor-parallel group: its layout, every rank's weight and cache pool bytes, and rank 0's time in
        collectives (step broadcasts, the layers' all-reduces and gathers) per step so far; None for one process."""
        if self.workers is None:
            return None
        clock, steps = self.workers.clock, max(self.timer.steps, 1)
        return {"tensor_parallel_size": self.args.tensor_parallel_size,
                "enable_expert_parallel": self.args.enable_expert_parallel,
                "rank_weight_bytes": [w for w, _ in self.workers.rank_bytes],
                "rank_pool_bytes": [p for _, p in self.workers.rank_bytes],
                "comm_s_per_step": clock.seconds / steps, "comm_calls_per_step": clock.calls / steps}

    def take_failures(self) -> list[RequestFailure]:
        """The requests failed since the last call (each once)."""
        failures = list(self._failures.values())
        self._failures.clear()
        return failures

    def _load_transferred(self) -> None:
        """Take the transfers that ended: a failed one fails its request; an arrived cache is loaded into pages and a
        slot as soon as the scheduler has them (in arrival order), and its request runs on from there like a prefix
        hit."""
        if self.kv_consumer is None:
            return
        for request_id, result, seconds in self.kv_consumer.take_done():
            if not isinstance(result, KVTransferError):
                self._transfer_times.append(seconds)
            req = self._pulling.pop(request_id, None)
            if req is None:
                continue  # aborted meanwhile
            if isinstance(result, KVTransferError):
                self._fail(request_id, "kv_transfer", result)
            else:
                self._loaded.append((req, result))
        while self._loaded:
            req, payload = self._loaded[0]
            cached = self.prefix.cached_pages(req, payload.num_tokens) if self.prefix is not None else []
            if len(cached) < payload.first_page:  # evicted since the pull was sent: compute the prompt here
                self._loaded.popleft()
                log.warning("request %s: %d of the cached pages its transfer left out were evicted meanwhile; "
                            "computing its prompt here", req.request_id, payload.first_page - len(cached))
                self.kv_transfers_recomputed += 1
                self.scheduler.add(req)
                continue
            if not self.scheduler.admit_loaded(req, payload.num_tokens, cached[:payload.first_page]):
                if self.scheduler.running:
                    return  # pages or a slot free up as they finish
                self._loaded.popleft()
                self._fail_load(req, KVTransferError("the page pool is too small for the transferred cache", "load"))
                continue
            self._loaded.popleft()
            try:
                import_kv(payload, self.pages, self.states, req.block_ids, req.state_slot,
                          req.prompt_ids[:payload.num_tokens], _image_digests(req, payload.num_tokens))
            except KVTransferError as exc:
                self._fail_load(req, exc)
                continue
            log.info("request %s: loaded the cache of %d tokens, %d bytes from page %d on", req.request_id,
                     payload.num_tokens, payload.nbytes, payload.first_page)

    def _fail_load(self, req: Request, exc: KVTransferError) -> None:
        self.kv_consumer.count_failure("load")
        self._fail(req.request_id, "kv_transfer", exc)

    def _schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        if not plan.chunks and self.scheduler.waiting and not self.scheduler.running:
            head = self.scheduler.waiting[0]
            self._fail(head.request_id, "schedule",
                       RuntimeError("the page pool is too small for the request's next chunk"))
            return plan
        if self.faults is not None:
            for req, _ in plan.chunks:
                try:
                    self.faults.check("schedule", req.request_id, req.prompt_ids)
                except InjectedFault as exc:
                    self._fail(req.request_id, "schedule", exc)
        return self._without_failed(plan)

    def _encode_images(self, plan: StepPlan) -> None:
        """Features for every image a chunk of this step reaches, the missing ones encoded in one tower call;
        the cache keeps the most recent MAX_CACHED_IMAGES."""
        needed: dict[str, ProcessedImage] = {}
        for req, n in plan.chunks:
            start = req.num_computed_tokens
            for first, count, image in req.images:
                if first < start + n and first + count > start:
                    if image.digest in self.image_features:
                        self.image_features.move_to_end(image.digest)
                    else:
                        needed[image.digest] = image
        if needed:
            images = list(needed.values())
            with self.timer.phase("vision"):
                features = self.vision.encode(torch.cat([i.pixel_values for i in images]), [i.grid for i in images])
            for image, rows in zip(images, features.split([i.num_tokens for i in images])):
                self.image_features[image.digest] = rows
        while len(self.image_features) > MAX_CACHED_IMAGES:
            self.image_features.popitem(last=False)

    def _run(self, plan: StepPlan) -> list[CoreOutput]:
        timer = self.timer
        if self.vision is not None:
            self._encode_images(plan)
        while True:
            try:
                fwd = self.runner.forward(plan)
                break
            except RequestFault as fault:  # raised before the model ran: drop that request and run the rest
                self._fail(fault.request_id, "forward", fault)
                plan = self._without_failed(plan)
                if not plan.chunks:
                    return []
            except Exception as exc:
                if self.workers is not None:
                    raise RanksOutOfStep(f"a tensor-parallel step failed ({type(exc).__name__}: {exc})") from exc
                raise
        if self.logits_observer is not None:
            self.logits_observer([r for r, k in zip(fwd.sampled, fwd.num_rows) for _ in range(k)], fwd.logits)
        with timer.phase("update"):
            for req, reports in fwd.prompt_logprobs:
                req.prompt_logprobs += reports
            starts = [req.num_computed_tokens for req, _ in plan.chunks]
            for req, n in plan.chunks:
                req.num_computed_tokens += n - len(req.spec_token_ids)  # drafts count once accepted
            if self.prefix is not None:
                self.prefix.commit([c.request for c in plan.chunks])
            rows = self._fork_siblings(fwd)
        with timer.phase("sample"):
            # every row at once, but a verify step's rows whose sampling reads the tokens before them (row by row)
            batched = [r for r in rows if r.count == 1
                       or not (r.request.sampling.reads_history or _drafts_with_probs(r.request))]
            drawn = {}
            if batched:
                sample = self._sample(_take_rows(fwd.logits, batched),
                                      [r.request for r in batched for _ in range(r.count)])
                pairs = iter(zip(sample.token_ids, sample.logprobs))
                drawn = {r.request: [next(pairs) for _ in range(r.count)] for r in batched}
        with timer.phase("update"):
            outputs = []
            for r in rows:
                if r.request.request_id in self._failures:
                    continue  # failed while sampling, or a sibling failed: its completions are already freed
                outputs += self._emit(r, drawn.get(r.request), fwd.logits)
            outputs = [o for o in outputs if o.request_id not in self._failures]
            for rid in {o.request_id for o in outputs if o.finish_reason}:
                self._forget_if_done(rid)
        with timer.phase("propose"):
            try:
                drafting = self.proposer is not None and self._catch_up(plan, starts, fwd.hidden)
            finally:
                for src, dst in self._pending_copies:  # after the drafter wrote its rows of the parent's last page
                    self.pages.copy_block(src, dst)
                self._pending_copies.clear()
            if drafting:
                self._propose(rows)
        return outputs

    def _catch_up(self, plan: StepPlan, starts: list[int], hidden: torch.Tensor | None) -> bool:
        """Let the proposer bring its own cache rows up to every scheduled request's newest token; False when it
        failed (the step's requests then decode on without drafts)."""
        first, chunks = 0, []
        for (req, n), start in zip(plan.chunks, starts):
            if req.request_id not in self._failures:
                chunks.append((req, start, n, first))
            first += n
        try:
            self.proposer.catch_up(TargetStep(hidden, chunks))
        except Exception:  # noqa: BLE001 — drafts only ever save time
            log.exception("the %s proposer failed; this step's requests decode on without drafts", self.spec.method)
            return False
        return True

    def _emit(self, rows: SampledRows, drawn: list[tuple[int, TokenLogprobs | None]] | None,
              logits: torch.Tensor) -> list[CoreOutput]:
        """Append the request's tokens: its one sampled token, or on a verify step the tokens its rows give while
        each equals the draft its row was computed after (docs/serving.md §9.2): a one-hot draft is kept exactly when
        the sampler picks it, a draft drawn from q (a random request's DSpark draft) when `Sampler.verify_draft`
        keeps it; the first token that differs is the sampler's own. `drawn` holds the rows sampled at once, None
        when each row is sampled after the previous token is appended (`SamplingState.reads_history`, or q)."""
        req = rows.request
        drafts = list(req.spec_token_ids)
        probs = req.spec_token_probs if _drafts_with_probs(req) else None
        outputs = []
        for i in range(rows.count):
            row = logits[rows.first + i:rows.first + i + 1]
            if drawn is not None:
                token, logprob = drawn[i]
            elif probs is not None and i < len(drafts):
                try:
                    token, logprob = self.sampler.verify_draft(row, req.sampling, drafts[i], probs[i])
                except Exception as exc:  # noqa: BLE001 — this row's request fails alone
                    self._fail(req.request_id, "sample", exc)
                    break
            else:
                one = self._sample(row, [req])
                token, logprob = one.token_ids[0], one.logprobs[0]
            if req.request_id in self._failures:
                break
            try:
                if self.faults is not None:
                    self.faults.check("output", req.request_id, req.prompt_ids)
                out = self._append_token(req, token, logprob)
            except Exception as exc:  # noqa: BLE001 — this request's bookkeeping: fail it alone
                self._fail(req.request_id, "output", exc)
                break
            outputs.append(out)
            if out.finish_reason or i == len(drafts) or token != drafts[i]:
                break
        if drafts:
            self._settle_drafts(req, len(drafts), max(len(outputs) - 1, 0))
        return outputs

    def _settle_drafts(self, req: Request, drafted: int, accepted: int) -> None:
        """Count the first `accepted` drafts as computed and put the KDA state of a request that goes on back to the
        one after them: the snapshot its verify step took there, unless every draft was kept (then the state the step
        ended with is the one)."""
        self.spec_stats.record(drafted, accepted)
        req.spec_token_ids.clear()
        req.spec_token_probs = None
        if req.is_finished or req.request_id in self._failures:
            return
        req.num_computed_tokens += accepted
        if accepted < drafted and self.drafts is not None:
            kept = DraftSlot.of(req.state_slot, self.spec.num_speculative_tokens, accepted)
            self.drafts.copy_to(kept.slot, self.states, req.state_slot)

    def _propose(self, rows: list[SampledRows]) -> None:
        """Drafts for the requests that got tokens this step and decode on: at most num_speculative_tokens, leaving
        room for the token the verify step adds (max_tokens) and inside max_model_len. Finished ones are handed to
        the proposer's finish."""
        k = self.spec.num_speculative_tokens
        wanted = []
        for r in rows:
            req = r.request
            if req.request_id in self._failures:
                continue
            if req.is_finished:
                self.proposer.finish(req, req.output_ids)
                continue
            room = min(k, req.max_tokens - len(req.output_ids) - 1, self.max_model_len - req.num_tokens)
            if req.num_computed_tokens == req.num_tokens - 1:
                wanted.append(DraftRequest(req, max(room, 0)))
        try:
            proposed = self.proposer.propose(wanted)
        except Exception:  # noqa: BLE001 — drafts only ever save time: decode on without them
            log.exception("the %s proposer failed; this step's requests decode on without drafts", self.spec.method)
            return
        for want, proposal in zip(wanted, proposed):
            want.seq.spec_token_ids = proposal.tokens[:want.room]
            probs = proposal.probs
            want.seq.spec_token_probs = probs[:len(want.seq.spec_token_ids)] if probs is not None else None

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampleOutput:
        """Sample the batch at once; if that fails, row by row, so only the requests whose rows fail are failed
        (their token is -1 and they are in `_failures`). Greedy rows pick the same token either way."""
        try:
            if self.faults is not None:
                for req in reqs:
                    self.faults.check("sample", req.request_id, req.prompt_ids)
            return self.sampler.sample(logits, [r.sampling for r in reqs])
        except Exception as exc:  # noqa: BLE001 — find the row(s) it belongs to
            log.warning("batched sampling failed (%s: %s); sampling row by row", type(exc).__name__, exc)
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for row, req in enumerate(reqs):
            try:
                if self.faults is not None:
                    self.faults.check("sample", req.request_id, req.prompt_ids)
                one = self.sampler.sample(logits[row:row + 1], [req.sampling])
                tokens.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
            except Exception as exc:  # noqa: BLE001 — this row's request fails alone
                self._fail(req.request_id, "sample", exc)
                tokens.append(-1)
                logprobs.append(None)
        return SampleOutput(tokens, logprobs)

    # ---- failures ----
    def _fail(self, request_id: str, phase: str, exc: BaseException) -> None:
        """Finish every completion of the request, free what they hold, and record the failure (logged once)."""
        if request_id in self._failures:
            return
        failure = RequestFailure(request_id, phase, describe(phase, exc))
        log.error("request %s failed in the %s phase", request_id, phase, exc_info=exc)
        self._failures[request_id] = failure
        self.abort(request_id, reason="error")

    def _without_failed(self, plan: StepPlan) -> StepPlan:
        """The plan less the chunks of failed requests; the KDA checkpoints those chunks were to write are dropped."""
        if not self._failures:
            return plan
        keep = [i for i, c in enumerate(plan.chunks) if c.request.request_id not in self._failures]
        if len(keep) == len(plan.chunks):
            return plan
        if self.prefix is not None:
            dropped = {slot for i, snaps in enumerate(plan.snapshots) if i not in keep for _, slot in snaps
                       if isinstance(slot, int)}  # prefix-cache checkpoints (draft states are the request's own)
            self.prefix.drop_pending(dropped)
        return StepPlan([plan.chunks[i] for i in keep], [plan.snapshots[i] for i in keep] if plan.snapshots else [])

    def _fail_batch(self, plan: StepPlan, phase: str, exc: BaseException) -> None:
        log.error("step failed in the %s phase; failing its batch of %d requests", phase, len(plan.chunks))
        if self.prefix is not None:
            self.prefix.drop_pending()  # possibly half-written
        for req, _ in plan.chunks:
            self._fail(req.request_id, phase, exc)

    def _fail_all(self, phase: str, exc: BaseException) -> None:
        """Fail every request; if the pools still do not add up, the engine cannot go on."""
        log.error("step failed in the %s phase; failing all %d requests", phase, len(self._requests))
        if self.prefix is not None:
            self.prefix.drop_pending()
        for request_id in list(self._requests):
            self._fail(request_id, phase, exc)
        try:
            self.check_integrity()
        except AssertionError as broken:
            raise EngineBrokenError(f"the cache pools are inconsistent after a failed step: {broken}") from exc

    def _append_token(self, req: Request, token: int, logprob: TokenLogprobs | None) -> CoreOutput:
        grammar = req.sampling.grammar
        if grammar is not None and not grammar.consume_token(token):
            raise RuntimeError(f"the structured-output grammar rejected token {token}: {grammar.get_error()}")
        req.output_ids.append(token)
        p = req.params
        past_min = len(req.output_ids) >= p.min_tokens
        status, stop_reason = None, None
        if past_min and not p.ignore_eos and token in self.eos_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif past_min and token in p.stop_token_ids:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif grammar is not None and grammar.is_stopped():  # the grammar is complete: nothing but a stop id fits
            status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        kv_params = None
        if status is not None:
            if req.remote_decode_tokens is not None:
                kv_params = self._stage_kv(req)
            self.scheduler.finish(req, status)
            req.finish_reason = status.value
        scored = req.prompt_logprobs if req.prompt_logprobs is not None and len(req.output_ids) == 1 else None
        return CoreOutput(req.request_id, req.index, token, logprob, req.finish_reason, stop_reason, req.prompt_len,
                          req.num_cached_tokens, scored, kv_params)

    def _stage_kv(self, req: Request) -> dict:
        """A prefill instance's finished request: its cache copied out for the decode instance to pull (the pages
        and slot are then freed with the request); the kv_transfer_params that pull takes."""
        n = req.remote_decode_tokens
        if n == 0:  # a one-token prompt: the decode instance computes it all
            return {"do_remote_prefill": True, "num_tokens": 0}
        payload = export_kv(self.pages, self.states, req.block_ids, req.state_slot, req.prompt_ids[:n],
                            _image_digests(req, n))
        return self.kv_producer.stage(uuid.uuid4().hex, payload)

    def _fork_siblings(self, fwd: ForwardOutput) -> list[SampledRows]:
        """The rows each request samples from, in logits order. n > 1: once a prompt is computed, the other n - 1
        samples share its pages and copy its KDA state, and all draw their first token from the same logits row."""
        rows: list[SampledRows] = []
        first = 0
        for req, count in zip(fwd.sampled, fwd.num_rows):
            rows.append(SampledRows(req, first, count))
            while req.siblings_pending:
                child = self._next_sibling(req)
                if self._share_prefix(req, child):
                    rows.append(SampledRows(child, first, 1))
                    if fwd.hidden is not None:  # the drafter's next row of the child reads the prompt's last state
                        state = fwd.hidden[fwd.sample_rows[first + count - 1]]
                        child.drafter_hidden = (req.num_computed_tokens - 1, state.clone())
                else:
                    self.scheduler.add(child)  # no room to fork now: it computes the prompt itself later
            first += count
        return rows

    def _next_sibling(self, req: Request) -> Request:
        params, max_tokens, grammar = self._n[req.request_id]
        req.siblings_pending -= 1
        child = self._new_request(req.request_id, req.prompt_ids, params, max_tokens,
                                  params.n - 1 - req.siblings_pending, grammar)
        child.images = req.images
        child.cache_salt, child.client = req.cache_salt, req.client
        self._requests[req.request_id].append(child)
        return child

    def _spawn_unforked(self, req: Request) -> None:
        while req.siblings_pending:
            self.scheduler.add(self._next_sibling(req))

    def _share_prefix(self, parent: Request, child: Request) -> bool:
        """Start `child` where `parent` is: the full pages of its computed tokens shared, the page being written
        copied (at the end of the step, after the drafter's rows: `_pending_copies`), the KDA state copied. Pages
        the parent holds past its computed tokens (the drafter's lookahead) are its own."""
        pages, states = self.pages, self.states
        num_full, partial = divmod(parent.num_computed_tokens, pages.block_size)
        partial = partial != 0
        if not self.scheduler.can_fork(parent) or not states.can_allocate() or not pages.can_allocate(int(partial)):
            return False
        child.state_slot = states.allocate()
        states.copy(parent.state_slot, child.state_slot)
        full = parent.block_ids[:num_full]
        pages.share(full)
        child.block_ids = list(full)
        if partial:  # the last page is still being written: copy it so both can append
            (block,) = pages.allocate(1)
            self._pending_copies.append((parent.block_ids[num_full], block))
            child.block_ids.append(block)
        child.num_computed_tokens = child.num_drafter_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.scheduler.running.append(child)
        return True

    def _forget_if_done(self, request_id: str) -> None:
        reqs = self._requests.get(request_id)
        if reqs is not None and all(r.is_finished and not r.siblings_pending for r in reqs):
            del self._requests[request_id]
            del self._n[request_id]

    # ---- introspection ----
    def stats(self) -> dict:
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": 1 - self.pages.num_free / self.pages.num_blocks,
                "state_slot_usage": 1 - self.states.num_free / self.states.num_slots,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": self.prefix.num_queries if self.prefix else 0,
                "prefix_cache_hits": self.prefix.num_hit_tokens if self.prefix else 0,
                **(self.spec_stats.as_dict() if self.spec is not None else {}), **self._kv_transfer_stats()}

    def take_kv_transfer_times(self) -> list[float]:
        """The seconds each transfer (pull) took, for those that arrived since the last call (the server's
        histogram)."""
        times, self._transfer_times = self._transfer_times, []
        return times

    def _kv_transfer_stats(self) -> dict:
        """Counters of the transfer halves this instance runs, cumulative; the server's metrics take `kv_transfer_*`
        and `kv_expired_requests` from here."""
        out = {}
        if self.kv_producer is not None:
            p = self.kv_producer
            out.update(kv_transfers_staged=p.num_staged, kv_transfers_sent=p.num_sent, kv_transfers_held=p.num_held,
                       kv_expired_requests=p.num_expired, kv_transfer_bytes_sent=p.bytes_sent)
        if self.kv_consumer is not None:
            c, failures = self.kv_consumer, self.kv_consumer.failures()
            out.update(kv_transfers_received=c.num_received, kv_transfer_bytes_received=c.bytes_received,
                       kv_transfers_in_flight=len(self._pulling) + len(self._loaded),
                       kv_transfers_recomputed=self.kv_transfers_recomputed,
                       kv_transfer_failures=sum(failures.values()), kv_transfer_failures_by_stage=failures)
        if out:
            out["kv_transfer_bytes"] = out.get("kv_transfer_bytes_sent", 0) + out.get("kv_transfer_bytes_received", 0)
        return out

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def summary(self) -> EngineSummary:
        """What was loaded and how the pools were sized (the server's start-up banner)."""
        args, config = self.args, self.config
        latent, keys = args.latent_cache_8bit(), args.index_cache_8bit() if config.has_dsa else None
        page_bytes = (PagePool.bytes_per_token(config, DTYPES[self.dtype.name], latent, keys,
                                               drafter_cache_layers(config, self.spec, self.drafter)) * args.block_size)
        return EngineSummary(
            model_path=str(self.model_path), family=config.family,
            architecture=config.architectures[0] if config.architectures else "", layers=layer_mix(config),
            dtype=self.dtype.name, dtype_reason=self.dtype.reason, backend=self.backend.name,
            backend_reason=self.backend.reason, backend_prepared=self.backend_prepared, ops=self.backend.ops.name,
            quantization=quantization_text(self.model, config, args.quantization),
            kv_cache_dtype=args.kv_cache_dtype if latent is not None else self.dtype.name,
            weight_bytes=self.weight_bytes, weight_bytes_by_format=self.weight_bytes_by_format,
            kv_cache_memory=args.kv_cache_memory_bytes,
            num_pages=self.pages.num_blocks, block_size=args.block_size, page_bytes=page_bytes,
            num_state_slots=self.states.num_slots,
            num_checkpoints=self.checkpoints.num_slots if self.checkpoints is not None else 0,
            state_slot_bytes=StateSlots.bytes_per_slot(config, self.model.shard), max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            prefix_caching=self.prefix is not None)


def _drafts_with_probs(req: Request) -> bool:
    """Drafts drawn from a distribution for a random request: verified by rejection sampling, row by row."""
    return req.spec_token_probs is not None and not req.params.greedy


def _take_rows(logits: torch.Tensor, rows: list[SampledRows]) -> torch.Tensor:
    """The logits rows of `rows`, in order: the tensor itself when that is every row as it lies (no gathered copy
    of [batch, vocab] fp32)."""
    index = [r.first + i for r in rows for i in range(r.count)]
    return logits if index == list(range(logits.shape[0])) else logits[index]


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


def _image_digests(req: Request, num_tokens: int) -> tuple[str, ...]:
    """The content digests of the request's images within its first `num_tokens` tokens."""
    return tuple(image.digest for first, _, image in req.images if first < num_tokens)


def _drafter(spec, model, model_path: Path, dtype: torch.dtype):
    """The DSpark drafter `spec` names, by default the one beside the model (MODEL/dspark); None for other methods.
    A ConfigError for MTP drafting without MTP layers, or a DSpark drafter that is not there."""
    if spec is not None and spec.method == "mtp" and not model.mtp_available:
        raise ConfigError(f"speculative_config method 'mtp': {model_path} has no MTP layers "
                          f"(num_nextn_predict_layers is {model.config.num_nextn_predict_layers})")
    if spec is None or spec.method != "dspark":
        return None
    path = Path(spec.model) if spec.model else model_path / "dspark"
    if not (path / "config.json").is_file():
        raise ConfigError(f"speculative_config method 'dspark': no drafter at {path} (name its folder as "
                          f"speculative_config.model, or ship one beside the model as MODEL/dspark)")
    return load_drafter(path, model.config, dtype)

