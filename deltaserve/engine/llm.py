"""The offline API: `LLM(model=...).generate(prompts, sampling_params)` and `LLM.chat(messages)`, vLLM's shape."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

from tqdm import tqdm

from ..chat import render_chat
from ..errors import RequestFailedError
from .config import EngineArgs
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a batch (strings or token-id lists); outputs come back in input order.
        Every request is validated before any is queued, so a bad one leaves the engine untouched. The batch is
        one client to the scheduler, so its prompts are admitted in order (FCFS). If the engine fails a request,
        the others still run to the end and RequestFailedError is raised with every output (`outputs`, failed ones
        with `error` set)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p, client=ids[0])
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat format, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.tokenizer, self.engine.config, conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        outputs = [done[i] for i in ids]
        failed = [out for out in outputs if out.error is not None]
        if failed:
            raise RequestFailedError(f"{len(failed)} of {len(outputs)} requests failed; the first: "
                                     f"{failed[0].error}", outputs)
        return outputs
