"""Completions and chat completions: prompt preparation, streaming (SSE) and non-streaming responses."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import render_chat, thinks_by_default
from ..config import ModelConfig
from ..engine.grammar import Grammars
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from ..errors import RequestFailedError
from ..tokenizer import Tokenizer
from ..chat.base import IMAGE_PARTS
from ..vision import ImageError, ImageLimits, MediaConfig, ProcessedImage, image_part_run, image_part_url
from .access_log import current_record
from .engine_client import EngineClient, EngineDeadError
from .limits import RequestLimits, SequenceQueue
from .constraints import chat_output_grammar, forcing
from .metrics import Metrics
from .parsers import parser_for
from .protocol import (ChatCompletionRequest, ChatPromptOptions, CompletionRequest, TokenizeRequest, error_body,
                       sse_data)


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: Tokenizer
    config: ModelConfig
    model_path: Path
    served_names: list[str]
    metrics: Metrics
    api_key: str | None = None
    max_queue_len: int = 256
    max_request_bytes: int = 16 << 20
    created: int = field(default_factory=lambda: int(time.time()))
    limits: RequestLimits = field(default_factory=RequestLimits)
    queue: SequenceQueue = field(init=False)  # sequences admitted and unfinished, bounded by max_queue_len
    default_thinking: bool = field(init=False)  # whether a chat request that says nothing about thinking thinks
    grammars: Grammars = field(init=False)  # checks structured-output constraints before they are queued
    allowed_media_domains: tuple[str, ...] = ()  # hosts whose image URLs the server fetches (--allowed-media-domains)
    media: MediaConfig | None = field(init=False)  # the image processor's constants, for a model that takes images

    def __post_init__(self) -> None:
        self.queue = SequenceQueue(self.max_queue_len)
        has_media = (self.model_path / "preprocessor_config.json").is_file()
        self.media = MediaConfig.load(self.model_path) if has_media else None
        self.grammars = Grammars(self.tokenizer, self.config.vocab_size,
                                 self.tokenizer.stop_token_ids(self.config.eos_token_ids))
        self.default_thinking = thinks_by_default(self.tokenizer, self.config)

    def check_constraint(self, spec: StructuredOutputsParams, param: str) -> None:
        """A 400 naming `param` when llguidance cannot compile the constraint for this model."""
        try:
            self.grammars.compile(spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(param, str(exc).replace("structured_outputs", param, 1)) from None

    def chat_constraint(self, chat: ChatPromptOptions, body: StructuredOutputsParams | None, param: str,
                        parallel_tool_calls: bool, thinking: bool) -> StructuredOutputsParams | None:
        """The whole-output constraint of a chat: `body` (from the request field `param`) on the content, or the calls
        its tool_choice forces, inside the model's output format (server/constraints.py); checked."""
        forced = forcing(chat.tool_dicts(), chat.tool_choice_value(), parallel_tool_calls)
        if body is None and forced is None:
            return None
        if body is not None and forced is not None:
            raise InvalidRequestError("tool_choice", f"tool_choice {chat.tool_choice_value()!r} forces tool calls, so "
                                                     f"{param} cannot also constrain the content; send one of them")
        param = param or "tool_choice"
        spec = chat_output_grammar(self.config, self.tokenizer, thinking, body, forced, param)
        self.check_constraint(spec, param)
        return spec

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise InvalidRequestError(param, "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise InvalidRequestError(param, f"token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})")
        if len(ids) >= self.engine.max_model_len:
            raise InvalidRequestError(param, f"this model's maximum context length is {self.engine.max_model_len} "
                                             f"tokens, but the prompt has {len(ids)} tokens (at least one token "
                                             f"must be generated)")

    def check_room(self, ids: list[int], params: SamplingParams, param: str) -> None:
        """As vLLM: a prompt plus an explicit max_tokens must fit the context."""
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.engine.max_model_len:
            raise InvalidRequestError(param, f"this model's maximum context length is {self.engine.max_model_len} "
                                             f"tokens; the prompt has {len(ids)} tokens and {params.max_tokens} "
                                             f"more were requested")

    async def fetch_images(self, messages: list) -> dict[str, bytes]:
        """The bytes of every remote image URL in the messages' image parts whose host is allowed (the others are
        refused when rendered): fetched without following redirects, at most ImageLimits.max_bytes each, within
        MEDIA_FETCH_TIMEOUT_S; a failed fetch is a 400 naming the URL."""
        urls = {url for m in messages if isinstance(m.get("content"), list) for part in m["content"]
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS and (url := image_part_url(part))
                and urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname in self.allowed_media_domains}
        fetched: dict[str, bytes] = {}
        if not urls:
            return fetched
        cap = ImageLimits.max_bytes
        async with httpx.AsyncClient(timeout=MEDIA_FETCH_TIMEOUT_S, follow_redirects=False) as client:
            for url in sorted(urls):
                try:
                    async with client.stream("GET", url) as answer:
                        if answer.status_code != 200:
                            raise InvalidRequestError("messages", f"image URL {url}: HTTP {answer.status_code}")
                        body = bytearray()
                        async for chunk in answer.aiter_bytes():
                            body += chunk
                            if len(body) > cap:
                                raise InvalidRequestError("messages", f"image URL {url}: more than {cap} bytes")
                except httpx.HTTPError as exc:
                    raise InvalidRequestError("messages", f"image URL {url}: {type(exc).__name__}: {exc}") from None
                fetched[url] = bytes(body)
        return fetched

    def render(self, req: ChatPromptOptions,
               fetched: dict[str, bytes] | None = None) -> tuple[list[int], bool, list[ProcessedImage]]:
        """(prompt ids, whether the output starts in the reasoning channel, its images) of a chat: the one rendering
        chat completions and /tokenize share, with the request's tools, tool_choice, response_format, thinking
        switches, chat_template_kwargs and continue_final_message. A continued final message goes on in its
        response text, so its output starts as content even with thinking on. Image parts (base64 data URLs) are
        decoded (remote ones from `fetched`, `fetch_images`) and processed here, each rendered as its media run; a
        bad one is a 400 naming it."""
        thinking, effort = req.thinking_settings(self.default_thinking)
        images: list[ProcessedImage] = []

        def image_ids(part) -> list[int]:
            if len(images) == self.limits.max_images_per_request:
                raise InvalidRequestError("messages", f"the request holds more than this server's limit of "
                                                      f"{self.limits.max_images_per_request} images "
                                                      f"(--max-images-per-request)")
            try:
                return image_part_run(part, self.media, self.tokenizer, images, fetched)
            except ImageError as exc:
                raise InvalidRequestError("messages", f"image {len(images)}: {exc}") from None

        ids = render_chat(self.tokenizer, self.config, req.messages, add_generation_prompt=req.add_generation_prompt,
                          thinking=thinking, tools=req.tool_dicts(), tool_choice=req.tool_choice_value(),
                          response_format=req.response_format_dict(), thinking_effort=effort,
                          continue_final_message=req.continue_final_message,
                          template_kwargs=req.extra_template_kwargs(),
                          image_ids=image_ids if self.media is not None else None)
        return ids, thinking and not req.continue_final_message, images

    def encode_prompt(self, text: str) -> list[int]:
        """A completion's text prompt -> ids, shared with /tokenize. Special spellings become their ids, as a Hugging
        Face tokenizer (and so vLLM, lm-eval, guidellm) encodes them: the caller writes the whole prompt and could send
        the ids anyway. Chat content never does (chat/template.py)."""
        return self.tokenizer.encode(text, allow_special=True)

    def prompt_ids_for_tokenize(self, req: TokenizeRequest) -> list[int]:
        if req.messages is not None:
            return self.render(req)[0]
        return self.encode_prompt(req.prompt)

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: keep the last `keep` prompt tokens (-1: max_model_len; None: all).
        A value above max_model_len is refused, as vLLM refuses it; 0 leaves an empty prompt, refused later."""
        if keep is None:
            return ids
        limit = self.engine.max_model_len
        if keep > limit:
            raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens ({keep}) is greater than "
                                      f"max_model_len ({limit}); select a smaller truncation size")
        if keep == -1:
            keep = limit
        return ids[max(len(ids) - keep, 0):]

    def metrics_hook(self, outputs, stats) -> None:
        self.metrics.observe_engine_stats(stats)


MEDIA_FETCH_TIMEOUT_S = 10.0


def _sse(obj) -> str:
    return sse_data(json.dumps(obj, ensure_ascii=False, separators=(',', ':')))


def fairness_key(user: str | None, rid: str) -> str:
    """The engine scheduler's fairness key of an API request: its OpenAI `user` when given, else the request
    itself, so all its prompts and n completions share one key. Prefixed so a `user` never names a request."""
    return f"user:{user}" if user is not None else f"request:{rid}"


async def tracked(state: ServerState, request_id: str, prompt: str | None, ids: list[int],
                   params: SamplingParams, cache_salt: str | None, client: str,
                   images: list[ProcessedImage] | None = None) -> AsyncIterator[RequestOutput]:
    """Engine outputs with latency metrics recorded along the way. Closing it closes the engine stream at once
    (which aborts the request in the core), not whenever the garbage collector finalises it."""
    start = last = time.monotonic()
    first = True
    final = None
    access = current_record()  # this HTTP request's access-log line (server/access_log.py); None when off
    if access is not None:
        access.add_engine_request(request_id, len(ids))
    async with aclosing(state.engine.generate(request_id, prompt, ids, params, cache_salt, client,
                                              images)) as outputs:
        try:
            async for out in outputs:
                now = time.monotonic()
                if first:
                    state.metrics.on_first_token(now - start)
                    first = False
                else:
                    state.metrics.on_token(now - last)
                if access is not None:
                    access.on_output(request_id, out, now)
                last = now
                final = out
                yield out
        except RequestFailedError:  # failed inside the engine: counted as finished with reason "error"
            state.metrics.on_finish("error", time.monotonic() - start, len(ids), 0,
                                    sum(len(c.token_ids) for c in final.outputs) if final is not None else 0)
            if access is not None:
                access.finish_engine_request("error")
            raise
    if final is not None:
        reasons = {c.finish_reason for c in final.outputs}
        reason = next(iter(reasons)) if len(reasons) == 1 else "stop"
        state.metrics.on_finish(reason, time.monotonic() - start, len(ids), final.num_cached_tokens,
                                sum(len(c.token_ids) for c in final.outputs))
        if access is not None:
            access.finish_engine_request(reason)


class ClientDisconnected(Exception):
    """The client of a non-streamed request went away before its answer (answered with 499, which nobody reads, so
    the app ends the request normally instead of with an error)."""


async def collect(stream: AsyncIterator[RequestOutput], raw: Request) -> RequestOutput:
    """The final output of a non-streamed request; a client that disconnects meanwhile aborts it (ClientDisconnected).

    The disconnect is awaited on `raw.receive()`: `Request.is_disconnected()` never reports one behind a
    BaseHTTPMiddleware (the API key / size guard is one), see starlette discussion #2094."""
    async def last():
        out = None
        async for out in stream:
            pass
        return out

    async def disconnected():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.create_task(last())
    watch = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client went away (or this handler was cancelled): abort in the engine
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientDisconnected("the client disconnected before the answer")
    return task.result()


