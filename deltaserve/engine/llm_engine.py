"""LLMEngine: the EngineCore and the OutputProcessor in one process (the offline path): add / step / abort."""

from __future__ import annotations

from pathlib import Path

from ..tokenizer import load_tokenizer
from ..vision import ImageError, ProcessedImage, expand_prompt, preprocess
from .config import EngineArgs
from .core import EngineCore
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import InvalidRequestError, SamplingParams


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from ..default_model import default_model_path

        self.args = args
        self.model_path = Path(args.model) if args.model else default_model_path()
        self.core = EngineCore(args, self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.processor = OutputProcessor(self.tokenizer, self.core.eos_ids, self.core.faults)

    # the parts, for tests and tools
    model = property(lambda self: self.core.model)
    config = property(lambda self: self.core.config)
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    pages = property(lambda self: self.core.pages)
    states = property(lambda self: self.core.states)
    prefix = property(lambda self: self.core.prefix)
    max_model_len = property(lambda self: self.core.max_model_len)
    dtype = property(lambda self: self.core.dtype.name)  # as resolved from `args.dtype` (engine/config.py)

    @property
    def eos_ids(self) -> set[int]:
        return self.core.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.core.eos_ids = self.processor.eos_ids = set(ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, client: str | None = None, images: list | None = None) -> None:
        """Tokenise and queue. Raises InvalidRequestError naming the problem; nothing is allocated then.
        Requests with different `cache_salt` never share prefix-cache pages. The scheduler shares the engine
        fairly between `client` keys (default: each request its own). `images` (encoded bytes or Pillow images)
        go where a text prompt holds `<|kimi_image_placeholder|>`, one each, in order (a token-id prompt holds
        their expanded runs already; docs/vision.md)."""
        params = params or SamplingParams()
        processed = self._images(images or [])
        if processed and isinstance(prompt, str):
            try:
                ids = expand_prompt(prompt, processed, self.tokenizer)
            except ImageError as exc:
                raise InvalidRequestError("prompt", str(exc)) from None
        elif isinstance(prompt, str):
            # special spellings become their ids, as the server's completions and a Hugging Face tokenizer encode them
            ids = self.tokenizer.encode(prompt, allow_special=True)
        else:
            ids = [int(t) for t in prompt]
        self.core.add_request(request_id, ids, params, cache_salt, client, processed)
        self.processor.add(request_id, prompt if isinstance(prompt, str) else None, ids, params)

    def _images(self, images: list) -> list[ProcessedImage]:
        if not images:
            return []
        if self.core.media is None:
            raise InvalidRequestError("images", "this engine takes no images (no vision tower, or several ranks)")
        out = []
        for i, image in enumerate(images):
            if isinstance(image, ProcessedImage):  # processed already (a chat's image parts)
                out.append(image)
                continue
            try:
                out.append(preprocess(image, self.core.media))
            except ImageError as exc:
                raise InvalidRequestError("images", f"image {i}: {exc}") from None
        return out

    def abort_request(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, update. Returns outputs of requests that changed this step; a
        request the engine failed comes back finished, with `error` set (the others are unaffected)."""
        core_outputs = self.core.step()
        failures = {f.request_id: f.message for f in self.core.take_failures()}
        with self.core.timer.phase("detokenize"):
            outputs, stops, text_failures = self.processor.process(core_outputs)
        for request_id, index in stops:
            self.core.abort(request_id, index, reason="stop")
        for request_id in text_failures:
            self.core.abort(request_id, reason="error")
        failures.update(text_failures)
        failed = [self.processor.fail(rid, message) for rid, message in failures.items()]
        return outputs + [out for out in failed if out is not None]

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (also done when the engine is collected)."""
        self.core.close()
