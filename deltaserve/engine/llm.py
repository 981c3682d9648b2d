"""The offline API: `LLM(model=...).generate(prompts, sampling_params)` and `LLM.chat(messages)`, vLLM's shape."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count
from numbers import Integral
from typing import Any

from tqdm import tqdm

from ..chat import render_chat
from ..errors import RequestFailedError
from ..vision import ImageError, image_part_run
from .config import EngineArgs
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .representable import COUNT_MAX, is_utf8
from .sampling_params import InvalidRequestError, SamplingParams

Prompt = str | list[int] | dict  # a dict: vLLM's {"prompt" or "prompt_token_ids", "multi_modal_data": {"image"}}


def _is_token_id(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and 0 <= value <= COUNT_MAX


def _prompt_list(prompts: Any) -> list[Prompt]:
    """`prompts` as a list of prompts: one string, one token-id list, or a sequence of those.

    Raises InvalidRequestError (field "prompt") for anything else: a dict, a prompt of floats, bools or digit
    strings, a string that is not valid UTF-8. Vocabulary and length are the engine's checks."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and not isinstance(prompts[0], (str, list, tuple, dict))):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError("prompt", "prompts must be a string, a list of token ids (ints >= 0), or a list "
                                            f"of those, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
            media = prompt.get("multi_modal_data") or {}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt) or set(media) - {"image"}:
                raise InvalidRequestError("prompt", f"prompt {i}: a dict prompt takes 'prompt' or 'prompt_token_ids' "
                                                    f"and optionally multi_modal_data {{'image': ...}}")
            _prompt_list([prompt.get("prompt", prompt.get("prompt_token_ids"))])
        elif isinstance(prompt, str):
            if not is_utf8(prompt):
                raise InvalidRequestError("prompt", f"prompt {i} is not valid UTF-8 (it holds a lone surrogate)")
        elif not (isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt)):
            raise InvalidRequestError("prompt", f"prompt {i} must be a string or a list of token ids (ints in "
                                                f"[0, {COUNT_MAX}], not bools), got {str(prompt)[:80]}")
    return list(prompts)


def _params_list(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """One validated SamplingParams per prompt; raises InvalidRequestError (field "sampling_params" or the
    parameter's own name) before anything is queued."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params or SamplingParams()] * num_prompts
    else:
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise InvalidRequestError("sampling_params", f"{len(params)} sampling params for {num_prompts} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise InvalidRequestError("sampling_params", f"expected SamplingParams, got {type(p).__name__}")
        p.validate()  # the caller may have changed fields since construction
    return params


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a batch (strings, token-id lists, or vLLM's dicts: {"prompt": text holding one
        `<|kimi_image_placeholder|>` per image, "multi_modal_data": {"image": [bytes or Pillow images]}}); outputs
        come back in input order.
        Every request is validated before any is queued, so a bad one leaves the engine untouched; malformed
        prompts and params raise InvalidRequestError. The batch is one client to the scheduler, so its prompts are
        admitted in order (FCFS). If the engine fails a request, the others still run to the end and
        RequestFailedError is raised with every output (`outputs`, failed ones with `error` set)."""
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                images = None
                if isinstance(prompt, dict):
                    images = (prompt.get("multi_modal_data") or {}).get("image")
                    images = images if isinstance(images, (list, tuple)) or images is None else [images]
                    prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
                self.engine.add_request(rid, prompt, p, client=ids[0], images=images)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def close(self) -> None:
        """Stop the tensor-parallel workers (`with LLM(...) as llm:` does it on leaving)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat format, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            images: list = []
            ids = render_chat(self.tokenizer, self.engine.config, conv,
                              image_ids=self._image_run(images) if self.engine.core.media is not None else None)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _image_run(self, images: list):
        """The renderer's `image_ids`: an image part's data decoded and processed (appended to `images`), and its
        media run's ids."""
        def run(part) -> list[int]:
            try:
                return image_part_run(part, self.engine.core.media, self.tokenizer, images)
            except ImageError as exc:
                raise InvalidRequestError("messages", f"image {len(images)}: {exc}") from None
        return run

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