def _usage(prompt_tokens: int, completion_tokens: int, cached: int, reasoning: int | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id])


# ---------------------------------------------------------------- completions
def _top_dict(tok: Tokenizer, top) -> dict[str, float]:
    """Completions' top_logprobs {token string: logprob}. Distinct ids can decode alike (e.g. partial UTF-8 to
    U+FFFD); the best (first, `top` is sorted) logprob is kept for such a string rather than the last."""
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(_token_str(tok, t), v)
    return out


def _completion_logprobs(tok: Tokenizer, token_ids: list[int], reports, offset: int,
                         with_token: bool = False) -> dict | None:
    """The legacy completions `logprobs` of `token_ids` from their reports, text offsets from `offset`. A None report
    (an echoed prompt's first token) gives nulls; `with_token` puts each token among its own alternatives, as an
    echoed prompt's are read (vLLM's shape; lm-eval's greedy check compares the token with their best)."""
    if reports is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for tid, r in zip(token_ids, reports):
        s = _token_str(tok, tid)
        tokens.append(s)
        values.append(None if r is None else r.logprob)
        top = _top_dict(tok, r.top) if r is not None and (r.top or with_token) else None
        if top is not None and with_token:
            top.setdefault(s, r.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _prompt_logprobs_json(tok: Tokenizer, reports) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}}
    for the prompt token and its top alternatives."""
    if reports is None:
        return None
    out: list[dict | None] = []
    for r in reports:
        if r is None:
            out.append(None)
            continue
        entry = {str(r.token_id): {"logprob": r.logprob, "rank": r.rank, "decoded_token": _token_str(tok, r.token_id)}}
        for rank, (t, v) in enumerate(r.top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": _token_str(tok, t)})
        out.append(entry)
    return out


def _echo_logprobs(tok: Tokenizer, prompt_ids: list[int], reports) -> dict | None:
    """The legacy completions `logprobs` of an echoed prompt (null for its first token), offsets from 0."""
    return _completion_logprobs(tok, prompt_ids, reports, 0, with_token=True)


def _joined_logprobs(head: dict | None, tail: dict | None) -> dict | None:
    if head is None or tail is None:
        return tail
    return {key: head[key] + tail[key] for key in head}


async def completion(state: ServerState, req: CompletionRequest, raw: Request, rid: str):
    prompts = req.prompt_list()
    inputs = []
    for i, p in enumerate(prompts):
        full = state.encode_prompt(p) if isinstance(p, str) else list(p)
        ids = state.truncate(full, req.truncate_prompt_tokens)
        state.check_prompt(ids)
        # The text is what `echo` shows: the prompt as the model saw it, so a truncated one is decoded back.
        inputs.append((p if isinstance(p, str) and len(ids) == len(full) else state.tokenizer.decode(ids), ids))
    params = req.to_sampling_params(default_max_tokens=16)
    if params.kv_transfer_params is not None and len(inputs) > 1:
        raise InvalidRequestError("kv_transfer_params", "kv_transfer_params takes a request of one prompt")
    spec, param = req.constraint()
    if spec is not None:
        state.check_constraint(spec, param)
    for _, ids in inputs:
        state.check_room(ids, params, "max_tokens")
    state.limits.check_tokens([len(ids) for _, ids in inputs], params.n, params.max_tokens,
                              state.engine.max_model_len, "max_tokens")
    if params.prompt_logprobs is not None:
        state.limits.check_prompt_logprobs([len(ids) for _, ids in inputs],
                                           "prompt_logprobs" if req.prompt_logprobs is not None else "echo")
    model = state.served_names[0] if req.model is None else req.model
    created = int(time.time())
    n = params.n
    client = fairness_key(req.user, rid)
    if (access := current_record()) is not None:
        access.request_id = rid  # its engine requests are named per prompt
    streams = [tracked(state, f"{rid}-{i}", text, ids, params, req.cache_salt, client)
               for i, (text, ids) in enumerate(inputs)]
    echo_lps = req.echo and req.logprobs is not None  # the echoed prompt carries its own logprobs

    if not req.stream:
        collecting = [asyncio.ensure_future(collect(s, raw)) for s in streams]
        try:
            finals = await asyncio.gather(*collecting)
        finally:  # one prompt failed (or the client left): the others stop too rather than run unread
            for t in collecting:
                t.cancel()
            await asyncio.gather(*collecting, return_exceptions=True)
        choices, completion_tokens, cached = [], 0, 0
        for i, (out, (text, ids)) in enumerate(zip(finals, inputs)):
            cached += out.num_cached_tokens
            head = _echo_logprobs(state.tokenizer, ids, out.prompt_logprobs) if echo_lps else None
            scored = (_prompt_logprobs_json(state.tokenizer, out.prompt_logprobs)
                      if req.prompt_logprobs is not None else None)
            for c in out.outputs:
                body = (text + c.text) if req.echo else c.text
                lps = _completion_logprobs(state.tokenizer, c.token_ids, c.logprobs, len(text) if req.echo else 0)
                choice = {"index": i * n + c.index, "text": body, "logprobs": _joined_logprobs(head, lps),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if scored is not None:
                    choice["prompt_logprobs"] = scored
                choices.append(choice)
                completion_tokens += len(c.token_ids)
        prompt_tokens = sum(len(ids) for _, ids in inputs)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, cached),
                             "kv_transfer_params": finals[0].kv_transfer_params})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        queue: asyncio.Queue = asyncio.Queue()
        counts = {"completion": 0, "cached": 0}
        emitted_len: dict[tuple[int, int], int] = {}

        async def pump(i: int, stream):
            """Each stream is iterated and closed by its own task only: closing a stream from another task while
            this one awaits inside it raises "aclose(): asynchronous generator is already running"."""
            try:
                async with aclosing(stream):
                    async for out in stream:
                        await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 — forwarded to the client as an error event
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        done = 0
        started: set[int] = set()
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    yield _sse(stream_error(item))
                    continue
                if i not in started:  # the prompt's first output: its echo and prompt logprobs are known now
                    started.add(i)
                    for chunk in _first_chunks(state.tokenizer, req, inputs[i], item, i * n, n):
                        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [chunk]})
                for c in item.outputs:
                    seen = emitted_len.get((i, c.index), 0)
                    new_ids = c.token_ids[seen:]
                    if not new_ids and not c.delta_text and not c.finished:
                        continue
                    emitted_len[(i, c.index)] = len(c.token_ids)
                    lps = c.logprobs[seen:] if c.logprobs is not None else None
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [{"index": i * n + c.index, "text": c.delta_text,
                                             "logprobs": _completion_logprobs(state.tokenizer, new_ids, lps, 0),
                                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                if item.finished:
                    counts["completion"] += sum(len(c.token_ids) for c in item.outputs)
                    counts["cached"] += item.num_cached_tokens
            if include_usage:
                prompt_tokens = sum(len(ids) for _, ids in inputs)
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(prompt_tokens, counts["completion"], counts["cached"])})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()  # each pump closes its own stream (aborting its request) as it unwinds
            await asyncio.gather(*tasks, return_exceptions=True)

    return StreamingResponse(events(), media_type="text/event-stream")


def _first_chunks(tok: Tokenizer, req: CompletionRequest, prompt: tuple[str, list[int]], out: RequestOutput,
                  first_index: int, n: int) -> list[dict]:
    """What a streamed completion's choices carry before their first token: the echoed prompt (with its logprobs
    when asked) and vLLM's prompt_logprobs; none when neither was asked for."""
    if not req.echo and req.prompt_logprobs is None:
        return []
    text, ids = prompt
    echo_lps = _echo_logprobs(tok, ids, out.prompt_logprobs) if req.echo and req.logprobs is not None else None
    scored = _prompt_logprobs_json(tok, out.prompt_logprobs) if req.prompt_logprobs is not None else None
    chunks = []
    for k in range(n):
        chunk = {"index": first_index + k, "text": text if req.echo else "", "logprobs": echo_lps,
                 "finish_reason": None}
        if scored is not None:
            chunk["prompt_logprobs"] = scored
        chunks.append(chunk)
    return chunks


