"""OutputProcessor: turns CoreOutputs (token ids) into vLLM-shaped RequestOutputs (text, logprobs, finish reasons).

It owns detokenisation and stop strings, so it runs where the tokenizer is (the API process behind the server).
A stop string that matches ends the completion here and is reported back as an abort for the core. A failure while
processing one request's token fails that request only; the caller aborts it in the core and tells its client.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..tokenizer import Tokenizer
from .core import CoreOutput
from .detokenizer import StopChecker
from .faults import FaultInjector, describe
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


log = logging.getLogger(__name__)


class Processed(NamedTuple):
    outputs: list[RequestOutput]  # the requests that changed (failed ones excluded)
    stops: list[tuple[str, int]]  # (request_id, index) completions a stop string ended: abort them in the core
    failures: dict[str, str]  # request_id -> message: requests that failed here; abort them in the core


class _Completion:
    def __init__(self, index: int, tokenizer: Tokenizer, params: SamplingParams):
        self.index, self.params = index, params
        self.checker = StopChecker(tokenizer, params)
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class _Group:
    """The n completions of one request id."""

    def __init__(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer):
        self.prompt, self.prompt_ids, self.params = prompt, prompt_ids, params
        self.completions = [_Completion(i, tokenizer, params) for i in range(params.n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = None
        self.kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: set[int], faults: FaultInjector | None = None):
        self.tokenizer, self.eos_ids, self.faults = tokenizer, eos_ids, faults
        self._groups: dict[str, _Group] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams) -> None:
        self._groups[request_id] = _Group(prompt, prompt_ids, params, self.tokenizer)

    def abort(self, request_id: str) -> None:
        self._groups.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """The final output of a request that failed: its unfinished completions end with finish_reason "error" and
        `error` holds the message. None if the request is unknown here."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for c in group.completions:
            if c.finish_reason is None:
                c.finish_reason = "error"
        out = self._output(request_id)
        out.error = message
        return out

    def process(self, outputs: list[CoreOutput]) -> Processed:
        changed: dict[str, None] = {}
        stops: list[tuple[str, int]] = []
        failures: dict[str, str] = {}
        for out in outputs:
            if out.request_id in failures:
                continue
            group = self._groups.get(out.request_id)
            if group is None:
                continue  # aborted meanwhile
            try:
                if self._append(group, out, stops):
                    changed[out.request_id] = None
            except Exception as exc:  # noqa: BLE001 — this request's text: fail it alone
                log.error("request %s failed in the detokenize phase", out.request_id, exc_info=exc)
                failures[out.request_id] = describe("detokenize", exc)
                changed.pop(out.request_id, None)
        stops = [(rid, index) for rid, index in stops if rid not in failures]
        return Processed([self._output(rid) for rid in changed], stops, failures)

    def _append(self, group: _Group, out: CoreOutput, stops: list[tuple[str, int]]) -> bool:
        """Take one token of one completion; False when the completion had already ended."""
        if self.faults is not None:
            self.faults.check("detokenize", out.request_id, group.prompt_ids)
        comp = group.completions[out.index]
        if comp.finish_reason is not None:
            return False  # a stop string ended it; the core had one more token in flight
        group.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            group.prompt_logprobs = out.prompt_logprobs
        if out.kv_transfer_params is not None:
            group.kv_transfer_params = out.kv_transfer_params
        comp.token_ids.append(out.token_id)
        if out.logprob is not None:
            comp.logprobs.append(out.logprob)
        p = comp.params
        past_min = len(comp.token_ids) >= p.min_tokens
        # vLLM: an eos / stop_token_ids token ends the text without its own text (kept with
        # include_stop_str_in_output); its id stays in token_ids. The last token of a completed grammar also
        # finishes with "stop", and keeps its text.
        stop_token = out.finish_reason == "stop" and (out.token_id in self.eos_ids or out.token_id == out.stop_reason)
        stop_str = None
        if not stop_token or p.include_stop_str_in_output:
            stop_str = comp.checker.append(out.token_id, check_stops=past_min)
        if stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
            if out.finish_reason is None:
                stops.append((out.request_id, out.index))
        elif out.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
        if comp.finish_reason is not None:
            comp.checker.finish()
        return True

    def _output(self, request_id: str) -> RequestOutput:
        group = self._groups[request_id]
        outs = []
        for c in group.completions:
            cum = sum(lp.logprob for lp in c.logprobs) if c.logprobs else None
            outs.append(CompletionOutput(c.index, c.checker.text, list(c.token_ids), cum,
                                         list(c.logprobs) if c.params.logprobs is not None else None,
                                         c.finish_reason, c.stop_reason, c.checker.delta(c.finish_reason is not None)))
        finished = group.finished
        if finished:
            del self._groups[request_id]
        return RequestOutput(request_id, group.prompt, group.prompt_ids, outs, finished, group.num_cached_tokens,
                             prompt_logprobs=group.prompt_logprobs, kv_transfer_params=group.kv_transfer_params)
