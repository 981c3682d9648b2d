"""OutputProcessor: turns CoreOutputs (token ids) into vLLM-shaped RequestOutputs (text, logprobs, finish reasons).

It owns detokenisation and stop strings, so it runs where the tokenizer is (the API process behind the server).
A stop string that matches ends the completion here and is reported back as an abort for the core.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .core import CoreOutput
from .detokenizer import StopChecker
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


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

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self._groups: dict[str, _Group] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams) -> None:
        self._groups[request_id] = _Group(prompt, prompt_ids, params, self.tokenizer)

    def abort(self, request_id: str) -> None:
        self._groups.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Returns the outputs of the requests that changed, and the (request_id, index) completions that a stop
        string ended, which the core must abort."""
        changed: dict[str, None] = {}
        stops: list[tuple[str, int]] = []
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is None:
                continue  # aborted meanwhile
            comp = group.completions[out.index]
            if comp.finish_reason is not None:
                continue  # a stop string ended it; the core had one more token in flight
            group.num_cached_tokens = out.num_cached_tokens
            comp.token_ids.append(out.token_id)
            if out.logprob is not None:
                comp.logprobs.append(out.logprob)
            p = comp.params
            past_min = len(comp.token_ids) >= p.min_tokens
            # vLLM: an eos / stop_token_ids token ends the text without its own text (kept with
            # include_stop_str_in_output); its id stays in token_ids.
            stop_token = out.finish_reason == "stop"
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
            changed[out.request_id] = None
        return [self._output(rid) for rid in changed], stops

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
        return RequestOutput(request_id, group.prompt, group.prompt_ids, outs, finished, group.num_cached_tokens)