def stream_error(exc: BaseException) -> dict:
    if isinstance(exc, InvalidRequestError):
        return error_body(str(exc), "BadRequestError", exc.field, 400)
    if isinstance(exc, EngineDeadError):
        return error_body(str(exc), "ServiceUnavailableError", None, 503)
    return error_body(str(exc), "InternalServerError", None, 500)  # RequestFailedError and anything unforeseen


# ---------------------------------------------------------------- chat
def _chat_logprobs(tok: Tokenizer, token_ids: list[int], logprobs) -> dict | None:
    if logprobs is None:
        return None
    content = []
    for tid, lp in zip(token_ids, logprobs):
        s = _token_str(tok, tid)
        content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _token_str(tok, t), "logprob": v,
                                          "bytes": list(_token_str(tok, t).encode())} for t, v in lp.top]})
    return {"content": content}


async def chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request, rid: str):
    ids, thinking, images = state.render(req, await state.fetch_images(req.messages))
    if images and req.truncate_prompt_tokens is not None:
        raise InvalidRequestError("truncate_prompt_tokens", "truncate_prompt_tokens would cut the prompt's images")
    ids = state.truncate(ids, req.truncate_prompt_tokens)
    state.check_prompt(ids, "messages")
    params = req.to_sampling_params(default_max_tokens=None)
    params.structured_outputs = state.chat_constraint(req, *req.constraint(), req.parallel_tool_calls is not False,
                                                      thinking)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    state.check_room(ids, params, max_param)
    state.limits.check_tokens([len(ids)], params.n, params.max_tokens, state.engine.max_model_len, max_param)
    if params.prompt_logprobs is not None:
        state.limits.check_prompt_logprobs([len(ids)], "prompt_logprobs")
    model = state.served_names[0] if req.model is None else req.model
    created = int(time.time())
    stream = tracked(state, rid, None, ids, params, req.cache_salt, fairness_key(req.user, rid), images)
    parser = parser_for(state.config, state.tokenizer)

    if not req.stream:
        out = await collect(stream, raw)
        choices, completion_tokens, reasoning_tokens = [], 0, 0
        for c in out.outputs:
            parsed = parser.parse(c.token_ids, thinking)
            message = {"role": "assistant", "content": (parsed.content or None) if parsed.tool_calls else parsed.content,
                       "reasoning_content": parsed.reasoning_content}
            finish = c.finish_reason
            if parsed.tool_calls:
                message["tool_calls"] = [tc.to_openai() for tc in parsed.tool_calls]
                if finish == "stop":
                    finish = "tool_calls"
            choices.append({"index": c.index, "message": message, "finish_reason": finish,
                            "stop_reason": c.stop_reason,
                            "logprobs": _chat_logprobs(state.tokenizer, c.token_ids, c.logprobs)})
            completion_tokens += len(c.token_ids)
            reasoning_tokens += parsed.reasoning_tokens
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": _usage(len(ids), completion_tokens, out.num_cached_tokens, reasoning_tokens),
                "kv_transfer_params": out.kv_transfer_params}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs_json(state.tokenizer, out.prompt_logprobs)
        return JSONResponse(body)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        stream_parsers = {}
        seen: dict[int, int] = {}
        has_tools: dict[int, bool] = {}
        pending_lps: dict[int, list[dict]] = {}
        final = None

        def chunk(choices: list[dict]) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices})

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            async for out in stream:
                final = out
                for c in out.outputs:
                    sp = stream_parsers.setdefault(c.index, parser.stream(thinking))
                    start = seen.get(c.index, 0)
                    new_ids = c.token_ids[start:]
                    seen[c.index] = len(c.token_ids)
                    deltas = sp.feed(new_ids) if new_ids else []
                    if c.finished:
                        deltas += sp.finish()
                    deltas = [d.to_openai() for d in deltas]
                    # Logprobs of tokens the parser holds back (no delta yet) ride on the next chunk of this choice.
                    new_lps = _chat_logprobs(state.tokenizer, new_ids, c.logprobs[start:] if c.logprobs else None)
                    pending = pending_lps.setdefault(c.index, [])
                    pending += new_lps["content"] if new_lps else []
                    for d in deltas:
                        if d.get("tool_calls"):
                            has_tools[c.index] = True
                        lps = {"content": pending} if pending else None
                        pending = pending_lps[c.index] = []
                        yield chunk([{"index": c.index, "delta": d, "logprobs": lps, "finish_reason": None}])
                    lps = {"content": pending} if pending else None
                    if c.finished:
                        finish = c.finish_reason
                        if has_tools.get(c.index) and finish == "stop":
                            finish = "tool_calls"
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": lps, "finish_reason": finish,
                                      "stop_reason": c.stop_reason}])
            if include_usage and final is not None:
                completion_tokens = sum(len(c.token_ids) for c in final.outputs)
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(len(ids), completion_tokens, final.num_cached_tokens)})
            yield "data: [DONE]\n\n"
        except (InvalidRequestError, EngineDeadError, RequestFailedError) as e:
            yield _sse(stream_error(e))
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")
